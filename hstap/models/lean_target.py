"""The target's Llama-family decoder layers as ONE forward over a pluggable KV cache, with fewer kernels per step: the
fast decoder's target (hstap.speculative.fast, `target_layers="lean"`) and the continuous engine's (hstap.models.slots)
run the same `LeanTarget.states`; the same function as the HF layers, on the same weights, up to rounding.

The cache is the one seam between a layer and its keys and values (gpt-fast's `KVCache.update`, transformers' own
`Cache.update`): `cache.update(k, v, layer) -> (keys, values)` writes the step's rotated keys and values
(B, n_kv, T, hd) where its tokens belong and returns what the step attends, (B, n_kv, S, hd); the mask (..., T, S)
says which of those S slots each token sees. `StaticSlots` is one: transformers' StaticCache as the fast decoder
drives it (T slots from cumulative_length on, set by static_kv.seek; prefill, decode and draft-tree verify alike);
`slots.SlotCache` another (token (r, t) at slot pos[r, t] of its own row, attention over the rows' first `span`
slots).

For the Llama family (llama, mistral, qwen2, qwen3: RMSNorm, rotary, grouped-query attention, SwiGLU MLP; Qwen2's
q/k/v biases, Qwen3's per-head q/k norms). On a small target a decoding step is bound by its kernel count, not its
bytes, and the HF layer spends kernels on generality:
    q/k/v       one GEMM over one fused weight instead of three (a copy: the model itself is left untouched);
    gate/up     likewise, one GEMM instead of two;
    rotary      cos/sin read from tables built once per cache size by the model's own rotary module
                (hstap.models.rotary; the HF forward recomputes them on every step);
    attention   grouped-query attention as ONE call: the queries of the g heads sharing a kv head stacked along the
                query axis (B, n_kv, g*T, hd) against the un-repeated cache, the mask stacked g times once per forward
                (`stack_heads`; HF's sdpa path with a mask repeats the whole cache g times per layer first: repeat_kv).
Two strategies of the same forward: `attention="math"` computes the attention as two matrix products and a softmax
(`attend`), and `product` is how x @ w^T + b is computed: by default `linear`, which writes the products of a few-row
step (a chain's verify, an extend) as broadcast sums when `fuse_rows` allows: torch.compile then emits reductions
fused with the norms and activations around them, as it does for a one-row step, where a GEMM library call would fuse
with nothing; the continuous engine passes F.linear (the bias inside the GEMM, as the HF layers add it). Measured on
the H200 (benchmarks/RESULTS.md): in fp32 the SDPA call of a one-token step is the memory-efficient kernel at ~60 us,
most of a reference-target decoding step.

`lean_target(target, S)` returns (None, why) for any other layer structure or a length-dependent rotary (dynamic,
longrope) and the caller keeps the HF layers; the fast decoder also checks the result against Target.capture.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hstap.models.rotary import RotaryTables, rotate

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
"""Default largest weight a few-row product is written as a reduction for (`linear`'s fuse_bytes): it is read once per
row, so it must sit in L2 (50 MB on an H200) for that to cost no more than one GEMM's read; the 8B shape's matrices do
not. benchmarks/bench_rows.py (RESULTS.md, "Few-row products and top-k") finds the reduction slower than cuBLAS from ~3
MB up at 2-16 rows on the reference target's shapes (fused gate/up 3.1 MB, lm_head 12.6 MB); a lower cap has not been
measured end to end yet (bench_decode's `fusedR/MB+cdt` variants)."""


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


def stack_heads(mask: torch.Tensor, g: int) -> torch.Tensor:
    """A mask (..., T, S) repeated for the g query heads of a kv head, as `attend` stacks them: (..., g*T, S), row
    j*T + i = query i of the group's j-th head. Once per forward, not per layer."""
    *lead, T, S = mask.shape
    return mask.unsqueeze(-3).expand(*lead, g, T, S).reshape(*lead, g * T, S)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
           how: str = "sdpa", fuse_rows: int = 0) -> torch.Tensor:
    """Grouped-query attention of q (B, nh, T, hd) over keys/values (B, n_kv, S, hd), mask (..., g*T, S) additive or
    bool (`stack_heads`) -> (B, T, nh*hd), before o_proj. The queries of the g heads of a kv head are stacked along
    the query axis (query head i*g+j, kv head i -> rows j*T.. of group i): one call against the un-repeated cache.
    "sdpa": one fused kernel (in fp32 the memory-efficient kernel, which walks the S slots of a head serially: tens
    of us per call for one query); "math": softmax(q k^T s + m) v with the softmax in fp32, as HF's eager attention
    computes it, both products as broadcast sums when T <= fuse_rows (the compiler's reductions, parallel over the
    slots; see `linear`)."""
    B, nh, T, hd = q.shape
    nkv = keys.shape[1]
    qg = q.reshape(B, nkv, nh // nkv * T, hd)  # (B, n_kv, g*T, hd)
    if how == "sdpa":
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    else:
        o = _attend_math(qg, keys, values, mask, scale, T <= fuse_rows)
    return o.reshape(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)  # SDPA may return a strided layout


def _attend_math(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                 small: bool) -> torch.Tensor:
    """q (B, n_kv, R, hd) against keys/values (B, n_kv, S, hd) -> (B, n_kv, R, hd), the products as broadcast sums
    when small."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, torch.finfo(q.dtype).min)
    if small:
        s = (q.unsqueeze(-2) * keys.unsqueeze(-3)).sum(-1)  # (B, n_kv, R, S)
    else:
        s = torch.matmul(q, keys.transpose(-1, -2))
    p = torch.softmax((s * scale + mask).float(), dim=-1).to(values.dtype)  # (B, n_kv, R, S)
    if small:
        return (p.unsqueeze(-1) * values.unsqueeze(-3)).sum(-2)  # (B, n_kv, R, hd)
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
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            lin = getattr(a, name, None) or getattr(m, name)
            w = getattr(lin, "weight", None)
            # a Linear that computes from more than its `weight` (FP8Linear's block scales and activation
            # quantization, a packed INT4 module not unpacked): the lean product F.linear(x, weight) is not its function
            if type(lin) is not torch.nn.Linear or w is None or not w.dtype.is_floating_point or w.element_size() < 2:
                return f"layer {i}: {name} is {type(lin).__name__} with a {getattr(w, 'dtype', 'missing')} weight " \
                       "(quantized: the lean layers multiply by plain weights only)"
    return None  # a sliding window needs no check: the fast decoder's cache holds one only when it spans every slot


class StaticSlots:
    """A transformers StaticCache as LeanTarget's cache: a step's T keys and values at slots cumulative_length +
    arange(T) of every layer, then cumulative_length += T, as StaticLayer.update writes them; the arange is made once
    per step, not once per layer (a kernel per layer fewer where the step is not compiled)."""

    def __init__(self, cache, T: int, device):
        self.cache, self.ar = cache, torch.arange(T, device=device)  # (T,)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache.layers[layer]
        if not c.is_initialized:
            c.lazy_initialization(k, v)
        slots = c.cumulative_length + self.ar  # (T,)
        c.keys.index_copy_(2, slots, k)  # k (1, n_kv, T, hd)
        c.values.index_copy_(2, slots, v)
        c.cumulative_length.add_(k.shape[2])
        return c.keys, c.values  # (1, n_kv, S, hd)


class LeanTarget:
    """`states`: the decoder layers of `target` over a pluggable cache (the module docstring); `forward`: the fast
    decoder's step on top, with fast_steps.run_target's contract. Positions must be < max_len (the rotary tables;
    `resize` rebuilds them for a longer cache). attention, fuse_rows, fuse_bytes, product: the strategies of the
    module docstring (product None: `linear` with fuse_rows and fuse_bytes)."""

    def __init__(self, target, max_len: int, attention: str = "sdpa", fuse_rows: int = 0,
                 fuse_bytes: int = FUSE_MAX_BYTES, product=None):
        if attention not in ("sdpa", "math"):
            raise ValueError(f"attention: expected 'sdpa' or 'math', got {attention!r}")
        self.target, self.attention, self.fuse_rows = target, attention, fuse_rows
        self.product = product or functools.partial(linear, fuse_rows=fuse_rows, fuse_bytes=fuse_bytes)
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

    def resize(self, max_len: int) -> None:
        w = self.target.embed_tokens.weight
        self.rope = RotaryTables(self.target.base.rotary_emb, max_len, w.dtype, w.device)  # the model's own rotary

    def layer(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
              mask: torch.Tensor) -> torch.Tensor:
        """Decoder layer i: h (B, T, H) at rotary cos/sin (B, 1, T, hd), its keys and values through
        cache.update(k, v, i), attention under mask (..., g*T, S) (stack_heads) -> h (B, T, H)."""
        layer = self.target.layers[i]
        a, m, lin = layer.self_attn, layer.mlp, self.product
        B, T, _ = h.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q, k, v = lin(layer.input_layernorm(h), *self.qkv[i]).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(B, T, nh, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
        if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, heads, T, hd)
        keys, values = cache.update(k, v.transpose(1, 2), i)  # (B, n_kv, S, hd)
        o = attend(q, keys, values, mask, self.scale, self.attention, self.fuse_rows)  # (B, T, nh*hd)
        h = h + lin(o, a.o_proj.weight, a.o_proj.bias)  # (B, T, H)
        gate, up = lin(layer.post_attention_layernorm(h), *self.gu[i]).split(self.inter, dim=-1)  # (B, T, I) each
        return h + lin(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias)  # (B, T, H)

    def states(self, ids: torch.Tensor, pos: torch.Tensor, cache, mask: torch.Tensor,
               taps=()) -> tuple[torch.Tensor, list]:
        """ids at positions pos (B, T) through every layer, keys and values through `cache`, mask (..., T, S) bool or
        additive (which of the cache's S slots each token sees) -> the final-norm states (B, T, H) and the outputs
        of the layers `taps`, [(B, T, H)] in taps' order (None for an index no layer has)."""
        t = self.target
        cos, sin = self.rope.at(pos)  # (B, 1, T, hd) each
        mask = stack_heads(mask, self.nh // self.nkv)  # (..., g*T, S)
        want = {layer: j for j, layer in enumerate(taps)}
        tapped: list = [None] * len(taps)
        h = t.embed_tokens(ids)  # (B, T, H)
        for i in range(len(t.layers)):
            h = self.layer(i, h, cos, sin, cache, mask)  # (B, T, H)
            if i in want:
                tapped[want[i]] = h
        return t.norm(h), tapped

    def forward(self, cache, layers: list[int], ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                rows: torch.Tensor | None = None):
        """ids (1, T) at positions pos (1, T), additive mask (1, 1, T, S), written into the transformers StaticCache
        `cache` at its slots cumulative_length + arange(T) (static_kv.seek) -> logits (T or R, V) fp32 (only of
        `rows` (R,) if given), fc input (T, K, H): the outputs of `layers` (the final-norm state if none)."""
        t = self.target
        final, tapped = self.states(ids, pos, StaticSlots(cache, ids.shape[1], ids.device), mask, layers)  # (1, T, H)
        aux = torch.stack(tapped, dim=2) if layers else final.unsqueeze(2)  # (1, T, K, H)
        head_in = final[0] if rows is None else final[0].index_select(0, rows)  # (T or R, H)
        head = t.lm_head
        if isinstance(head, torch.nn.Linear):
            logits = self.product(head_in, head.weight, head.bias)  # (T or R, V)
        else:
            logits = t.logits(head_in)
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
