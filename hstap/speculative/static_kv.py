"""Preallocated KV caches for the fast decoder (hstap.speculative.fast), their attention masks and the in-place compaction
of an accepted tree path. Fixed shapes only: nothing here allocates storage that outlives a call, reads a tensor value
on the host, or branches on one, so every function can run inside a captured CUDA graph.

Target: transformers' own `StaticCache` (one `StaticLayer` per decoder layer: keys/values (1, h, S, d) allocated on
the first write and then written in place with `index_copy_` at `cumulative_length + arange(T)`). `seek` sets every
layer's `cumulative_length` (a device tensor) to the step's first slot before each forward, so a step of T tokens
writes exactly slots [start, start+T); attention always runs over all S slots through an explicit 4-D additive mask
(1, 1, T, S), which transformers passes to the kernel as is. Slots past the committed length hold stale entries of
rejected drafts; the mask hides them (always finite values, so a masked score is exactly zero after the softmax).

Drafter: `DrafterStaticCache`, duck-typed like `hstap.models.drafter.DrafterCache` (what `Attention.attend` uses: `len`,
`append(k, v) -> (all keys, all values)`), preallocated (1, n_kv, S, hd) and written in place at the slots set with
`at(slots)`; the drafter is always called with an explicit mask, so the slots it may see are the mask's business.

Compaction: after a tree verify the accepted path's target entries are gathered into place (`keep_path`); the
drafter needs none: its draft-step entries were made from its own h_out, and the next round's extend rewrites the
accepted positions from the target's states (speculative/drivers.py's invariant, kept here).
"""

from __future__ import annotations

import torch


class StaticUnsupported(Exception):
    """This target's cache layout cannot be held in a full-attention static cache (the caller falls back)."""


def target_cache(target, max_len: int):
    """A transformers StaticCache of `max_len` slots for `target`, every layer a plain full-attention StaticLayer.

    Sliding-window layers are replaced by full ones when the whole sequence fits the window (the same attention);
    otherwise, and for any other layer kind (linear attention, indexed sparse attention), StaticUnsupported."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cfg = target.config.get_text_config(decoder=True) if hasattr(target.config, "get_text_config") else target.config
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    window = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer and window and max_len <= window:
            cache.layers[i] = StaticLayer(max_cache_len=max_len)
        elif type(layer) is not StaticLayer:
            raise StaticUnsupported(f"layer {i} is a {type(layer).__name__}"
                                    + (f" (sliding window {window} < {max_len} slots)" if window else ""))
    return cache


def seek(cache, start) -> None:
    """Make the next forward write at slot `start` (a 0-d long tensor on the cache's device, or an int)."""
    for layer in cache.layers:
        if isinstance(start, torch.Tensor):
            layer.cumulative_length.copy_(start)
        else:
            layer.cumulative_length.fill_(start)


def keep_path(cache, start: torch.Tensor, path: torch.Tensor) -> None:
    """Gather the entries of tree nodes `path` (P,) (node i sits at slot start+i) into slots start..start+P-1.

    index_select copies first, so the overlapping write is safe. Entries past the accepted length are garbage that
    the next round overwrites."""
    src = start + path  # (P,)
    dst = start + torch.arange(path.shape[0], device=path.device)  # (P,)
    for layer in cache.layers:
        layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))  # (1, h, P, d)
        layer.values.index_copy_(2, dst, layer.values.index_select(2, src))


class DrafterStaticCache:
    """The drafter's keys/values, (1, n_kv, S, hd) each, written in place at the slots given by `at` before a call."""

    def __init__(self, n_kv: int, head_dim: int, max_len: int, dtype: torch.dtype, device):
        self.k = torch.zeros(1, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.slots: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.k.shape[2]  # every slot is attended (through the caller's mask)

    def at(self, slots: torch.Tensor) -> DrafterStaticCache:
        """Make the next append write its T keys at `slots` (T,) (long, on the cache's device)."""
        self.slots = slots
        return self

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, self.slots, k.to(self.k.dtype))  # k (1, n_kv, T, hd)
        self.v.index_copy_(2, self.slots, v.to(self.v.dtype))
        return self.k, self.v


# --- masks (True = may attend) ---------------------------------------------------------------------------------------
def block_mask(col: torch.Tensor, start: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """Rows that see every slot before `start` plus, of the F slots start..start+F-1, those marked in anc (T, F).

    col (S,) is arange(S); returns (T, S) bool."""
    F = anc.shape[1]
    rel = col - start  # (S,)
    inside = (rel >= 0) & (rel < F)  # (S,)
    mine = anc.index_select(1, rel.clamp(0, F - 1)) & inside[None]  # (T, S)
    return mine | (rel < 0)[None]


def causal_rows(col: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Row j sees slots 0..pos[j]: (T, S) bool for queries written at slots pos (T,)."""
    return col[None, :] <= pos[:, None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, S) bool -> (1, 1, T, S) additive float mask (a float mask is right for both the sdpa and eager kernels)."""
    m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return m[None, None]
