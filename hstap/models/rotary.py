"""Rotary position embedding (RoPE) for every forward in hstap/models: the rotation of q and k, the drafter's rotary
module, and cos/sin tables read by position.

    rotate(q, k, cos, sin)            HF's rotate_half convention; cos/sin broadcast over the head axis
    rotary_module(cfg)                HF's LlamaRotaryEmbedding for a drafter config (its rope_theta and rope_scaling)
    RotaryTables(rope, n, dtype, dev) cos/sin of positions 0..n-1, made once by a model's own rotary module;
                                      .at(pos) reads the rows of a step's positions

The frequencies always come from HF's rotary module (default, llama3, yarn, ... scaling: the target's own numbers),
never from a formula of ours. Tables are for the decode-time forwards (lean_target, lean_drafter, slots): HF's module
recomputes cos/sin (an outer product and a cat) on every call, a table costs one index_select per step. A rotary whose
frequencies depend on the sequence length (dynamic, longrope) has no fixed table: lean_target.unsupported says so.

Single-device model code: no I/O, no ranks, no logging.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rotary embedding of q and k (HF's rotate_half convention); cos/sin broadcast over the head axis."""
    def half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + half(q) * sin, k * cos + half(k) * sin


def rotary_module(cfg) -> nn.Module:
    """HF's rotary module for a drafter config (hstap.models.drafter.DrafterConfig: hidden_size, head counts, head_dim,
    max_position_embeddings, rope_theta, rope_scaling): inv_freq identical to the target's for every rope_type."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    max_pos = max(cfg.max_position_embeddings, int(rope.get("original_max_position_embeddings", 0)) + 1)
    lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                     num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=max_pos, rope_parameters=rope)
    return LlamaRotaryEmbedding(lc)


class RotaryTables:
    """cos/sin of positions 0..n-1, (n, hd) each, computed once by `rope`, a model's own rotary module called as HF
    calls it, (x, position_ids (1, n)) -> cos, sin (1, n, hd) in x's dtype (its scaling included)."""

    @torch.no_grad()
    def __init__(self, rope, n: int, dtype: torch.dtype, device):
        pos = torch.arange(n, device=device)[None]  # (1, n)
        cos, sin = rope(torch.zeros(1, dtype=dtype, device=device), pos)  # (1, n, hd) each
        self.cos, self.sin = cos[0], sin[0]  # (n, hd)

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (B, T) long, each < n -> cos, sin (B, 1, T, hd): the rows of those positions, broadcast over heads."""
        B, T = pos.shape
        p = pos.reshape(-1)  # (B*T,)
        return self.cos.index_select(0, p).view(B, 1, T, -1), self.sin.index_select(0, p).view(B, 1, T, -1)
