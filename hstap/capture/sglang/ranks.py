"""Where a process of an SGLang server sits among its ranks, as the capture hook (capture/sglang/hook.py) needs it:
only attention-TP rank 0 of a data-parallel scheduler writes, and each scheduler writes its own store rank."""

from __future__ import annotations

import torch


def parallel_ranks() -> tuple[int, int, int]:
    """(attn_tp_rank, store rank, store ranks) of this process. The store has one rank per data-parallel scheduler:
    attention-DP group d of DP replica r writes rank r * attn_dp_size + d (the driver's `store_world` counts them).
    Read from SGLang >= 0.5.2x `runtime_context.get_parallel()` (dp_rank None: no DP controller, one replica), then
    `layers/dp_attention` (0.5.10-era), then torch.distributed's rank (plain TP), then (0, 0, 1)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        tp = int(p.attn_tp_rank)
        try:
            dp, dps = int(p.attn_dp_rank), int(p.attn_dp_size)
        except (RuntimeError, ValueError, AttributeError):
            dp, dps = 0, 1
        try:
            replica, replicas = int(p.dp_rank or 0), int(p.dp_size or 1)
        except (RuntimeError, ValueError, AttributeError, TypeError):
            replica, replicas = 0, 1
        return tp, replica * dps + dp, replicas * dps
    except (ImportError, RuntimeError, ValueError, AttributeError):
        pass
    try:
        from sglang.srt.layers.dp_attention import get_attention_dp_rank, get_attention_dp_size, get_attention_tp_rank

        return int(get_attention_tp_rank()), int(get_attention_dp_rank()), int(get_attention_dp_size())
    except (ImportError, RuntimeError, ValueError, AttributeError, AssertionError, TypeError):
        pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank()), 0, 1
    return 0, 0, 1
