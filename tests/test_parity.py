"""hstap.verify.parity: the bf16 ulp and the per-layer metrics on values whose errors are known."""

from __future__ import annotations

import torch

from hstap.verify.parity import layer_stats, ulp_bf16


def test_ulp_bf16_is_the_bf16_spacing():
    x = torch.tensor([1.0, 1.5, 2.0, 3.99, -0.75, 1e-3, 0.0])
    want = torch.tensor([2 ** -7, 2 ** -7, 2 ** -6, 2 ** -6, 2 ** -8, 2.0 ** (-10 - 7), 2.0 ** -133])
    assert torch.equal(ulp_bf16(x), want)
    y = torch.randn(1000) * 10
    # rounding to bf16 moves a value by at most half a bf16 ulp at its magnitude
    assert float(((y.bfloat16().float() - y).abs() / ulp_bf16(y)).max()) <= 0.5
    st = layer_stats(y.bfloat16().float().view(10, 100), y.view(10, 100))
    assert st["ulp_max"] <= 0.5 and st["rel_max"] <= 2 ** -8 and st["cos_min"] > 0.9999
