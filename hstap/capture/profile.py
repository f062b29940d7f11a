"""Where a capture pass's time goes, stage by stage: `CaptureRunner(..., profile=CaptureProfile(device))`
(benchmarks/bench_capture.py prints it per pass). Without a profile the runner pays nothing for it (NO_PROFILE).

Stages of capture/hf/runner.py's pipeline:
    launching thread  inputs    the samples' checks and metadata (host only)
                      forward   padding, the host-to-device copy of the ids, the target's forward with its hooks
                      demux     the padding rows dropped (nothing to do for a batch without padding)
                      convert   the store dtype (fp8: quantized on the device)
                      copy      a pinned staging buffer acquired (allocated in the first batches), the device-to-host
                                copy issued on the side stream
                      queue     waiting for room in the writer queue (the GPU waiting for storage)
    writer thread     wait_copy waiting for the batch's device-to-host copy to land (includes the GPU computing it)
                      store     StoreWriter.add of each sample, with the shards committed on the way (the writer's
                                own `stats` break that down: write, hash, fsync, commit)
host_s holds the seconds each thread spent in each stage (perf_counter; on CUDA the launching thread's figures are
launch costs, the GPU runs behind it). On CUDA, device_s holds GPU seconds from timing events recorded around the
stages on the compute stream and around the copy on the side stream, read by the writer thread once the batch's copy
has landed (no extra synchronisation): forward, demux, convert, copy, and idle, the compute stream's time between the
end of one batch's work and the start of the next (the GPU waiting for the host).
`current_stage()` names the stage the calling thread is in (a benchmark attributes host reads and syncs with it).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

MAIN_STAGES = ("inputs", "forward", "demux", "convert", "copy", "queue")
WRITER_STAGES = ("wait_copy", "store")
DEVICE_STAGES = ("forward", "demux", "convert", "copy", "idle")


class CaptureProfile:
    """Per-stage seconds of one capture pass (see the module docstring); `as_dict()` for a report."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host_s = dict.fromkeys(MAIN_STAGES + WRITER_STAGES, 0.0)
        self.device_s = dict.fromkeys(DEVICE_STAGES, 0.0) if self.cuda else None
        self.batches = 0
        self.forward_each: list[float] = []  # device seconds of each batch's forward, in order (CUDA)
        self.idle_each: list[float] = []  # compute-stream idle before each batch but the first (CUDA)
        self._local = threading.local()
        self._last: torch.cuda.Event | None = None  # the previous batch's last compute-stream event

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time the block as stage `name` of the calling thread (each stage belongs to one thread: no lock needed)."""
        prev = getattr(self._local, "stage", None)
        self._local.stage = name
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.host_s[name] += time.perf_counter() - t0
            self._local.stage = prev

    def current_stage(self) -> str | None:
        return getattr(self._local, "stage", None)

    def event(self, blocking: bool = False) -> torch.cuda.Event | None:
        """A timing event recorded on the current stream now (None on the CPU)."""
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True, blocking=blocking)
        e.record()
        return e

    def batch_done(self, marks: tuple) -> None:
        """Writer thread, once a batch's copy has landed: marks = (forward start, forward end, demux end, convert end
        on the compute stream; copy start, copy end on the side stream), every one complete by now."""
        self.batches += 1
        if marks is None or self.device_s is None:
            return
        f0, f1, dm, cv, c0, c1 = marks
        d = self.device_s
        for key, a, b in (("forward", f0, f1), ("demux", f1, dm), ("convert", dm, cv), ("copy", c0, c1)):
            d[key] += a.elapsed_time(b) / 1e3
        self.forward_each.append(f0.elapsed_time(f1) / 1e3)
        if self._last is not None:
            self.idle_each.append(self._last.elapsed_time(f0) / 1e3)
            d["idle"] += self.idle_each[-1]
        self._last = cv

    def as_dict(self) -> dict:
        out: dict = {"batches": self.batches, "host_s": {k: round(v, 4) for k, v in self.host_s.items()}}
        if self.device_s is not None:
            out["device_s"] = {k: round(v, 4) for k, v in self.device_s.items()}
            out["batch_device_s"] = spread(self.forward_each, self.idle_each)
        return out


def spread(forward: list[float], idle: list[float]) -> dict:
    """The per-batch figures in brief: first forward (warm-up shows there), median and slowest forward, the idle gaps'
    median and largest, and how many gaps exceeded a millisecond."""
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    return {"forward_first": round(forward[0], 4) if forward else 0.0, "forward_median": round(med(forward), 4),
            "forward_max": round(max(forward, default=0.0), 4), "idle_median": round(med(idle), 5),
            "idle_max": round(max(idle, default=0.0), 4), "idle_gaps_over_1ms": sum(g > 1e-3 for g in idle)}


class _NoProfile:
    """What a runner without a profile uses: stages and events cost a method call each."""

    cuda = False
    _null = contextlib.nullcontext()

    def stage(self, name: str):
        return self._null

    def current_stage(self) -> None:
        return None

    def event(self, blocking: bool = False) -> None:
        return None

    def batch_done(self, marks) -> None:
        return None


NO_PROFILE = _NoProfile()
