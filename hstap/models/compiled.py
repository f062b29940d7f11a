"""torch.compile regions with a recompile budget of their own, and compile failures told apart from other errors:
the machinery of the drafter's compiled flex_attention (`hstap.models.drafter`) and of the training-time test's compiled
layers and objective (`hstap.train.ttt`).

Single-device model code: no I/O, no ranks, no logging.
"""

from __future__ import annotations

import inspect

import torch

from hstap.common import HstapError


RECOMPILE_LIMIT = 64
"""Graphs one compiled region may hold (dynamo's default, 8 per code object, is too few for TTT: see
`hstap.models.drafter._flex`)."""


def compile_region(fn, **kw):
    """torch.compile `fn` with a budget of RECOMPILE_LIMIT graphs for its code object (TTT's compiled regions).

    Past its recompile limit dynamo silently runs the function eagerly. Where torch.compile takes a per-region
    `recompile_limit`, that is the budget (and with fullgraph=True running out raises FailOnRecompileLimitHit instead
    of falling back). Older torch has only the process-wide limit: it is raised around each call of the region, not for
    the whole process, so nothing else in the process changes."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=RECOMPILE_LIMIT, **kw)
    compiled = torch.compile(fn, **kw)
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"

    def call(*a, **k):
        with cfg.patch(**{name: max(getattr(cfg, name), RECOMPILE_LIMIT)}):
            return compiled(*a, **k)
    return call


class FlexCompileError(HstapError):
    """Compiling flex_attention for a shape failed (dynamo, inductor or Triton raised): the caller may run the exact SDPA
    path instead (`hstap.train.ttt.TTTModel` does)."""


def guard_flex_compile(compiled):
    """`compiled(q, k, v, **kw)` with the backward lowered at forward time and compile failures as FlexCompileError."""
    import torch._functorch.config as fcfg

    eager_bw = {"force_non_lazy_backward_lowering": True} if hasattr(fcfg, "force_non_lazy_backward_lowering") else {}

    def call(q, k, v, **kw):
        try:
            with fcfg.patch(**eager_bw):
                return compiled(q, k, v, **kw)
        except Exception as e:  # noqa: BLE001 - only compile failures are converted; anything else is re-raised
            cause = compile_failure(e)
            if cause is None:
                raise
            raise FlexCompileError(f"compiling flex_attention failed for query {tuple(q.shape)} {q.dtype}, key "
                                   f"{tuple(k.shape)}: {cause}") from e
    return call


def compile_failure(e: BaseException) -> str | None:
    """'Type: first line' of the innermost dynamo/inductor/Triton exception in e's chain (a failure to compile), or
    None when there is none or the chain holds an out-of-memory error (a failure to run, not to compile)."""
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(x, torch.OutOfMemoryError) for x in chain):
        return None
    hits = [x for x in chain if type(x).__module__.startswith(("torch._dynamo", "torch._inductor", "triton"))]
    if not hits:
        return None
    root = hits[-1]
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    return f"{type(root).__name__}: {lines[0][:240] if lines else ''}".rstrip(": ")
