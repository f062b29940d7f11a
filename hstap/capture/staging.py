"""Staging captured hidden states for the device-to-host copy, shared by the embedded engine (capture/hf/runner.py) and the
SGLang hook (capture/sglang/hook.py).

A batch's store tensors (aux, final and, for fp8, their scales) are converted to the store dtype where they are
(`to_store_dtype`: on the GPU, fp8 halves the D2H bytes), then copied as raw bytes into one pinned uint8 buffer
(`staging_layout` / `staging_pack`: each tensor at an aligned offset, so any dtype view of it stays aligned) and read
back as typed views (`staging_views`). The buffers come from a `PinnedPool`, which reuses them: pinning is slow.
"""

from __future__ import annotations

import threading
import time

import torch

from hstap.common import HstapError

ALIGN = 512  # byte alignment of each tensor inside a pinned buffer (any dtype view stays aligned)


def to_store_dtype(aux: torch.Tensor, final: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """Packed (S, K, H), (S, H) -> the store's tensors, converted where they are (on the GPU, fp8 halves the D2H)."""
    if dtype == "fp8":
        from hstap.store.fp8 import quantize_fp8

        aux_q, aux_scale = quantize_fp8(aux)  # (S, K, H) float8, (S, K) float32
        final_q, final_scale = quantize_fp8(final)  # (S, H) float8, (S,) float32
        return {"aux": aux_q, "final": final_q, "aux_scale": aux_scale.contiguous(),
                "final_scale": final_scale.contiguous()}
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if dt is None:
        raise HstapError(f"--dtype: expected bf16, fp8 or fp32, got {dtype!r}")
    return {"aux": aux.to(dt).contiguous(), "final": final.to(dt).contiguous()}


class PinnedPool:
    """Pinned host buffers (uint8), reused: `acquire` hands out the smallest free buffer that is large enough, else
    allocates one rounded up to 1/16 of its power of two (pinning is slow: a long capture allocates its few buffers in
    the first batches and then only reuses them). Released buffers are kept until a request larger than all of them
    comes (then the free ones are dropped), so growing requests do not pile up pinned memory. Thread-safe."""

    def __init__(self, pin: bool = True):
        self.pin = pin  # False: plain host memory (the same reuse policy, testable without a GPU)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0  # pinned allocations made (a reuse costs nothing)
        self.allocated_bytes = 0  # their capacity (torch's pinned allocator may round each up to a power of two)
        self.alloc_s = 0.0  # seconds spent allocating them (pinning is slow: this is where it shows)

    @staticmethod
    def capacity(nbytes: int) -> int:
        step = max(1 << 20, 1 << max(0, max(1, nbytes).bit_length() - 4))
        return -(-max(1, nbytes) // step) * step

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            # requests grew past every free buffer: let the smaller ones go (unpinned) rather than keep them forever
            self._free.clear()
            self.allocated += 1
        t0 = time.perf_counter()
        buf = torch.empty(self.capacity(nbytes), dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.allocated_bytes += buf.numel()
            self.alloc_s += time.perf_counter() - t0
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def reserve(self, nbytes: int, count: int) -> None:
        """Make sure `count` free buffers of >= nbytes exist (allocate them ahead of a timed or latency-bound run)."""
        bufs = [self.acquire(nbytes) for _ in range(count)]
        for b in bufs:
            self.release(b)


def staging_layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[int, int, torch.dtype, tuple]], int]:
    """Byte offsets of each tensor in one buffer (aligned), and the total size."""
    out, off = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        out[name] = (off, n, t.dtype, tuple(t.shape))
        off += -(-n // ALIGN) * ALIGN
    return out, off


def staging_pack(buf: torch.Tensor, tensors: dict[str, torch.Tensor], layout: dict, non_blocking: bool = False) -> None:
    """Copy each tensor's raw bytes (any dtype, fp8 included) to its place in the uint8 buffer `buf`."""
    for name, t in tensors.items():
        o, n, _, _ = layout[name]
        buf[o: o + n].copy_(t.view(torch.uint8).reshape(-1), non_blocking=non_blocking)


def staging_views(buf: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    return {name: buf[o: o + n].view(dt).view(shape) for name, (o, n, dt, shape) in layout.items()}


def staging_nbytes(layout: dict) -> int:
    """Bytes of a buffer that `layout` uses (a pool buffer is larger): what a copy out of it needs to keep."""
    return max(o + n for o, n, _, _ in layout.values())
