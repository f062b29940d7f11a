"""verify on MoE targets captured in bf16, and on rotated targets (hstap/verify/routing.py, hstap/verify/stage.py).

- A bf16 capture of a tiny DeepSeek-V3 MoE target (the hf engine, compute bf16) passes its fp32 recomputation: the
  rows bf16 rounding sent to other experts are counted as routing flips (each near a routing tie in the recomputation's
  two precisions), the rest meet the bf16 tolerance.
- The flip allowance does not hide a wrong store: a layer shift and another target still fail.
- A rotation (QuaRot) of the target computes the same logits, and its states never pass as the original's, nor the
  original's as its, under any tolerance.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from hstap.verify.parity import TOLERANCES
from hstap.verify.routing import MAX_FLIP_SHARE
from hstap.verify.stage import recompute


@pytest.fixture(scope="module")
def moe(tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """A 6-layer DeepSeek-V3 (MLA, 4 routed experts, 2 per token) and a bf16 capture of 16 chats by the hf engine."""
    from helpers.capture import make_prepared

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.demo.toy import build_random_target

    root = tmp_path_factory.mktemp("moe-bf16")
    build_random_target(root / "target", tiny_tokenizer[0], model_type="deepseek_v3", num_layers=6, hidden_size=64,
                        seed=3)
    prepared = make_prepared(tiny_tokenizer[1], root / "prepared", 16)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        capture(CaptureConfig(target=str(root / "target"), data=str(prepared), out=str(root / "store"), dtype="bf16",
                              device="cpu", compute_dtype="bf16"))
    return {"target": root / "target", "store": root / "store", "root": root}


def _quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


def test_bf16_moe_capture_passes_with_its_routing_flips_counted(moe):
    rep = recompute(str(moe["store"]), str(moe["target"]), samples=8, compute_dtype="fp32")
    assert rep["ok"], rep["problems"]
    flips = [m["routing"]["flips"] for m in rep["metrics"]]
    assert sum(flips) >= 1  # rows the plain bf16 tolerance refuses ("a different target"): the case this rule is for
    assert flips == sorted(flips)  # a flip at layer l moves that token's states in every later layer
    for m in rep["metrics"]:
        assert m["routing"]["flips"] <= m["routing"]["tokens_near_tie"]
        assert m["routing"]["flip_share"] <= MAX_FLIP_SHARE


def test_the_flip_allowance_hides_no_layer_shift_or_other_target(moe, tiny_tokenizer, tmp_path):
    from helpers.store import rewrite

    from hstap.demo.toy import build_random_target

    shifted = rewrite(moe["store"], tmp_path / "shifted", layers=[0, 2, 3])  # holds layers 1, 3, 4
    rep = recompute(str(shifted), str(moe["target"]), samples=4, compute_dtype="fp32")
    assert not rep["ok"] and any("off by +1" in p for p in rep["problems"]), rep["problems"]
    other = tmp_path / "other"
    build_random_target(other, tiny_tokenizer[0], model_type="deepseek_v3", num_layers=6, hidden_size=64, seed=4)
    rep = recompute(str(moe["store"]), str(other), samples=4, compute_dtype="fp32")
    assert not rep["ok"] and all(not m["ok"] for m in rep["metrics"])
    assert all("matches no target" in p for p in rep["problems"]), rep["problems"]


@pytest.fixture(scope="module")
def rotated(tiny_llama, tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama, its QuaRot rotation, and an fp32 capture of each."""
    from helpers.capture import make_prepared
    from helpers.rotate import rotate_llama

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    root = tmp_path_factory.mktemp("rotated")
    rotate_llama(tiny_llama, root / "rotated")
    prepared = make_prepared(tiny_tokenizer[1], root / "prepared", 4)
    out = {"target": tiny_llama, "rotated": root / "rotated"}
    for name in ("target", "rotated"):
        out[f"{name}-store"] = root / f"{name}-store"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            capture(CaptureConfig(target=str(out[name]), data=str(prepared), out=str(out[f"{name}-store"]),
                                  dtype="fp32", device="cpu", compute_dtype="fp32"))
    return out


def test_a_rotated_target_is_the_same_function_and_never_passes(rotated):
    from hstap.artifacts.model_dir import load_target

    ids = torch.randint(6, 400, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = [load_target(str(rotated[k]))[0].model(ids).logits for k in ("target", "rotated")]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)  # the same model, to the user
    loosest = min(t["cos_min"] for t in TOLERANCES.values())
    for store, target in (("target-store", "rotated"), ("rotated-store", "target")):
        rep = recompute(str(rotated[store]), str(rotated[target]), samples=2, compute_dtype="fp32")
        assert not rep["ok"] and all(not m["ok"] for m in rep["metrics"])
        assert all(m["cos_min"] < loosest and m["best_cos_min"] < loosest for m in rep["metrics"])
