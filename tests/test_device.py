"""hstap.device: the "auto" device and compute-dtype rule every stage shares."""

from __future__ import annotations

import pytest
import torch

from hstap.common import HstapError
from hstap.device import auto_device, auto_dtype, resolve_device, resolve_dtype


def test_auto_device_and_dtype():
    """One rule for every stage: "auto" is CUDA where torch sees a GPU, else the CPU; its compute dtype bf16 on CUDA,
    fp32 on the CPU. Other values pass through."""
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert auto_device("auto") == here and resolve_device("auto").type == here
    assert auto_device("cpu") == "cpu" and auto_device("cuda:1") == "cuda:1"
    assert auto_device(torch.device("cpu")) == "cpu"
    assert auto_dtype("auto", "cpu") == "fp32" and auto_dtype("auto", "cuda:1") == "bf16"
    assert auto_dtype("auto", torch.device("cpu")) == "fp32"
    assert auto_dtype("auto", "auto") == {"cuda": "bf16", "cpu": "fp32"}[here]
    assert auto_dtype("bf16", "cpu") == "bf16" and auto_dtype("fp32", "cuda") == "fp32"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(HstapError, match="--compute-dtype: expected auto, fp32 or bf16, got 'fp16'"):
        resolve_dtype("fp16", torch.device("cpu"))
