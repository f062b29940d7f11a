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

The layers are hstap/models/lean_target.py's `LeanTarget.states`, the one Llama-family forward that the fast decoder
runs too (fused q/k/v and gate/up GEMMs, the model's own rotary as tables, grouped-query attention as one SDPA call
against the un-repeated cache; HF's SDPA path with a mask repeats the whole cache g times per layer), here over a
`SlotCache`: it writes a step's keys and values at its rows' slots and hands the attention the rows' first `span`
slots. Products are F.linear (the bias inside the GEMM, as the HF layers add it). Single-device model code: no I/O,
no host reads of tensor values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstap.models.lean_target import LeanTarget, unsupported


class SlotCache:
    """SlotTarget's keys and values as one forward writes and reads them (LeanTarget's cache seam): update(k, v, layer)
    puts k, v (R, n_kv, T, hd) at flat slots `at` (R*n_kv*T,) of the (B, n_kv, S+1, hd) tensors and returns the
    first `span` slots of the step's rows (all B rows in order when rows is None)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, span: int, rows: torch.Tensor | None):
        self.k, self.v, self.at, self.span, self.rows = k, v, at, span, rows

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        hd = k.shape[-1]
        # Writes go through index_copy_ on flat views: an indexed assignment (cache[rows, :, pos] = k) costs a pass
        # over the whole cache per call (measured), index_copy_ touches only the written rows.
        self.k[layer].view(-1, hd).index_copy_(0, self.at, k.reshape(-1, hd))  # k (R, n_kv, T, hd) at its slots
        self.v[layer].view(-1, hd).index_copy_(0, self.at, v.reshape(-1, hd))
        keys, values = self.k[layer][:, :, :self.span], self.v[layer][:, :, :self.span]  # (B, n_kv, span, hd): views
        if self.rows is not None:
            keys, values = keys.index_select(0, self.rows), values.index_select(0, self.rows)  # (R, n_kv, span, hd)
        return keys, values


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
        w = target.embed_tokens.weight
        dev, dt = w.device, w.dtype
        self.lean = LeanTarget(target, max_len + 1, product=F.linear)  # scratch position S included
        self.target, self.B, self.S = target, rows, max_len
        self.nkv, hd = self.lean.nkv, self.lean.hd
        n = len(target.layers)
        self.k = torch.zeros(n, rows, self.nkv, max_len + 1, hd, dtype=dt, device=dev)  # (L, B, n_kv, S+1, hd)
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
        R, T = ids.shape
        S1 = self.S + 1
        ridx = (self.all_rows if rows is None else rows)[:, None]  # (R, 1)
        heads = torch.arange(self.nkv, device=ids.device)[None, :, None]  # (1, n_kv, 1)
        kv_at = ((ridx[:, :, None] * self.nkv + heads) * S1 + pos[:, None, :]).reshape(-1)  # (R*n_kv*T,): [r, h, t]
        col = torch.arange(span, device=ids.device)  # (span,)
        allowed = col[None, None, :] <= pos[:, :, None]  # (R, T, span): a row sees its own slots up to the token's
        cache = SlotCache(self.k, self.v, kv_at, span, rows)
        final, tapped = self.lean.states(ids, pos, cache, allowed[:, None], self.layers)  # (R, T, H)
        if self.states is not None:
            flat = self.states.view(-1, self.states.shape[-1])  # (B*S1*(K+1), H)
            st_at = (ridx * S1 + pos).reshape(-1) * (len(self.layers) + 1)  # (R*T,): slot (r, t), state 0
            for j, h in enumerate(tapped + [final]):  # aux..., final
                if h is not None:
                    flat.index_copy_(0, st_at + j, h.reshape(R * T, -1))
        return final

    def row_states(self, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of row `row`'s first n tokens: aux (n, K, H), final (n, H) (views on the device)."""
        st = self.states[row, :n]  # (n, K+1, H)
        return st[:, :-1], st[:, -1]
