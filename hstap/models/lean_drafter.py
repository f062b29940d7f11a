"""The EAGLE-3 drafter's kernels with fewer launches per step, for the fast decoder's draft steps
(hstap.speculative.fast, `lean=True`): a strategy of the drafter's one forward (hstap.models.drafter, `kernels`), so
the same function as `Eagle3Drafter.forward` on the same weights, up to rounding; the layers, norms, residuals and
speculators' variants are the drafter's own.

On a small target a draft step is kernel-count bound (a few microseconds per kernel even inside a CUDA graph), so
what it saves is kernels, not flops:
    q/k/v       one GEMM over the concatenated projection weights instead of three;
    gate/up     one GEMM over the concatenated MLP input weights instead of two;
    products    `product` (hstap.models.lean_target.linear): few-row products as reductions when fuse_rows allows;
    rotary      cos/sin read from tables made once per cache size (hstap.models.rotary.RotaryTables; HF's rotary
                module recomputes them, an outer product and a cat, on every call);
    attention   grouped-query attention with a mask as ONE fused SDPA call: the queries of the g heads that share a
                kv head are stacked along the query axis, (1, n_kv, g*T, hd), against the un-repeated keys, the mask
                repeated g times along its rows once per forward. `enable_gqa=True` with a mask runs SDPA's math
                kernel instead (repeated keys and values, two batched GEMMs and a softmax), and repeat_kv copies the
                cache; `attention="math"`: the same attention as two matrix products and a softmax over the
                un-repeated cache, for the compiler to fuse (hstap.models.lean_target.attend, which the target's
                layers use too).
The fused weights are copies (the drafter is small); the drafter itself is left as it is. `LeanDrafter` binds a
drafter to these kernels with the call the decoding steps make; a drafter class that overrides `forward` (a test
double, another architecture) is called as it is, and so are its own `project` and `compute_logits`.
"""

from __future__ import annotations

import functools

import torch

from hstap.models.drafter import Eagle3Drafter
from hstap.models.lean_target import FUSE_MAX_BYTES, attend, fuse_linears, linear, stack_heads
from hstap.models.rotary import RotaryTables


class FusedLayer:
    """The kernels of one decoder layer (ModuleKernels' layer interface): its fused q/k/v and gate/up weights."""

    def __init__(self, layer, product, attention: str, fuse_rows: int):
        a, m = layer.self_attn, layer.mlp
        self.product, self.attention, self.fuse_rows = product, attention, fuse_rows
        self.scale = a.hd ** -0.5
        self.sizes = [a.n_heads * a.hd, a.n_kv * a.hd, a.n_kv * a.hd]
        self.inter = m.gate_proj.weight.shape[0]
        with torch.no_grad():
            self.wqkv = fuse_linears([a.q_proj, a.k_proj, a.v_proj])  # ((nh + 2 nkv) hd, in), None
            self.wgu = fuse_linears([m.gate_proj, m.up_proj])  # (2 I, H), None

    def linear(self, x: torch.Tensor, module) -> torch.Tensor:
        return self.product(x, module.weight, module.bias)

    def qkv(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x, *self.wqkv).split(self.sizes, dim=-1)  # (B, T, nh*hd), (B, T, nkv*hd) x 2

    def gate_up(self, mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.product(x, *self.wgu).split(self.inter, dim=-1)  # (B, T, I) each

    def attend(self, attn, q, k, v, cache, mask) -> torch.Tensor:
        """q (B, nh, T, hd), k/v (B, nkv, T, hd) appended to `cache` (append(k, v) -> its keys and values
        (B, nkv, S, hd); None: the step's own), mask (g*T, S) bool or additive (FusedKernels.mask), never None ->
        (B, T, nh*hd)."""
        keys, values = (k, v) if cache is None else cache.append(k, v)  # (B, nkv, S, hd)
        return attend(q, keys, values, mask, self.scale, self.attention, self.fuse_rows)


class FusedKernels:
    """The drafter's kernels for decoding (module docstring), ModuleKernels' interface: fused weights per decoder
    layer, rotary tables for positions < max_len, grouped attention (`attention` "sdpa" or "math") over a cache and an
    explicit mask (T, S), products through `linear` with fuse_rows and fuse_bytes."""

    def __init__(self, drafter: Eagle3Drafter, max_len: int, attention: str = "sdpa", fuse_rows: int = 0,
                 fuse_bytes: int = FUSE_MAX_BYTES):
        if attention not in ("sdpa", "math"):
            raise ValueError(f"attention: expected 'sdpa' or 'math', got {attention!r}")
        self.product = functools.partial(linear, fuse_rows=fuse_rows, fuse_bytes=fuse_bytes)
        self.layers = [FusedLayer(layer, self.product, attention, fuse_rows) for layer in drafter.decoder_layers()]
        w = drafter.fc.weight
        self.tables = RotaryTables(drafter.rope, max_len, w.dtype, w.device)

    def rope(self, drafter, hidden: torch.Tensor, position_ids: torch.Tensor):
        return self.tables.at(position_ids)  # (B, 1, T, hd) each

    def mask(self, mask: torch.Tensor, groups: int) -> torch.Tensor:
        return stack_heads(mask, groups)  # (g*T, S): once per forward, not per layer

    def layer(self, i: int) -> FusedLayer:
        return self.layers[i]

    def linear(self, x: torch.Tensor, module) -> torch.Tensor:
        return self.product(x, module.weight, module.bias)


class LeanDrafter:
    """A drafter with FusedKernels bound, duck-typed like Eagle3Drafter where the decoding steps use it: `config`,
    `d2t`, `project`, `compute_logits` and the call `(ids, hidden, pos, cache, mask) -> h_out`; positions must be
    < max_len (the rotary tables)."""

    def __init__(self, drafter, max_len: int, attention: str = "sdpa", fuse_rows: int = 0,
                 fuse_bytes: int = FUSE_MAX_BYTES):
        self.drafter, self.config, self.d2t = drafter, drafter.config, drafter.d2t
        stock = isinstance(drafter, Eagle3Drafter) and type(drafter).forward is Eagle3Drafter.forward
        self.kernels = FusedKernels(drafter, max_len, attention, fuse_rows, fuse_bytes) if stock else None

    def _own(self, name: str) -> bool:
        """The drafter's own method runs: no fused kernels, or a class that overrides it."""
        return self.kernels is None or getattr(type(self.drafter), name) is not getattr(Eagle3Drafter, name)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        if self._own("project"):
            return self.drafter.project(aux)
        return self.drafter.project(aux, self.kernels)  # (B, T, H)

    def compute_logits(self, h_out: torch.Tensor) -> torch.Tensor:
        if self._own("compute_logits"):
            return self.drafter.compute_logits(h_out)
        return self.drafter.compute_logits(h_out, self.kernels)  # (B, T, Vd)

    def __call__(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, cache,
                 attn_mask: torch.Tensor) -> torch.Tensor:
        """input_ids (1, T), hidden (1, T, H), position_ids (1, T), cache: a DrafterStaticCache set to its slots,
        attn_mask (T, S) bool -> h_out (1, T, H)."""
        if self.kernels is None:
            return self.drafter(input_ids, hidden, position_ids, cache, attn_mask)
        return self.drafter(input_ids, hidden, position_ids, cache, attn_mask, self.kernels)
