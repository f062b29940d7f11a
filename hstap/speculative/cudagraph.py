"""CUDA-graph capture of fixed-shape steps, with an honest fallback, and a clock that needs no host sync.

A `Step` wraps a function of no arguments that reads and writes preallocated tensors only (static buffers updated
in place). On CUDA, `prepare()` (or else its first call) warms it up twice on a side stream (lazy initialisation,
cuBLAS handles, torch.compile's compilation) and captures it into a `torch.cuda.CUDAGraph`; calls replay the graph.
The warm-up runs change the buffers a step advances (its `state`), so those are saved before and restored after:
`prepare()` leaves every buffer it was given as it found it (scratch outputs aside), so a decoding loop prepares its
steps before its clock starts and no one-time cost lands inside a timed round. One of the
warm-ups runs under `torch.cuda.set_sync_debug_mode("error")`: a step that synchronises with the host (`.item()`,
`nonzero`, data-dependent shapes such as a MoE's routing loop) raises there, cleanly, instead of breaking a capture.
Then, or when the capture itself fails, the policy prints ONE line and every later step runs eagerly (steps already
captured keep their graphs). On the CPU a step is just a call.

`Clock` marks points of a round: CUDA events on the GPU (read once, at the end of a generation), perf_counter on the
CPU (where every kernel is synchronous).
"""

from __future__ import annotations

import sys
import time

import torch


class GraphPolicy:
    """Whether new steps may be captured; says so once when they may not."""

    def __init__(self, enabled: bool, what: str, log=None):
        self.enabled, self.what = enabled, what
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.reason: str | None = None

    def disable(self, reason: str) -> None:
        if self.enabled:
            self.enabled, self.reason = False, reason
            self.log(f"hstap eval (fast engine): {self.what} cannot be captured in a CUDA graph ({reason}): running eagerly")


class Step:
    """fn: the step on static buffers; compiled: torch.compile(fn) or None (used instead of fn while it works)."""

    def __init__(self, name: str, fn, policy: GraphPolicy, state=(), compiled=None):
        self.name, self.fn, self.policy, self.state = name, fn, policy, list(state)
        self.run, self.compiled = compiled or fn, compiled is not None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tried = False
        self.capture_s = 0.0  # warm-up + compile + capture, spent once; excluded from every timing
        self.kernels: int | None = None  # device kernels one run launches (count_kernels)
        self.kernel_table: list[tuple[str, int, float]] = []  # (name, calls, device us) of that run (CUDA)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif self.tried or not self.policy.enabled:
            if (self.tried or not self.compiled) or not self._first_run():
                self.run()
        else:
            self._capture()
            if self.graph is not None:
                self.graph.replay()
            else:
                self.run()

    def prepare(self) -> None:
        """The one-time work (compilation, warm-up, capture) now, without a run: the buffers keep their values."""
        if self.tried:
            return
        if self.policy.enabled:
            self._capture()
        elif self.compiled:
            t0 = time.perf_counter()
            saved = [t.clone() for t in self.state]
            if self._first_run():
                for t, v in zip(self.state, saved):
                    t.copy_(v)
            self.capture_s += time.perf_counter() - t0

    def count_kernels(self, cuda: bool) -> int | None:
        """What one run of the step launches, from torch.profiler over the step run outside its graph (the graph
        replays exactly that) with the state restored: on CUDA the device kernels (memcpy/memset included), on the
        CPU the top-level aten ops (each at least one kernel when run eagerly; a proxy for comparing step bodies).
        Also fills `kernel_table`: [(name, calls, device us)] of the run, most GPU time first (CUDA).

        The run is under no_grad, as the decoding loops are: a compiled step called with grad enabled misses its
        guards and recompiles (with coordinate-descent tuning, thousands of benchmark kernels under the profiler)."""
        if self.kernels is not None:
            return self.kernels
        from torch.profiler import ProfilerActivity, profile

        t0 = time.perf_counter()
        saved = [t.clone() for t in self.state]
        if cuda:
            torch.cuda.synchronize()
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            self.run()
            if cuda:
                torch.cuda.synchronize()
        for t, v in zip(self.state, saved):
            t.copy_(v)
        ev = prof.events()
        if cuda:
            dev = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
            self.kernels = len(dev)
            table: dict[str, list] = {}
            for e in dev:
                row = table.setdefault(e.name, [0, 0.0])
                row[0] += 1
                row[1] += e.time_range.elapsed_us()  # this kernel's own duration
            self.kernel_table = sorted(((n, c, us) for n, (c, us) in table.items()), key=lambda r: -r[2])
        else:
            self.kernels = sum(e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith(
                "aten::")) for e in ev)
        self.capture_s += time.perf_counter() - t0
        return self.kernels

    def _first_run(self) -> bool:
        """Run the compiled step once (this compiles it): True; on failure say so and fall back to the plain step,
        not run yet: False."""
        self.tried = True
        try:
            self.run()
            return True
        except Exception as e:  # noqa: BLE001 - any compiler failure: the uncompiled step is the same function
            self.policy.log(f"hstap eval (fast engine): torch.compile failed on the {self.name} step ({_first_line(e)}): "
                            "running it uncompiled")
            self.run, self.compiled = self.fn, False
            return False

    def _capture(self) -> None:
        """Warm up (compiling first), capture: self.graph, or None after the policy said why (buffers restored)."""
        t0 = time.perf_counter()
        saved = [t.clone() for t in self.state]

        def restore():
            for t, s in zip(self.state, saved):
                t.copy_(s)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        self.tried = True
        try:
            with torch.cuda.stream(side):
                if self.compiled:  # compile first (inductor may synchronise while it benchmarks kernels)
                    self._first_run()
                    restore()
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self.run()
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
                restore()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.run()
        except RuntimeError as e:
            torch.cuda.synchronize()
            restore()
            self.policy.disable(f"{self.name}: {_first_line(e)}")
            self.capture_s += time.perf_counter() - t0
            return
        torch.cuda.synchronize()
        restore()  # the capture itself ran nothing, but be exact: the state is as it was before the warm-ups
        self.graph = graph
        self.capture_s += time.perf_counter() - t0


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


class Clock:
    """Marks on the device's timeline; `span(a, b)` in seconds once the device is done (call `sync` first)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def span(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
