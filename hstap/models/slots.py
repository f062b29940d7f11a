"""The target over per-row KV slots: B rows, each a sequence of its own length, advanced together in one forward per
step (continuous batching, as serving engines run a batch: a row that finishes is refilled while the others go on).

`SlotTarget` holds, per decoder layer, keys and values (B, n_kv, S+1, hd) preallocated once: row r's token at
position p is written at slot p of row r, so a row's cache grows in place (nothing is concatenated or copied per
step, unlike a HF DynamicCache, whose torch.cat copies the whole cache at every step) and a row can be restarted or
continued (the next turn of a conversation appended after its cached tokens) independently of the others. Slot S is
scratch: padding tokens and idle rows are written there at position S and their outputs are ignored.

`forward(ids, pos, rows, span)`: ids (R, T) at positions pos (R, T) of the cache rows `rows` (R,) (None: all B rows,
in order); token (r, t) attends to slots 0..pos[r, t] of its row. Attention runs over the first `span` slots only
(the caller's bound on the positions in the batch, rounded up, so a step's cost follows the longest live row, not S).
Grouped-query attention is one fused SDPA call with the queries of the g heads that share a kv head stacked along
the query axis against the un-repeated cache (HF's SDPA path with a mask repeats the whole cache g times per layer).

Same math as the HF layers (hstap/models/lean_target.py's Llama-family layers: fused q/k/v and gate/up GEMMs, the
model's own rotary as tables), batched; single-device model code: no I/O, no host reads of tensor values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstap.models.drafter import rotate
from hstap.models.lean_target import fuse_linears, unsupported


class SlotTarget:
    def __init__(self, target, rows: int, max_len: int, layers: list[int] | None = None):
        """`rows` sequences of at most `max_len` tokens each; with `layers`, also a per-row store of the states the
        target computed for every token it was fed (aux outputs of `layers` + final norm, (B, S+1, K+1, H)), for
        capture in the pass that generates."""
        why = unsupported(target)
        if why:
            raise ValueError(f"slot decoding: {why}")
        cfg = target.config
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if window and max_len > window:  # every slot is attended: right only when a row fits the window
            raise ValueError(f"slot decoding: a sliding window of {window} tokens is shorter than a row ({max_len})")
        a0 = target.layers[0].self_attn
        self.target, self.B, self.S = target, rows, max_len
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(a0, "head_dim", None) or cfg.hidden_size // self.nh
        self.scale = float(getattr(a0, "scaling", self.hd ** -0.5))
        self.inter = target.layers[0].mlp.gate_proj.weight.shape[0]
        w = target.embed_tokens.weight
        dev, dt = w.device, w.dtype
        with torch.no_grad():
            self.qkv = [fuse_linears([la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj])
                        for la in target.layers]
            self.gu = [fuse_linears([la.mlp.gate_proj, la.mlp.up_proj]) for la in target.layers]
            pos = torch.arange(max_len + 1, device=dev)[None]  # (1, S+1): scratch position S included
            cos, sin = target.base.rotary_emb(torch.zeros(1, 1, 1, dtype=dt, device=dev), pos)
        self.cos, self.sin = cos[0], sin[0]  # (S+1, hd): the model's own rotary (scaling included)
        n = len(target.layers)
        self.k = torch.zeros(n, rows, self.nkv, max_len + 1, self.hd, dtype=dt, device=dev)  # (L, B, n_kv, S+1, hd)
        self.v = torch.zeros_like(self.k)
        self.layers = list(layers or [])
        self.states = (torch.zeros(rows, max_len + 1, len(self.layers) + 1, cfg.hidden_size, dtype=dt, device=dev)
                       if layers else None)  # (B, S+1, K+1, H): aux..., final
        self.all_rows = torch.arange(rows, device=dev)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor | None, span: int) -> torch.Tensor:
        """ids, pos (R, T) long on the device; rows (R,) or None (R = B); span <= S+1 -> final-norm states (R, T, H).
        Writes the tokens' keys/values (and states) at their rows' slots pos."""
        t = self.target
        R, T = ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        g = nh // nkv
        S1 = self.S + 1
        ridx = (self.all_rows if rows is None else rows)[:, None]  # (R, 1)
        # Writes go through index_copy_ on flat views: an indexed assignment (cache[rows, :, pos] = k) costs a pass
        # over the whole cache per call (measured), index_copy_ touches only the written rows.
        heads = torch.arange(nkv, device=ids.device)[None, :, None]  # (1, n_kv, 1)
        kv_at = ((ridx[:, :, None] * nkv + heads) * S1 + pos[:, None, :]).reshape(-1)  # (R*n_kv*T,): [r, h, t]
        flat = self.states.view(-1, self.states.shape[-1]) if self.states is not None else None  # (B*S1*(K+1), H)
        st_at = (ridx * S1 + pos).reshape(-1) * (len(self.layers) + 1)  # (R*T,): slot (r, t), state 0
        cos = self.cos.index_select(0, pos.reshape(-1)).view(R, 1, T, hd)
        sin = self.sin.index_select(0, pos.reshape(-1)).view(R, 1, T, hd)
        col = torch.arange(span, device=ids.device)
        allowed = col[None, None, :] <= pos[:, :, None]  # (R, T, span): a row sees its own slots up to the token's
        mask = allowed[:, None, None].expand(R, 1, g, T, span).reshape(R, 1, g * T, span)  # rows j*T+i: head j
        want = {layer: j for j, layer in enumerate(self.layers)}
        h = t.embed_tokens(ids)  # (R, T, H)
        for i, layer in enumerate(t.layers):
            a, m = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)  # (R, T, H)
            w, bias = self.qkv[i]
            q, k, v = F.linear(x, w, bias).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k, v = q.view(R, T, nh, hd), k.view(R, T, nkv, hd), v.view(R, T, nkv, hd)
            if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (R, heads, T, hd)
            self.k[i].view(-1, hd).index_copy_(0, kv_at, k.reshape(-1, hd))  # k (R, n_kv, T, hd) at its slots
            self.v[i].view(-1, hd).index_copy_(0, kv_at, v.transpose(1, 2).reshape(-1, hd))
            keys, values = self.k[i][:, :, :span], self.v[i][:, :, :span]  # (B, n_kv, span, hd): views
            if rows is not None:
                keys, values = keys.index_select(0, rows), values.index_select(0, rows)  # (R, n_kv, span, hd)
            qg = q.reshape(R, nkv, g * T, hd)  # query head i*g+j (kv head i) -> rows j*T.. of group i
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
            o = o.reshape(R, nh, T, hd).transpose(1, 2).reshape(R, T, nh * hd)
            h = h + F.linear(o, a.o_proj.weight, a.o_proj.bias)  # (R, T, H)
            gate, up = F.linear(layer.post_attention_layernorm(h), *self.gu[i]).split(self.inter, dim=-1)
            h = h + F.linear(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias)  # (R, T, H)
            if i in want and flat is not None:
                flat.index_copy_(0, st_at + want[i], h.reshape(R * T, -1))
        final = t.norm(h)  # (R, T, H)
        if flat is not None:
            flat.index_copy_(0, st_at + len(self.layers), final.reshape(R * T, -1))
        return final

    def row_states(self, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of row `row`'s first n tokens: aux (n, K, H), final (n, H) (views on the device)."""
        st = self.states[row, :n]  # (n, K+1, H)
        return st[:, :-1], st[:, -1]
