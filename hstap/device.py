"""The device rule: which device and compute dtype a --device / --dtype value names ("auto": the GPU where torch sees
one, bf16 there, the CPU and fp32 otherwise). Every stage that places a model goes through here, the model-directory
loader (`hstap.artifacts.model_dir`) and the distributed set-up (`hstap.dist`) among them."""

from __future__ import annotations

import torch

from hstap.common import HstapError

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def auto_device(device: str | torch.device) -> str:
    """The device a --device value names: "auto" -> "cuda" where torch sees a GPU, else "cpu"; any other as given."""
    if str(device) != "auto":
        return str(device)
    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_dtype(dtype: str, device: str | torch.device) -> str:
    """The compute dtype a --dtype value names on `device` (a --device value): "auto" -> "bf16" on CUDA (what serving
    engines run), "fp32" on the CPU (exact, tests); any other as given."""
    if dtype != "auto":
        return dtype
    return "bf16" if torch.device(auto_device(device)).type == "cuda" else "fp32"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto_device(device)` as a torch.device; "cuda" without an index -> the current CUDA device."""
    device = auto_device(device)
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HstapError(f"--device: {device} requested but CUDA is not available (torch {torch.__version__})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise HstapError(f"--device: expected cpu, cuda or auto, got {device!r}")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto_dtype(dtype, device)` as a torch.dtype."""
    dtype = auto_dtype(dtype, device)
    if dtype not in COMPUTE_DTYPES:
        raise HstapError(f"--compute-dtype: expected auto, fp32 or bf16, got {dtype!r}")
    return COMPUTE_DTYPES[dtype]
