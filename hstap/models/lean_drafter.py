"""The EAGLE-3 drafter's forward with fewer kernels per step, for the fast decoder's draft steps (hstap.speculative.fast,
`lean=True`): the same function as `Eagle3Drafter.forward` (hstap.models.drafter) on the same weights, up to rounding.

On a small target a draft step is kernel-count bound (a few microseconds per kernel even inside a CUDA graph), so
what it saves is kernels, not flops:
    q/k/v       one GEMM over the concatenated projection weights instead of three;
    gate/up     one GEMM over the concatenated MLP input weights instead of two;
    rotary      cos/sin read from tables made once per cache size (hstap.models.rotary.RotaryTables; HF's rotary
                module recomputes them, an outer product and a cat, on every call);
    attention   grouped-query attention with a mask as ONE fused SDPA call: the queries of the g heads that share a
                kv head are stacked along the query axis, (1, n_kv, g*T, hd), against the un-repeated keys, the mask
                repeated g times along its rows. `enable_gqa=True` with a mask runs SDPA's math kernel instead
                (repeated keys and values, two batched GEMMs and a softmax), and repeat_kv copies the cache;
                `attention="math"`: the same attention as two matrix products and a softmax over the un-repeated
                cache, for the compiler to fuse (hstap.models.lean_target.attend, which the target's layers use too).
The weights are copies (the drafter is small); the drafter itself is left as it is. A drafter class that overrides
`forward` (a test double, another architecture) is called as it is, and so is a drafter of speculators' variants
(`hstap.models.drafter.SPECULATORS_FLAGS`): only the stock midlayer is rewritten.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hstap.models.drafter import SPECULATORS_FLAGS, Eagle3Drafter
from hstap.models.lean_target import FUSE_MAX_BYTES, attend, linear, stack_heads
from hstap.models.rotary import RotaryTables, rotate


class LeanDrafter:
    """Duck-typed like Eagle3Drafter where the decoding steps use it: `config`, `d2t`, `project`, `compute_logits`
    and the call `(ids, hidden, pos, cache, mask) -> h_out`; positions must be < max_len (the rotary tables)."""

    def __init__(self, drafter, max_len: int, attention: str = "sdpa", fuse_rows: int = 0,
                 fuse_bytes: int = FUSE_MAX_BYTES):
        self.drafter, self.config, self.d2t, self.attention = drafter, drafter.config, drafter.d2t, attention
        self.fuse_rows = fuse_rows  # few-row products (and attention) as reductions: lean_target.linear, attend
        self.product = functools.partial(linear, fuse_rows=fuse_rows, fuse_bytes=fuse_bytes)
        # speculators' variants (SPECULATORS_FLAGS) run the drafter's own forward, project and compute_logits
        self.fused = type(drafter).forward is Eagle3Drafter.forward and not any(
            getattr(drafter.config, f, False) for f in SPECULATORS_FLAGS)
        m = drafter.midlayer
        a = m.self_attn
        self.nh, self.nkv, self.hd = a.n_heads, a.n_kv, a.hd
        self.inter = m.mlp.gate_proj.weight.shape[0]
        with torch.no_grad():
            self.wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # ((nh + 2 nkv) hd, 2H)
            self.wgu = torch.cat([m.mlp.gate_proj.weight, m.mlp.up_proj.weight])  # (2 I, H)
        w = drafter.fc.weight
        self.rope = RotaryTables(drafter.rope, max_len, w.dtype, w.device)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        if not self.fused or type(self.drafter).project is not Eagle3Drafter.project:
            return self.drafter.project(aux)
        fc = self.drafter.fc
        if aux.dim() == 4:
            aux = aux.flatten(-2)  # (B, T, K*Ht)
        return self.product(aux.to(fc.weight.dtype), fc.weight, fc.bias)  # (B, T, H)

    def compute_logits(self, h_out: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        if not self.fused or type(d).compute_logits is not Eagle3Drafter.compute_logits:
            return d.compute_logits(h_out)
        return self.product(d.norm(h_out), d.lm_head.weight, d.lm_head.bias)  # (B, T, Vd)

    def __call__(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, cache,
                 attn_mask: torch.Tensor) -> torch.Tensor:
        """input_ids (1, T), hidden (1, T, H), position_ids (1, T), cache: a DrafterStaticCache set to its slots,
        attn_mask (T, S) bool -> h_out (1, T, H)."""
        d, m = self.drafter, self.drafter.midlayer
        if not self.fused:
            return d(input_ids, hidden, position_ids, cache, attn_mask)
        B, T = input_ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        emb = d.embed_tokens(input_ids).to(hidden.dtype)  # (1, T, H)
        cos, sin = self.rope.at(position_ids)  # (1, 1, T, hd) each
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)  # (1, T, 2H)
        q, k, v = self.product(x, self.wqkv, None).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (1, nh, T, hd)
        k = k.view(B, T, nkv, hd).transpose(1, 2)  # (1, nkv, T, hd)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        q, k = rotate(q, k, cos, sin)
        keys, values = cache.append(k, v)  # (1, nkv, S, hd)
        mask = stack_heads(attn_mask, nh // nkv)  # (g*T, S)
        out = attend(q, keys, values, mask, hd ** -0.5, self.attention, self.fuse_rows)  # (1, T, nh*hd)
        r = self.product(out, m.self_attn.o_proj.weight, m.self_attn.o_proj.bias) + hidden  # (1, T, H)
        gate, up = self.product(m.post_attention_layernorm(r), self.wgu, None).split(self.inter, dim=-1)  # (1, T, I)
        return self.product(F.silu(gate) * up, m.mlp.down_proj.weight, m.mlp.down_proj.bias) + r  # (1, T, H) pre-norm
