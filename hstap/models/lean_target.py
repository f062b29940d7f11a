"""The target's decoder layers with fewer kernels per step, for the fast decoder (hstap.speculative.fast,
`target_layers="lean"`): the same function as the HF layers that `fast_steps.run_target` calls, on the same weights,
up to rounding.

For the Llama family (llama, mistral, qwen2, qwen3: RMSNorm, rotary, grouped-query attention, SwiGLU MLP; Qwen2's
q/k/v biases, Qwen3's per-head q/k norms). On a small target a decoding step is bound by its kernel count, not its
bytes, and the HF layer spends kernels on generality:
    q/k/v       one GEMM over one fused weight instead of three (a copy: the model itself is left untouched);
    gate/up     likewise, one GEMM instead of two;
    rotary      cos/sin read from tables built once per cache size by the model's own rotary module (the HF forward
                recomputes them on every step);
    attention   the keys and values written straight into the static cache's tensors at the step's slots, then
                grouped-query attention as ONE fused SDPA call: the queries of the g heads sharing a kv head stacked
                along the query axis (1, n_kv, g*T, hd) against the un-repeated cache, the mask repeated g times
                (HF's sdpa path with a mask repeats the whole cache g times per layer first: repeat_kv).
`attention="math"` computes the same attention as two matrix products and a softmax (`attend`), and `fuse_rows` writes
the products of a few-row step (a chain's verify, an extend) as broadcast sums (`linear`): torch.compile then emits
reductions fused with the norms and activations around them, as it does for a one-row step, where a GEMM library call
would fuse with nothing. Measured on the H200 (benchmarks/RESULTS.md): in fp32 the SDPA call of a one-token step is
the memory-efficient kernel at ~60 us, most of a reference-target decoding step.

`lean_target(target, S)` returns (None, why) for any other layer structure or a length-dependent rotary (dynamic,
longrope) and the caller keeps the HF layers; the fast decoder also checks the result against Target.capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstap.models.drafter import rotate

FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def fuse_linears(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linear layers of one input: copies (the model is left as it is, so decoders
    built on it before keep valid graphs; the cost is a second copy of these weights, ~70% of a Llama's)."""
    w = torch.cat([m.weight.detach() for m in linears])  # (sum out, in)
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("mixed biases")
    return w, (torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None)


FUSE_MAX_BYTES = 16 << 20
"""Default largest weight a few-row product is written as a reduction for (`linear`'s fuse_bytes): it is read once
per row, so it must sit in L2 (50 MB on an H200) for that to cost no more than one GEMM's read; the 8B shape's
matrices do not. benchmarks/bench_rows.py (RESULTS.md, ninth session) finds the reduction slower than cuBLAS from
~3 MB up at 2-16 rows on the reference target's shapes (fused gate/up 3.1 MB, lm_head 12.6 MB); a lower cap has not
been measured end to end yet (bench_decode's `fusedR/MB+cdt` variants)."""


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, fuse_rows: int = 0,
           fuse_bytes: int = FUSE_MAX_BYTES) -> torch.Tensor:
    """x (..., K) @ w (N, K)^T (+ b). With at most `fuse_rows` rows (and a weight of at most fuse_bytes) as a
    broadcast product summed over K, which torch.compile emits as one reduction fused with its neighbours (a norm
    before, a residual or activation after), as coordinate-descent tuning does by itself for ONE row; a GEMM library
    call fuses with nothing and adds a split-K reduction kernel. The same sum, in another order: equal up to
    rounding. Eager, this materialises (rows, N, K): only for compiled steps (fuse_rows 0 elsewhere)."""
    rows = x.numel() // x.shape[-1]
    if 1 < rows <= fuse_rows and w.numel() * w.element_size() <= fuse_bytes:
        y = (x.unsqueeze(-2) * w).sum(-1)  # (..., N)
    else:
        y = F.linear(x, w)
    return y if b is None else y + b


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
           how: str = "sdpa", fuse_rows: int = 0) -> torch.Tensor:
    """Grouped-query attention with the queries stacked by kv head: q (1, nkv, R, hd) (R = g*T), keys/values
    (1, nkv, S, hd), mask (R, S) additive or bool -> (1, nkv, R, hd). "sdpa": one fused kernel (in fp32 the
    memory-efficient kernel, which walks the S slots of a head serially: tens of us per call for one query);
    "math": softmax(q k^T s + m) v with the softmax in fp32, as HF's eager attention computes it, both products as
    broadcast sums when R <= fuse_rows (the compiler's reductions, parallel over the slots; see `linear`)."""
    if how == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, torch.finfo(q.dtype).min)
    small = q.shape[-2] <= fuse_rows
    if small:
        s = (q.unsqueeze(-2) * keys.unsqueeze(-3)).sum(-1)  # (1, nkv, R, S)
    else:
        s = torch.matmul(q, keys.transpose(-1, -2))
    p = torch.softmax((s * scale + mask).float(), dim=-1).to(values.dtype)  # (1, nkv, R, S)
    if small:
        return (p.unsqueeze(-1) * values.unsqueeze(-3)).sum(-2)  # (1, nkv, R, hd)
    return torch.matmul(p, values)


def unsupported(target) -> str | None:
    """Why the lean layers cannot stand in for this target's, or None."""
    cfg = target.config
    if cfg.model_type not in FAMILY:
        return f"model type {cfg.model_type!r} (lean layers: {', '.join(FAMILY)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    rope = getattr(target.base.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):  # their frequencies depend on the sequence length: no fixed table
        return f"rope_type {rope!r}"
    for i, layer in enumerate(target.layers):
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or m is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}: not a Llama-style attention + SwiGLU layer"
    return None  # a sliding window needs no check: fastdecode's static cache holds one only when it spans every slot


class LeanTarget:
    """forward(cache, layers, ids, pos, mask, rows) with fast_steps.run_target's contract, on `target`'s weights;
    positions must be < max_len (the rotary tables; `resize` rebuilds them for a longer cache)."""

    def __init__(self, target, max_len: int, attention: str = "sdpa", fuse_rows: int = 0,
                 fuse_bytes: int = FUSE_MAX_BYTES):
        if attention not in ("sdpa", "math"):
            raise ValueError(f"attention: expected 'sdpa' or 'math', got {attention!r}")
        self.target, self.attention, self.fuse_rows, self.fuse_bytes = target, attention, fuse_rows, fuse_bytes
        cfg = target.config
        a0 = target.layers[0].self_attn
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(a0, "head_dim", None) or cfg.hidden_size // self.nh
        self.scale = float(getattr(a0, "scaling", self.hd ** -0.5))
        self.inter = target.layers[0].mlp.gate_proj.weight.shape[0]
        with torch.no_grad():
            self.qkv = [fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                        for layer in target.layers]
            self.gu = [fuse_linears([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in target.layers]
        self.resize(max_len)

    @torch.no_grad()
    def resize(self, max_len: int) -> None:
        w = self.target.embed_tokens.weight
        pos = torch.arange(max_len, device=w.device)[None]  # (1, S)
        cos, sin = self.target.base.rotary_emb(torch.zeros(1, 1, 1, dtype=w.dtype, device=w.device), pos)
        self.cos, self.sin = cos[0], sin[0]  # (S, hd): the model's own rotary (scaling included)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return linear(x, w, b, self.fuse_rows, self.fuse_bytes)

    def forward(self, cache, layers: list[int], ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                rows: torch.Tensor | None = None):
        """ids (1, T) at positions pos (1, T), additive mask (1, 1, T, S), written at the cache's slots
        cumulative_length + arange(T) (fast_steps.seek) -> logits (T or R, V) fp32, fc input (T, K, H)."""
        t = self.target
        B, T = ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        g = nh // nkv
        p = pos.reshape(-1)  # (T,)
        cos = self.cos.index_select(0, p).view(B, 1, T, hd)
        sin = self.sin.index_select(0, p).view(B, 1, T, hd)
        S = mask.shape[-1]
        mg = mask[0, 0].expand(g, T, S).reshape(g * T, S)  # (g*T, S): row j*T+i = query i of head j of a group
        want = {layer: j for j, layer in enumerate(layers)}
        grabbed: list = [None] * len(layers)
        h = t.embed_tokens(ids)  # (1, T, H)
        ar = torch.arange(T, device=ids.device)
        fr = self.fuse_rows
        lin = self._linear
        for i, layer in enumerate(t.layers):
            a, m, c = layer.self_attn, layer.mlp, cache.layers[i]
            x = layer.input_layernorm(h)  # (1, T, H)
            w, bias = self.qkv[i]
            q, k, v = lin(x, w, bias).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k, v = q.view(B, T, nh, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
            if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
                q, k = a.q_norm(q), a.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (1, heads, T, hd)
            q, k = rotate(q, k, cos, sin)
            if not c.is_initialized:
                c.lazy_initialization(k, v)
            slots = c.cumulative_length + ar  # (T,)
            c.keys.index_copy_(2, slots, k)
            c.values.index_copy_(2, slots, v)
            c.cumulative_length.add_(T)  # as StaticLayer.update does
            qg = q.reshape(B, nkv, g * T, hd)  # query head i*g+j (kv head i) -> rows j*T.. of group i
            o = attend(qg, c.keys, c.values, mg, self.scale, self.attention, g * fr)  # (1, nkv, g*T, hd)
            o = o.reshape(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)
            h = h + lin(o, a.o_proj.weight, a.o_proj.bias)  # (1, T, H)
            gate, up = lin(layer.post_attention_layernorm(h), *self.gu[i]).split(self.inter, dim=-1)
            h = h + lin(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias)  # (1, T, H)
            if i in want:
                grabbed[want[i]] = h
        final = t.norm(h)  # (1, T, H)
        aux = torch.stack(grabbed, dim=2) if layers else final.unsqueeze(2)  # (1, T, K, H)
        head_in = final[0] if rows is None else final[0].index_select(0, rows)  # (T or R, H)
        head = t.lm_head
        logits = lin(head_in, head.weight, head.bias) if isinstance(head, torch.nn.Linear) else t.logits(head_in)
        return logits.float(), aux[0]


def lean_target(target, max_len: int, attention: str = "sdpa", fuse_rows: int = 0,
                fuse_bytes: int = FUSE_MAX_BYTES) -> tuple[LeanTarget | None, str | None]:
    """(LeanTarget, None), or (None, why not) for a target whose layers it does not reproduce."""
    why = unsupported(target)
    if why:
        return None, why
    try:
        return LeanTarget(target, max_len, attention, fuse_rows, fuse_bytes), None
    except (ValueError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"
