"""Quantized targets as they ship (hstap.demo.quantize), loaded by hstap (hstap.artifacts.quantization, model_dir):

- INT4 W4A16 in compressed-tensors' pack-quantized format and DeepSeek-V3's block FP8, written from a tiny Llama; the
  packed int32 words, read here nibble by nibble, and the fp8 bytes times their block scales are the weights transformers
  loads, and hstap's target computes with exactly those (bitwise the model with the plain weights they stand for), never
  with the original's.
- A DeepSeek-V3 / Kimi-K2.5-layout MoE + MLA target with Kimi-K2's INT4 experts: only the routed experts are packed, and
  both layouts load as that quantized model.
- The lean target layers (hstap eval's fast engine) run the unpacked INT4 model as the HF layers do, and refuse a Linear
  still packed in one line.
- A quantization hstap has not checked is one error line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (requirements.txt pins it)")

from hstap.common import HstapError  # noqa: E402
from hstap.artifacts.model_dir import load_target  # noqa: E402
from hstap.artifacts.quantization import quantization_of  # noqa: E402


@pytest.fixture(scope="module")
def quantized(tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """{"fp": a 4-layer H=64 Llama (fp32), "int4": it in W4A16 group 32, "fp8": in FP8 with 32x32 blocks,
    "moe", "moe-int4", "kimi-int4": a DeepSeek-V3 MoE + MLA target and its Kimi-K2-style INT4 experts, also in
    Kimi-K2.5's layout}."""
    from hstap.demo.quantize import KIMI_INT4_IGNORE, quantize_fp8, quantize_int4
    from hstap.demo.toy import build_random_target

    root = tmp_path_factory.mktemp("quantized")
    d = {k: root / k for k in ("fp", "int4", "fp8", "moe", "kimi", "moe-int4", "kimi-int4")}
    build_random_target(d["fp"], tiny_tokenizer[0], num_layers=4, hidden_size=64, seed=5)
    quantize_int4(d["fp"], d["int4"], group_size=32)
    quantize_fp8(d["fp"], d["fp8"], block=(32, 32))
    for kind, name in (("deepseek_v3", "moe"), ("kimi_k25", "kimi")):
        build_random_target(d[name], tiny_tokenizer[0], model_type=kind, num_layers=4, hidden_size=64,
                            q_lora_rank=16, seed=3)
        quantize_int4(d[name], d[name + "-int4"], group_size=32, ignore=KIMI_INT4_IGNORE)
    return d


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _unpack_int4(packed: torch.Tensor, shape) -> torch.Tensor:
    """int32 words of eight 4-bit fields (lowest bits first), each stored as value + 8 -> (O, I) values in [-8, 7]."""
    shifts = torch.arange(8, dtype=torch.int32) * 4  # (8,)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # (O, I/8, 8)
    return (nibbles.reshape(packed.shape[0], -1)[:, : int(shape[1])] - 8).to(torch.int8)


def _states(target, ids) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(target.model(ids, output_hidden_states=True).hidden_states)


def test_int4_checkpoint_is_compressed_tensors_and_loads_as_its_values(quantized):
    conf = json.loads((quantized["int4"] / "config.json").read_text())["quantization_config"]
    assert (conf["quant_method"], conf["format"], conf["quantization_status"]) == \
           ("compressed-tensors", "pack-quantized", "compressed")
    w = conf["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    q = quantization_of(quantized["int4"])
    assert (q.kind, q.group, q.served_as("cpu")) == ("int4", (32,), "W4A16")
    st, orig = _tensors(quantized["int4"]), _tensors(quantized["fp"])
    name = "model.layers.2.mlp.down_proj."
    assert name + "weight" not in st and st[name + "weight_packed"].dtype == torch.int32
    assert st[name + "weight_scale"].shape == (64, 128 // 32) and st[name + "weight_shape"].tolist() == [64, 128]
    assert "model.embed_tokens.weight" in st and "lm_head.weight" in st  # never quantized
    target = load_target(quantized["int4"])[0]
    loaded = target.model.model.layers[2].mlp.down_proj.weight
    values = _unpack_int4(st[name + "weight_packed"], st[name + "weight_shape"])
    assert values.min() >= -8 and values.max() <= 7 and len(values.unique()) > 8
    expect = values.float() * st[name + "weight_scale"].repeat_interleave(32, dim=1)  # (O, I)
    assert torch.equal(loaded, expect)  # transformers' load is the packed values times their scales, bitwise
    err = (expect - orig[name + "weight"]).abs()
    assert 0 < err.max() <= st[name + "weight_scale"].max() / 2 + 1e-6  # round to nearest: half a step at most


def test_fp8_checkpoint_is_deepseek_v3s_and_loads_as_its_values(quantized):
    conf = json.loads((quantized["fp8"] / "config.json").read_text())["quantization_config"]
    assert conf == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [32, 32]}
    q = quantization_of(quantized["fp8"])
    assert (q.kind, q.served_as("cpu"), q.served_as("cuda")) == ("fp8-block", "W8A16", "W8A8")
    st = _tensors(quantized["fp8"])
    name = "model.layers.1.self_attn.k_proj."  # (32, 64): one row of blocks
    assert st[name + "weight"].dtype == torch.float8_e4m3fn and st[name + "weight_scale_inv"].shape == (1, 2)
    loaded = load_target(quantized["fp8"])[0].model.model.layers[1].self_attn.k_proj.weight
    expect = st[name + "weight"].float() * st[name + "weight_scale_inv"].repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(loaded, expect)
    blocks = (st[name + "weight"].float().abs().reshape(1, 32, 2, 32).amax(dim=(1, 3)))
    assert torch.equal(blocks, torch.full((1, 2), 448.0))  # each block's largest weight is the fp8 maximum


def _plain_copy(src: Path, out: Path) -> Path:
    """The quantized checkpoint's weights as a plain full-precision checkpoint (`dequantized_weights`)."""
    import shutil

    from safetensors.torch import save_file

    from hstap.demo.quantize import dequantized_weights

    shutil.copytree(src, out)
    conf = json.loads((out / "config.json").read_text())
    conf.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(conf))
    save_file({k: v.contiguous() for k, v in dequantized_weights(src).items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("kind", ["int4", "fp8", "moe-int4", "kimi-int4"])
def test_the_target_is_the_quantized_model_never_the_original(quantized, kind, tmp_path):
    original = quantized[{"moe-int4": "moe", "kimi-int4": "kimi"}.get(kind, "fp")]
    ids = torch.randint(6, 400, (2, 13), generator=torch.Generator().manual_seed(1))  # (B, T)
    got = _states(load_target(quantized[kind])[0], ids)
    plain = _states(load_target(_plain_copy(quantized[kind], tmp_path / "plain"))[0], ids)
    base = _states(load_target(original)[0], ids)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))  # the quantized weights, nothing else
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(got, base)]
    assert rel[-1] > 1e-3, rel  # another function than the original's


def test_moe_target_quantizes_only_the_routed_experts(quantized):
    for name, prefix in (("moe-int4", ""), ("kimi-int4", "language_model.")):
        st = _tensors(quantized[name])
        packed = sorted(k[: -len(".weight_packed")] for k in st if k.endswith(".weight_packed"))
        assert packed and all(".mlp.experts." in k for k in packed), packed[:3]
        assert len(packed) == 3 * 4 * 3  # gate/up/down of 4 routed experts in layers 1-3 (layer 0 is dense)
        assert prefix + "model.layers.1.mlp.shared_experts.down_proj.weight" in st
        assert prefix + "model.layers.1.self_attn.kv_b_proj.weight" in st and prefix + "model.layers.1.mlp.gate.weight" in st
        conf = json.loads((quantized[name] / "config.json").read_text())
        assert quantization_of(conf).ignore[1:] == (r"re:.*self_attn.*", r"re:.*shared_experts.*",
                                                    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")


def test_lean_layers_run_the_unpacked_model_and_refuse_a_packed_one(quantized):
    from transformers import AutoModelForCausalLM

    from hstap.models.lean_target import unsupported
    from hstap.models.target import Target

    target = load_target(quantized["int4"])[0]
    assert unsupported(target) is None  # plain Linear layers holding the INT4 model's weights
    packed = AutoModelForCausalLM.from_pretrained(str(quantized["int4"]), dtype=torch.float32)  # left packed
    why = unsupported(Target(packed))
    assert why is not None and "q_proj" in why and "quantized" in why and "\n" not in why


def test_another_quantization_is_one_error_line(quantized, tmp_path):
    conf = json.loads((quantized["fp"] / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(HstapError, match=r"config.json: quantization_config .*gptq.*: hstap reads INT4 W4A16") as e:
        load_target(tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(HstapError, match="already quantized"):
        from hstap.demo.quantize import quantize_int4
        quantize_int4(quantized["int4"], tmp_path / "again")


# ---------------------------------------------------------------------------------------------------------------------
# every stage on each quantized target, with the embedded engine

STAGED = ("int4", "fp8", "kimi-int4")


@pytest.fixture(scope="module")
def staged(quantized, tmp_path_factory) -> dict[str, dict]:
    """prepare -> capture (hf, fp32, layers 0,1,2 of 4) -> verify -> train (4 steps) -> export (vLLM) -> eval, for each
    of STAGED: {kind: {"store", "verify", "train", "vllm", "eval"}}."""
    import contextlib
    import io

    from helpers.capture import corpus

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.config import from_flags
    from hstap.data.prepare import prepare
    from hstap.data.prepare_config import PrepareConfig
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export
    from hstap.speculative.config import EvalConfig
    from hstap.speculative.evaluate import evaluate
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train
    from hstap.verify.stage import recompute

    root = tmp_path_factory.mktemp("quantized-stages")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in corpus(10, seed=4, max_chars=120)))
    out = {}
    for kind in STAGED:
        t, d, r = str(quantized[kind]), root / kind, {}
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            prepare(PrepareConfig(tokenizer=t, data=[str(chats)], out=str(d / "prepared"), draft_vocab=64))
            r["store"] = d / "store"
            capture(CaptureConfig(target=t, data=str(d / "prepared"), out=str(r["store"]), layers="0,1,2", dtype="fp32",
                                  device="cpu", batch_tokens=2048))
            r["verify"] = recompute(str(r["store"]), t, samples=3, device="cpu", compute_dtype="fp32")
            torch.manual_seed(0)
            r["train"] = train(from_flags(TrainConfig, store=str(r["store"]), target=t, out=str(d / "run"), steps=4,
                                          lr=3e-3, batch_tokens=600, ttt=2, eval_frac=0.0, save_every=4, device="cpu",
                                          compile=False, tensorboard=False))
            r["vllm"] = d / "vllm"
            export(ExportConfig(run=str(d / "run"), to="vllm", out=str(r["vllm"]), dtype="fp32", target=t))
            r["eval"] = evaluate(from_flags(EvalConfig, target=t, drafter=str(d / "run"), data=str(d / "prepared"),
                                            out=str(d / "eval"), k=2, max_new_tokens=8, num_prompts=2, device="cpu",
                                            dtype="fp32"))
        out[kind] = r
    return out


@pytest.mark.parametrize("kind", STAGED)
def test_every_stage_runs_on_the_quantized_target(staged, quantized, kind):
    from helpers.capture import store_samples

    from hstap.artifacts.model_dir import target_fingerprint
    from hstap.store.reader import open_store

    r = staged[kind]
    s = open_store(r["store"])
    assert s.header["target"]["weights_fingerprint"] == target_fingerprint(quantized[kind])["weights_fingerprint"]
    assert r["verify"]["ok"], r["verify"]  # the stored states are the quantized model's, recomputed
    # ... and not the original's: the same prompts through the full-precision model give other states
    original = load_target(quantized[{"kimi-int4": "kimi"}.get(kind, "fp")])[0]
    sid, x = next(iter(store_samples(r["store"]).items()))
    with torch.no_grad():
        hs = original.model(x["input_ids"][None].long(), output_hidden_states=True).hidden_states
    assert not torch.allclose(hs[2][0], x["aux"][:, 1].float(), rtol=1e-3, atol=1e-4), sid  # layer 1's output
    assert r["train"]["steps"] == 4 and r["train"]["loss"] > 0
    conf = json.loads((r["vllm"] / "config.json").read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert r["eval"]["lossless"] is True and r["eval"]["tau"] >= 1.0


def test_vllm_on_the_cpu_runs_int4_in_bf16_only(quantized):
    from hstap.engines.vllm import check_quantized_dtype

    with pytest.raises(HstapError, match=r"INT4 W4A16 .*group 32.* bf16 only in vLLM on the CPU .*CPUWNA16") as e:
        check_quantized_dtype(str(quantized["int4"]), "fp32", "cpu")
    assert "\n" not in str(e.value)
    for target, dtype, device in ((quantized["int4"], "bf16", "cpu"), (quantized["int4"], "fp32", "cuda"),
                                  (quantized["fp8"], "fp32", "cpu"), (quantized["fp"], "fp32", "cpu")):
        check_quantized_dtype(str(target), dtype, device)  # what vLLM runs
