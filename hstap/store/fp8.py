"""fp8 stores (`dtype` "fp8" in the spec, `hstap.store.format`): float8_e4m3fn values with one float32 scale per token
per layer, `scale = amax(|x|, last dim) / 448` (1.0 for an all-zero row), `q = x / scale`, `x ~= q * scale`."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H) float -> (q (..., H) float8_e4m3fn, scale (...) float32), one scale per row; runs on x's device."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # (..., 1)
    # tiny floor: a denormal amax would make amax/448 underflow to 0; all-zero rows get scale 1 so q = 0 exactly.
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # (..., H)
    return q, scale.squeeze(-1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., H) float8 and (...) float32 scales -> (..., H) `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)

