"""hstap.capture.staging: the byte layout of a staging buffer and the pinned pool's reuse policy, on CPU tensors."""

from __future__ import annotations

import torch

from hstap.capture.staging import (PinnedPool, staging_layout, staging_nbytes, staging_pack, staging_views,
                                   to_store_dtype)


def test_host_buffer_layout_roundtrip():
    """The byte packing of the CUDA path (pinned buffer <- device tensors, views back), run here on CPU tensors."""
    aux, final = torch.randn(37, 3, 64) * 5, torch.randn(37, 64)  # (S, K, H), (S, H)
    for dtype in ("bf16", "fp8", "fp32"):
        payload = to_store_dtype(aux, final, dtype)
        layout, nbytes = staging_layout(payload)
        buf = torch.full((nbytes + 1000,), 255, dtype=torch.uint8)  # a pool buffer is larger than needed
        staging_pack(buf, payload, layout)
        assert staging_nbytes(layout) <= nbytes
        back = staging_views(buf[:staging_nbytes(layout)].clone(), layout)
        names = {"aux", "final", "aux_scale", "final_scale"} if dtype == "fp8" else {"aux", "final"}
        assert set(back) == set(payload) == names
        for name, t in payload.items():
            assert back[name].dtype == t.dtype and back[name].shape == t.shape and back[name].is_contiguous()
            assert torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), (dtype, name)


def test_pinned_pool_reuses_the_smallest_fit_and_drops_outgrown_buffers():
    pool = PinnedPool(pin=False)
    a, b = pool.acquire(3 << 20), pool.acquire(5 << 20)  # (3 MiB, 5 MiB) rounded to 1 MiB steps
    assert (a.numel(), b.numel()) == (3 << 20, 5 << 20) and pool.allocated == 2
    pool.release(b)
    pool.release(a)
    assert pool.acquire(2 << 20) is a and pool.allocated == 2  # smallest free buffer that fits
    pool.release(a)
    for mib in range(6, 40):  # requests growing past every free buffer: the outgrown ones are let go
        pool.release(pool.acquire(mib << 20))
    assert len(pool._free) == 1 and pool._free[0].numel() >= 39 << 20
    assert PinnedPool.capacity((512 << 20) + 1) == 576 << 20  # steps of 1/16 of the next power of two (1 GiB)
