"""vLLM-CPU against HF transformers on a tiny DeepSeek-V3 (MLA + MoE) model, layer by layer: vLLM alone, no hstap.

    python benchmarks/research/mla_vllm_vs_hf.py              # every case, vLLM's CPU rotary kernel and the native one
    python benchmarks/research/mla_vllm_vs_hf.py --case full --rope kernel

First, vLLM's CPU rotary kernel alone, on the tensors vLLM's MLA layer hands it, against vLLM's own forward_native.
Then each case builds a random-weight `DeepseekV3ForCausalLM` with the latent vLLM's CPU MLA backends accept
(kv_lora_rank 512 + qk_rope_head_dim 64 = 576) in a temp dir, runs one random 24-token prompt through HF (fp32, eager
attention) and through vLLM's offline `LLM` (fp32, eager, in-process engine core so that forward hooks on its decoder
layers see the prefill), and compares the residual stream after every decoder layer, position by position, and the
first attention output (same input: the embeddings); then 16 greedy tokens from each. `--rope native` starts vLLM with
`custom_ops=["-rotary_embedding"]`, which swaps vLLM's C++ CPU rotary kernel for its PyTorch `forward_native` and
nothing else. vLLM runs in child processes that import vLLM, torch and safetensors only.

Cases (all fp32, hidden 256, 4 heads, qk_nope 32, v 32, vocab 512):
  dense1     one dense layer, no q_lora, default rope: attention + MLP only
  full       3 layers (first_k_dense_replace 1, then MoE: 8 routed experts top-2, 1 shared, sigmoid + noaux_tc with a
             random e_score_correction_bias, routed_scaling_factor 2.5, norm_topk_prob), q_lora_rank 64, default rope
  yarn       full with DeepSeek-V3's yarn rope_scaling (factor 40, mscale = mscale_all_dim = 1, beta 32/1, original 4096)
  nofields   full without scoring_func / topk_method in config.json (HF's DeepseekV3Config has neither field; HF's
             modeling hard-codes sigmoid + noaux_tc; vLLM reads them, default softmax and no correction bias); run
             with vLLM's kernel rope only (the rope does not matter there)

What it showed with vllm-cpu 0.32.0 (docs/engines.md): `dense1` and `full` depart from HF from position 1 of layer 0
with vLLM's CPU rotary kernel (position 0 equal: one key, rope and softmax scale cancel) and agree to fp32 rounding
(rel ~2e-7) with `--rope native`; `yarn` agrees either way (vLLM's DeepSeek yarn rope has no CPU kernel and runs its
PyTorch code); `nofields` does not load (KeyError: ...mlp.gate.e_score_correction_bias).
Prints a table per case, then ONE JSON line with every number. ~1 minute per vLLM start on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("dense1", "full", "yarn", "nofields")
PROMPT_LEN, NEW_TOKENS, VOCAB = 24, 16, 512
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}


def build(case: str, out: Path) -> None:
    """Save the case's random model to `out` (transformers only)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
              n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
    if case == "dense1":
        kw.update(num_hidden_layers=1, q_lora_rank=None)
    if case == "yarn":
        kw.update(max_position_embeddings=4096 * 40, rope_parameters=dict(YARN))
    cfg = DeepseekV3Config(**kw)
    if case != "nofields":
        cfg.scoring_func, cfg.topk_method = "sigmoid", "noaux_tc"  # as DeepSeek-V3's and Kimi-K2's config.json
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a wide init keeps layers and experts distinguishable; a random bias avoids routing ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.5 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(str(out))


def prompt_ids() -> list[int]:
    import torch

    return torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()


def run_hf(model_dir: Path) -> dict:
    """Residual stream after each decoder layer and layer 0's attention output for the prompt; greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    got: dict = {}

    def keep(name, pick):
        def f(m, a, o):  # returns None: the hook must not replace the module's output
            got.setdefault(name, pick(o).clone())
        return f
    hooks = [layer.register_forward_hook(keep(f"layer{i}", lambda o: o[0]))  # (1, T, H) -> (T, H)
             for i, layer in enumerate(model.model.layers)]
    hooks.append(model.model.layers[0].self_attn.register_forward_hook(keep("attn0", lambda o: o[0][0])))
    ids = prompt_ids()
    with torch.no_grad():
        model(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        seq = list(ids)
        for _ in range(NEW_TOKENS):  # greedy without a cache: the reference has no cache to get wrong
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return {"states": got, "tokens": seq[len(ids):]}


def vllm_worker(model_dir: str, out: str, rope: str) -> None:
    """Runs in its own process: vLLM only. Writes the captured states (safetensors) and the greedy tokens (json)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: hooks see its forwards
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    kw = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if rope == "native" else {}
    kw["attention_config"] = {"backend": "CPU_MLA"}  # fp32: vLLM's AMX MLA backend takes bf16 weights only
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
              enable_prefix_caching=False, seed=0, **kw)
    got: dict = {}

    def hook(model):
        def keep(name):
            def f(m, a, o):
                if name not in got and a[0].shape[0] == PROMPT_LEN:  # the prompt's prefill, not a decode step
                    got[name] = (o[0] + o[1]).clone() if isinstance(o, tuple) else o.clone()
            return f
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layer.register_forward_hook(keep(f"layer{i}"))
        layers[0].self_attn.register_forward_hook(keep("attn0"))
        rope = layers[0].self_attn.mla_attn.rotary_emb  # the method it dispatched to: the C++ kernel or PyTorch
        return type(rope).__name__, rope._forward_method.__qualname__

    rope_impl = llm.apply_model(hook)[0]
    res = llm.generate([{"prompt_token_ids": prompt_ids()}],
                       SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    save_file({k: v.contiguous() for k, v in got.items()}, out + ".safetensors")
    Path(out + ".json").write_text(json.dumps({"tokens": list(res[0].outputs[0].token_ids),
                                               "rope_impl": list(rope_impl)}))


def rotary_worker(out: str) -> None:
    """Runs in its own process: vLLM's plain rope alone, called as vllm/model_executor/layers/mla.py:203-230 calls it
    (the query's rope slice of (T, heads, qk_nope + 64) and the key's (T, 1, 64) slice of the latent), kernel against
    vLLM's own forward_native on copies. Writes which (token, head) rope slices each left right / unrotated (json)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    T, H, nope, rd, lora = 6, 4, 32, 64, 512
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(rd, max_position=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    pos, q, kv_lora = torch.arange(T), torch.randn(T, H, nope + rd, generator=g), torch.randn(T, lora + rd, generator=g)
    qk, kvk = q.clone(), kv_lora.clone()
    k_pe = kvk.split([lora, rd], dim=-1)[1].unsqueeze(1)  # (T, 1, 64), strides (576, 64, 1)
    qk[..., nope:], k_pe = rope.forward_cpu(pos, qk[..., nope:], k_pe)
    qn, kn = rope.forward_native(pos, q[..., nope:].clone(), kv_lora[:, lora:].unsqueeze(1).clone())
    Path(out).write_text(json.dumps({
        "shape": {"tokens": T, "heads": H, "q_rope_view_strides": list(q[..., nope:].stride()),
                  "k_pe_strides": list(k_pe.stride())},
        "q_right": [[bool(torch.allclose(qk[t, h, nope:], qn[t, h], atol=1e-5)) for h in range(H)] for t in range(T)],
        "q_unrotated": [[bool(torch.equal(qk[t, h, nope:], q[t, h, nope:])) for h in range(H)] for t in range(T)],
        "k_right": [bool(torch.allclose(k_pe[t, 0], kn[t, 0], atol=1e-5)) for t in range(T)],
        "k_unrotated": [bool(torch.equal(k_pe[t, 0], kv_lora[t, lora:])) for t in range(T)],
        "latent_rows_written": [bool((kvk[t, :lora] != kv_lora[t, :lora]).any()) for t in range(T)]}))


def compare(a, b) -> dict:
    """a: vLLM (T, H), b: HF (T, H). Per-position cosine and relative error, and the first position that departs."""
    import torch

    a, b = a.double(), b.double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
    off = (rel > 1e-4).nonzero().flatten().tolist()
    return {"cos_min": round(float(cos.min()), 6), "rel_max": float(f"{float(rel.max()):.3g}"),
            "rel_pos0": float(f"{float(rel[0]):.3g}"), "first_off": off[0] if off else None}


def run_case(case: str, ropes: list[str], root: Path) -> dict:
    from safetensors.torch import load_file

    model_dir = root / case
    t0 = time.time()
    build(case, model_dir)
    hf = run_hf(model_dir)
    out: dict = {"case": case, "build_and_hf_s": round(time.time() - t0, 1), "hf_tokens": hf["tokens"], "vllm": {}}
    for rope in ropes:
        stem = str(root / f"{case}-{rope}")
        t0 = time.time()
        p = subprocess.run([sys.executable, __file__, "--vllm-worker", str(model_dir), stem, rope],
                           capture_output=True, text=True)
        if p.returncode != 0:
            errors = [line for line in p.stderr.splitlines() if "Error" in line]
            out["vllm"][rope] = {"error": errors[-1] if errors else p.stderr[-2000:]}
            continue
        got = load_file(stem + ".safetensors")
        meta = json.loads(Path(stem + ".json").read_text())
        same = [x == y for x, y in zip(meta["tokens"], hf["tokens"])]
        out["vllm"][rope] = {
            "seconds": round(time.time() - t0, 1), "rope_impl": meta["rope_impl"], "tokens": meta["tokens"],
            "greedy_same_prefix": same.index(False) if False in same else len(same),
            "states": {k: compare(got[k], hf["states"][k]) for k in hf["states"]}}
    return out


def show(r: dict) -> None:
    print(f"\n== {r['case']}: HF greedy {r['hf_tokens']}")
    for rope, v in r["vllm"].items():
        if "error" in v:
            print(f"  vLLM rope={rope}: failed: {v['error']}")
            continue
        print(f"  vLLM rope={rope} ({v['rope_impl'][0]}, {v['rope_impl'][1]}): greedy equal for {v['greedy_same_prefix']}"
              f"/{NEW_TOKENS} tokens; {v['tokens']}")
        for k, c in v["states"].items():
            print(f"    {k:8s} cos_min {c['cos_min']:.6f}  rel_max {c['rel_max']:<9.3g} pos0 rel {c['rel_pos0']:<9.3g}"
                  f" first position off (rel > 1e-4): {c['first_off']}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=CASES, help="repeatable; default: every case")
    ap.add_argument("--rope", action="append", choices=("kernel", "native"), help="repeatable; default: both")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="mla-vllm-hf-") as tmp:
        rot = Path(tmp) / "rotary.json"
        subprocess.run([sys.executable, __file__, "--vllm-rotary", str(rot)], check=True, capture_output=True)
        rotary = json.loads(rot.read_text())
        print("== vLLM's CPU rotary kernel alone, on MLA's views (rows: tokens, columns: heads; 1 = as forward_native)")
        for t, (row, un) in enumerate(zip(rotary["q_right"], rotary["q_unrotated"])):
            print(f"  token {t}: query right {[int(x) for x in row]} unrotated {[int(x) for x in un]}  "
                  f"key right {int(rotary['k_right'][t])} unrotated {int(rotary['k_unrotated'][t])}")
        for case in args.case or CASES:
            ropes = args.rope or (["kernel"] if case == "nofields" else ["kernel", "native"])
            results.append(run_case(case, ropes, Path(tmp)))
            show(results[-1])
    summary = {"bench": "mla_vllm_vs_hf", "rotary_alone": rotary, "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--vllm-worker":
        vllm_worker(*sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "--vllm-rotary":
        rotary_worker(sys.argv[2])
    else:
        main()
