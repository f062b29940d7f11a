"""Speedups at an 8B model's cost: a small target (the reference target, SmolLM2-135M-Instruct: any Llama-family one
with tied or untied embeddings) and its drafter widened, function-preserving, to the Llama-3.1-8B shape
(hstap.models.widen), against the plain target, in one run (H200).

    python benchmarks/bench_wide.py --target ../shared/reference/target-tiny --drafter RUN \
        --data ../shared/reference/corpus/eval.jsonl.gz --prompts 48 --new-tokens 128
    python benchmarks/bench_wide.py --target SMOLLM2_DIR --drafter RUN --data mtbench.jsonl --prompts 80 \
        --new-tokens 128
    python benchmarks/bench_wide.py --tiny   # CPU smoke run: a random SmolLM2-like target widened (numbers mean nothing)

For each target (wide, then reference) on the same prompts, in bf16 on the fast engine (hstap eval's defaults:
FastDecoder, CUDA graphs, torch.compile'd steps), each method over all prompts after a warm-up prompt:
target-only, EAGLE-3 chain (--k, eval's default 5), EAGLE-2 tree (--tree, eval's default 8x6x60) and n-gram prompt
lookup (k = --k, up to 3-grams). Reported per method: tau, tokens/s (the prefill included), speedup over target-only,
the predicted speedup (hstap.speculative.latency.round_model), per-round draft / verify / host ms, and the greedy outputs
against target-only's (hstap.speculative.evaluate.check_lossless: a mismatch within --tie-tol of the top logit is a near-tie).
Target-only also gets decode tok/s (one-token steps only) against its weight-bandwidth bound: weight bytes / the
device-to-device copy bandwidth measured in this run (bytes read + written). The wide target's drafter is the same
drafter widened: the report gives both targets' tau, which agree up to bf16 rounding of the rescaled norms.
--data: what `hstap eval --data` takes (`hstap.data.prompts.load_prompts`): a prepared dir, or a conversations
file (JSONL/JSON/Parquet, e.g. {"id", "messages": [{"role", "content"}, ...]} per line), whose prompt is each record's
messages up to its last user turn, rendered with the target's chat template (so a two-turn MT-bench record with the
target's first answer gives the second turn's prompt); the first --prompts records.
Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import copy_bandwidth, weight_bytes  # noqa: E402

from hstap.layers import default_aux_layers  # noqa: E402
from hstap.models.widen import LLAMA_8B, Shape, widen_drafter, widen_target  # noqa: E402


def wide_pair(target, drafter, shape: Shape):
    """(wide Target, wide drafter) built on the target's device in its dtype."""
    from transformers import AutoModelForCausalLM

    from hstap.models.drafter import Eagle3Drafter
    from hstap.models.target import Target

    wide_aux = default_aux_layers(shape.layers)
    state, fields = widen_target(target.model.state_dict(), target.config, shape, list(drafter.config.aux_layers),
                                 wide_aux)
    cfg = target.config.__class__(**{**target.config.to_dict(), **fields})
    with torch.device(target.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype, attn_implementation="sdpa")
    model.load_state_dict(state, strict=False)
    del state
    dstate, dcfg = widen_drafter(drafter.state_dict(), drafter.config, shape, wide_aux)
    with torch.device(target.device):
        d = Eagle3Drafter(dcfg).to(target.dtype)
    d.load_state_dict(dstate, strict=False)
    return Target(model.eval().requires_grad_(False)), d.eval().requires_grad_(False)


def methods(fd, args, eos) -> dict:
    topk, depth, tokens = (int(x) for x in args.tree.split("x"))
    n = args.new_tokens
    return {"target": lambda p, g: fd.target_generate(p, n, 0.0, eos, g),
            f"chain{args.k}": lambda p, g: fd.speculative_generate(p, n, "chain", args.k, 8, 6, 60, 0.0, eos, g),
            f"tree{args.tree}": lambda p, g: fd.speculative_generate(p, n, "tree", args.k, topk, depth, tokens, 0.0,
                                                                     eos, g),
            "ngram": lambda p, g: fd.ngram_generate(p, n, args.k, 3, 0.0, eos, g)}


def bench_target(name: str, target, drafter, prompts, eos, args, bw: float) -> dict:
    from hstap.speculative.evaluate import check_lossless, run_method
    from hstap.speculative.fast import FastDecoder
    from hstap.speculative.latency import round_model

    longest = max(len(p) for _, p in prompts) + args.new_tokens + 64
    fd = FastDecoder(target, drafter, max_len=longest, compile=None if args.compile else False)
    out, outs = {}, {}
    for m, fn in methods(fd, args, eos).items():
        t0 = time.perf_counter()
        fn(prompts[0][1], torch.Generator(device=target.device).manual_seed(0))  # warm-up: capture, compile
        warm = time.perf_counter() - t0
        outs[m], out[m] = run_method(fn, prompts, 0, target.device)
        out[m]["warmup_s"] = warm
        print(f"{name}: {m} tau {out[m]['tau']:.3f} {out[m]['tokens_per_s']:.1f} tok/s (warm-up {warm:.0f} s)",
              file=sys.stderr, flush=True)
    base = out["target"]
    tol = args.tie_tol if args.tie_tol is not None else 0.5
    for m, r in out.items():
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        if m != "target":
            r["predicted_speedup"] = round_model(r, base)
            mism = check_lossless(target, prompts, outs["target"], outs[m], m, tol)
            r["mismatches"], r["near_ties"] = len(mism), sum(x["near_tie"] for x in mism)
            r["lossless"] = all(x["near_tie"] for x in mism)
    wb = weight_bytes(target.model)
    base["decode_tok_s"] = base["verify_forwards"] / base["decode_s"] if base.get("decode_s") else None
    base["bound_tok_s"] = bw / wb
    return {"name": name, "params": sum(p.numel() for p in target.model.parameters()), "weight_bytes": wb,
            "methods": out, "outputs": outs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--data")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tree", default="8x6x60", help="topk x depth x tokens")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tie-tol", type=float, default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="capture the steps uncompiled (default: torch.compile'd, as hstap eval)")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    from hstap.artifacts.model_dir import load_target
    from hstap.data.prompts import load_prompts
    from hstap.speculative.evaluate import eos_ids, load_any_drafter

    if a.tiny:
        import tempfile

        from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts

        tmp = Path(tempfile.mkdtemp(prefix="bench-wide-"))
        tok = build_tokenizer(sample_texts(), vocab_size=400, out_dir=tmp / "tok")
        # SmolLM2's features at a tiny size: tied embeddings, 9 query heads on 3 kv heads, rope_theta 100000
        build_random_target(tmp / "t", tok, num_layers=8, hidden_size=144, num_heads=9, num_kv_heads=3,
                            intermediate_size=384, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
        target, tok = load_target(str(tmp / "t"), device="cpu", dtype="fp32")
        from bench_decode import random_drafter
        drafter = random_drafter(target)
        shape = Shape(hidden=256, layers=12, heads=16, kv_heads=4, head_dim=32, intermediate=512)
        (tmp / "p.jsonl").write_text("".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content": c}]})
                                             + "\n" for i, c in enumerate(["def parse(s):", "json.dumps", "a b c"])))
        a.data, a.prompts, a.new_tokens, a.k, a.tree = str(tmp / "p.jsonl"), 3, 12, 3, "2x3x6"
    else:
        if not (a.target and a.drafter and a.data):
            ap.error("--target, --drafter and --data are required (or --tiny)")
        target, tok = load_target(a.target, device="cuda", dtype=a.dtype)
        drafter, _ = load_any_drafter(a.drafter, target)
        shape = LLAMA_8B
    prompts = load_prompts(a.data, tok, a.prompts)
    eos = eos_ids(tok, target)
    bw = copy_bandwidth(target.device)
    wide, wdrafter = wide_pair(target, drafter, shape)  # the wide target first: the figures the run is for
    res = [bench_target("wide", wide, wdrafter, prompts, eos, a, bw)]
    del wide, wdrafter
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    res.insert(0, bench_target("reference", target, drafter, prompts, eos, a, bw))
    same = sum(x == y for x, y in zip(res[0]["outputs"]["target"], res[1]["outputs"]["target"]))
    _print(res, bw, same, len(prompts))
    for r in res:
        r.pop("outputs")
    print(json.dumps({"bench": "wide", "shape": vars(shape), "copy_bw": bw, "prompts": len(prompts),
                      "new_tokens": a.new_tokens, "dtype": a.dtype, "targets": res,
                      "target_only_outputs_equal": same, "device": torch.cuda.get_device_name()
                      if torch.cuda.is_available() else "cpu"}))
    return 0


def _print(res: list[dict], bw: float, same: int, n: int) -> None:
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; target-only greedy outputs of the wide target equal the reference's "
          f"on {same}/{n} prompts")
    print(f"{'target':9s} {'method':14s} {'tau':>6s} {'tok/s':>9s} {'speedup':>8s} {'pred':>6s} "
          f"{'draft/verify/host ms per round':>32s} {'lossless':>9s}")
    for r in res:
        for m, s in r["methods"].items():
            split = " / ".join(f"{s.get(k + '_ms_per_round', 0):.3f}" for k in ("draft", "verify", "host"))
            pred = f"{s['predicted_speedup']:.2f}x" if s.get("predicted_speedup") else "-"
            ok = "-" if m == "target" else ("yes" if s["lossless"] else "NO") + (
                f" ({s['near_ties']} ties)" if s.get("near_ties") else "")
            print(f"{r['name']:9s} {m:14s} {s['tau']:6.3f} {s['tokens_per_s']:9.1f} {s['speedup']:7.2f}x {pred:>6s} "
                  f"{split:>32s} {ok:>9s}")
        t = r["methods"]["target"]
        print(f"{r['name']:9s} target-only decode {t['decode_tok_s'] or 0:.1f} tok/s, bound {t['bound_tok_s']:.1f} "
              f"tok/s ({r['weight_bytes'] / 1e9:.2f} GB of weights)")


if __name__ == "__main__":
    sys.exit(main())
