"""Count the host's reads of tensor values and its explicit waits for the device while a benchmark pass runs, by
thread, pipeline stage and call site (benchmarks/bench_capture.py).

    with SyncCounter(stage_of=profile.current_stage, cuda=True) as syncs:
        ...                                          # the pass
    syncs.as_dict()

Python level, on any device: `Tensor.item / tolist / cpu` and `int() / float() / bool() / operator.index()` of a tensor
(reads), `torch.cuda.synchronize`, `Event.synchronize`, `Stream.synchronize` (waits). A read of a CUDA tensor is a host
sync; on the CPU nothing is, but a read made inside a stage whose tensors live on the device when it runs on a GPU
(`device_stages`) would be one there, so the CPU smoke run still shows it. On CUDA, torch's own sync debug mode
(`torch.cuda.set_sync_debug_mode("warn")`) reports every synchronising call it makes, Python-visible or not (a
blocking copy, `nonzero`, `torch.equal` on the device, ...): counted as `debug`.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import torch

READS = ("item", "tolist", "cpu", "__int__", "__float__", "__bool__", "__index__")
WAITS = ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"))
_HERE = str(Path(__file__).resolve())


def _thread() -> str:
    name = threading.current_thread().name
    if threading.current_thread() is threading.main_thread():
        return "main"
    return {"hstap-capture-writer": "writer"}.get(name, "io" if name.startswith("hstap-shard-io") else name)


def _site(skip: int = 2) -> str:
    """file:line of the first caller outside torch and this module (the code that asked for the read or the wait)."""
    f = sys._getframe(skip)
    while f is not None and ("/torch/" in f.f_code.co_filename or f.f_code.co_filename == _HERE):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    for marker in ("/site-packages/", "/hstap/", "/benchmarks/"):
        if marker in path:
            path = path.split(marker, 1)[1] if marker == "/site-packages/" else marker[1:] + path.split(marker, 1)[1]
            break
    return f"{path}:{f.f_lineno}"


class SyncCounter:
    """Context manager: patches the read and wait methods (and, on CUDA, torch's sync debug mode) while active.

    stage_of() names the calling thread's stage (None outside any); device_stages are the stages whose tensors live on
    the device on a GPU run."""

    def __init__(self, stage_of=lambda: None, cuda: bool = False,
                 device_stages: tuple[str, ...] = ("forward", "demux", "convert", "copy")):
        self.stage_of, self.cuda, self.device_stages = stage_of, cuda, device_stages
        self.counts: Counter = Counter()  # (thread, stage, kind, device, site) -> calls
        self._saved: list = []
        self._lock = threading.Lock()

    def _note(self, kind: str, device: str) -> None:
        key = (_thread(), self.stage_of() or "-", kind, device, _site(3))
        with self._lock:
            self.counts[key] += 1

    def __enter__(self) -> SyncCounter:
        for name in READS:
            orig = getattr(torch.Tensor, name)

            def read(t, *a, _orig=orig, _name=name, **k):
                self._note(_name.strip("_"), t.device.type)
                return _orig(t, *a, **k)

            self._saved.append((torch.Tensor, name, orig))
            setattr(torch.Tensor, name, read)
        for owner, name in WAITS:
            orig = getattr(owner, name)

            def wait(*a, _orig=orig, _what=f"{getattr(owner, '__name__', 'cuda')}.{name}", **k):
                self._note(_what, "cuda")
                return _orig(*a, **k)

            self._saved.append((owner, name, orig))
            setattr(owner, name, wait)
        if self.cuda:
            self._warn = warnings.catch_warnings()
            self._warn.__enter__()
            warnings.filterwarnings("always", message=".*ynchroniz.*")
            self._show, self._mode = warnings.showwarning, torch.cuda.get_sync_debug_mode()

            def show(message, category, filename, lineno, file=None, line=None):
                if "ynchroniz" in str(message):
                    key = (_thread(), self.stage_of() or "-", "debug", "cuda", f"{Path(filename).name}:{lineno}")
                    with self._lock:
                        self.counts[key] += 1
                else:
                    self._show(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
            self._warn.__exit__(*exc)
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()

    def as_dict(self, top: int = 15) -> dict:
        """Totals per thread/stage and the busiest call sites. `syncs` is the figure to watch: on the launching
        thread, inside the capture's stages, the debug mode's syncs on CUDA plus explicit waits; on the CPU the reads
        made in device stages (each one a sync on a GPU) plus explicit waits."""
        per: dict = {}
        syncs = 0
        for (thread, stage, kind, device, _), n in self.counts.items():
            row = per.setdefault(f"{thread}/{stage}", {"reads": 0, "device_reads": 0, "waits": 0, "debug": 0})
            if kind == "debug":
                row["debug"] += n
            elif "synchronize" in kind:
                row["waits"] += n
            else:
                row["reads"] += n
                row["device_reads"] += n if device != "cpu" else 0
            if thread == "main" and stage != "-":
                if kind == "debug" or "synchronize" in kind:
                    syncs += n
                elif not self.cuda and stage in self.device_stages:
                    syncs += n
        sites = [[*k[:3], k[4], n] for k, n in self.counts.most_common(top)]
        return {"counted": "cuda sync debug mode + python reads/waits" if self.cuda else
                "python reads/waits (cpu: a read inside a device stage would be a sync on a GPU)",
                "main_syncs": syncs, "by_thread_stage": per, "sites": sites}
