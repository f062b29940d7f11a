"""Where a decoding step's time goes against the weight-bandwidth bound (benchmarks/bench_decode.py).

A batch-1 step reads every weight once: its floor is the bytes it must read over the memory bandwidth. `read_bytes`
counts them per module (a Linear's whole weight, an embedding's one row per token, norms, the static cache's keys
and values over all the slots the step attends to). `op_table` is the step's kernels (CUDA: the device kernels of
one run outside its graph, from Step.count_kernels; CPU: the top-level aten ops and their CPU time), `budget` splits
the measured step time (the loop's GPU time per step + the host's share) into

    bound      read bytes / bandwidth (the copy bandwidth measured in the run; the datasheet's beside it)
    gemm       the matrix kernels' time over their floor (Linear weight bytes / bandwidth)
    other      every other kernel's time over the rest of the bytes' floor (norms, rotary, attention, copies, ...)
    gaps       the GPU's time between kernels (in a replayed graph: launch gaps and tails)
    host       the host's share of the loop (Python, the one read per round)

which add up to the step time exactly (bound + gemm + other + gaps + host = device + host).
"""

from __future__ import annotations

import re

import torch

DATASHEET_GB_S = (("H200", 4800.0), ("H100", 3350.0))
"""HBM bandwidth by the vendors' datasheets (GB/s), by device name; the goal's bound is quoted against it."""

KINDS = (
    ("attention", re.compile(r"fmha|flash|attention|sdpa|softmax", re.I)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|xmma|cublas|splitk|wgmma|cutlass|aten::(linear|addmm|mm|matmul|bmm)$"
                        r"|(^|_)(add|b)?mm(_|\d|$)", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|index|cat|gather|scatter|fill|aten::(to|_to_copy|clone|stack|zero_)$",
                        re.I)),
    ("select", re.compile(r"argmax|argmin|topk|sort|multinomial", re.I)),
)
"""Kernel kinds by name, first match wins (a kernel of none is "elementwise": norms, rotary, activations, fused
pointwise and reduction kernels without a matrix product)."""


def datasheet_bw(device_name: str) -> float | None:
    """Bytes/s of the datasheet for this device name, if known."""
    return next((gb * 1e9 for key, gb in DATASHEET_GB_S if key in device_name), None)


def classify(name: str) -> str:
    return next((kind for kind, pat in KINDS if pat.search(name)), "elementwise")


def read_bytes(module: torch.nn.Module, rows: int = 1, caches=()) -> dict:
    """Bytes a step of `rows` tokens reads: "read" (all of it), "linear" (Linear weights, the matrix products'
    floor), "weights" (every parameter once, the convention of bench_decode's bound_tok_s), "kv" (the caches'
    tensors). A weight shared by an embedding and a Linear (tied) counts as the Linear's: the head reads all of it."""
    linear_ptrs = {m.weight.data_ptr() for m in module.modules() if isinstance(m, torch.nn.Linear)}
    seen: set[int] = set()
    out = dict.fromkeys(("read", "linear", "weights", "kv"), 0)
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            n = p.numel() * p.element_size()
            out["weights"] += n
            if p.data_ptr() in linear_ptrs:
                out["linear"] += n
                out["read"] += n
            elif isinstance(m, torch.nn.Embedding):
                out["read"] += rows * p.shape[-1] * p.element_size()
            else:
                out["read"] += n
    for t in caches:
        if isinstance(t, torch.Tensor):
            out["kv"] += t.numel() * t.element_size()
    out["read"] += out["kv"]
    return out


def draft_round_bytes(drafter_bytes: dict, fc_bytes: int, depth: int) -> dict:
    """A draft round's reads: `depth` drafter forwards (the extend of the pending pairs, then depth-1 levels) and
    `depth` heads, the fc projection once (only the extend projects target states)."""
    return {k: (depth * (v - fc_bytes) + fc_bytes if k in ("read", "linear") else v) for k, v in drafter_bytes.items()}


def cache_tensors(fd, drafter: bool = False) -> list:
    """The static caches' key/value tensors of a FastDecoder (the target's, or the drafter's)."""
    if drafter:
        dc = getattr(fd, "dcache", None)
        return [dc.k, dc.v] if dc is not None else []
    return [t for layer in getattr(getattr(fd, "cache", None), "layers", []) for t in
            (getattr(layer, "keys", None), getattr(layer, "values", None))]


def op_table(step, cuda: bool) -> list[tuple[str, int, float]]:
    """[(kernel or op name, calls, microseconds)] of one run of a fast-decoder Step, costliest first; the step's
    state is restored after the run. CUDA: its device kernels (Step.count_kernels' table); CPU: top-level aten ops."""
    if cuda:
        step.count_kernels(True)
        return list(step.kernel_table)
    from torch.profiler import ProfilerActivity, profile

    saved = [t.clone() for t in step.state]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step.run()
    for t, v in zip(step.state, saved):
        t.copy_(v)
    table: dict[str, list] = {}
    for e in prof.events():
        if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::")):
            row = table.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.cpu_time_total
    return sorted(((n, c, us) for n, (c, us) in table.items()), key=lambda r: -r[2])


def budget(table, nbytes: dict, bw: float, device_ms: float, host_ms: float, peak_bw: float | None = None) -> dict:
    """The split of (device_ms + host_ms) described in the module docstring, for a step whose kernels are `table`
    and which reads nbytes["read"] bytes (nbytes["linear"] of them Linear weights)."""
    kinds: dict[str, dict] = {}
    for name, calls, us in table:
        row = kinds.setdefault(classify(name), {"ms": 0.0, "kernels": 0})
        row["ms"] += us / 1e3
        row["kernels"] += calls
    kernel_ms = sum(r["ms"] for r in kinds.values())
    bound_ms = 1e3 * nbytes["read"] / bw
    gemm_floor = 1e3 * nbytes["linear"] / bw
    gemm_ms = kinds.get("gemm", {}).get("ms", 0.0)
    ms = device_ms + host_ms
    out = {"ms": ms, "read_gb": nbytes["read"] / 1e9, "bound_ms": bound_ms, "of_bound": bound_ms / ms if ms else 0.0,
           "device_ms": device_ms, "host_ms": host_ms, "kernel_ms": kernel_ms,
           "kernels": sum(r["kernels"] for r in kinds.values()), "kinds": kinds,
           "gemm_floor_ms": gemm_floor, "gemm_of_floor": gemm_floor / gemm_ms if gemm_ms else None,
           "over_bound_ms": {"gemm": gemm_ms - gemm_floor,
                             "other": (kernel_ms - gemm_ms) - (bound_ms - gemm_floor),
                             "gaps": device_ms - kernel_ms, "host": host_ms}}
    if peak_bw:
        out["bound_ms_datasheet"] = 1e3 * nbytes["read"] / peak_bw
        out["of_datasheet_bound"] = out["bound_ms_datasheet"] / ms if ms else 0.0
    return out


def line(b: dict) -> str:
    """One printed line of a budget."""
    o = b["over_bound_ms"]
    ds = f", {100 * b['of_datasheet_bound']:.1f}% of the datasheet's" if "of_datasheet_bound" in b else ""
    kinds = " ".join(f"{k} {v['ms']:.3f}/{v['kernels']}" for k, v in sorted(b["kinds"].items(),
                                                                          key=lambda kv: -kv[1]["ms"]))
    return (f"{b['ms']:.3f} ms = bound {b['bound_ms']:.3f} ({100 * b['of_bound']:.1f}%{ds}) + gemm {o['gemm']:+.3f} + "
            f"other {o['other']:+.3f} + gaps {o['gaps']:+.3f} + host {o['host']:+.3f}; kernels ms/count: {kinds}")
