"""Side branches of a store's samples (format version 2, `hstap.store.format` is the spec): the rows a serving engine
computed for drafts its target rejected, kept next to the accepted sequence. What the writer checks and lays out, what
the reader slices and verifies.

A sample's side rows are flat: row r was fed token `input_ids[r]` at position `pos[r]` of the sample; its context is
the sample's tokens 0..parent and then, when `parent[r] < 0`, the chain of side rows -1-parent[r], ... back to a row
whose parent is a position of the sample (>= 0, always pos[r]-1 for that first row). `step` is the request's target
forward that verified the draft and `accepted` how many drafts that step accepted. `aux` and `final` are the target's
states at the row, as the sample's own.
"""

from __future__ import annotations

import torch

from hstap.common import HstapError

SIDE_VERSION = 2
"""The store version that carries side branches; a store without them is written as version 1."""

INT_NAMES = ("input_ids", "pos", "parent", "step", "accepted")
"""The per-row integer columns (I32 in a shard, `side_<name>`)."""


def store_version(header: dict) -> int:
    """The version a store with this header is written as: 2 with side branches, else 1 (readable by older hstap)."""
    return SIDE_VERSION if header.get("side_branches") else 1


def empty_side(K: int, H: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """No side rows, for a sample of a store that carries them."""
    out = {n: torch.zeros(0, dtype=torch.int32) for n in INT_NAMES}
    return out | {"aux": torch.zeros(0, K, H, dtype=dtype), "final": torch.zeros(0, H, dtype=dtype)}


def check_side(where: str, side: dict, T: int, K: int, H: int) -> dict[str, torch.Tensor]:
    """A sample's side rows as given to `StoreWriter.add` -> the int32 columns (S,) (aux/final left to the writer's
    dtype conversion), or HstapError naming the field. T: the sample's tokens."""
    for name in (*INT_NAMES, "aux", "final"):
        if not isinstance(side.get(name), torch.Tensor) or side[name].device.type != "cpu":
            raise HstapError(f"{where}: side.{name}: expected a CPU tensor")
    S = int(side["input_ids"].shape[0]) if side["input_ids"].dim() == 1 else -1
    if S < 0:
        raise HstapError(f"{where}: side.input_ids: expected shape (S,), got {tuple(side['input_ids'].shape)}")
    for name, shape in [(n, (S,)) for n in INT_NAMES] + [("aux", (S, K, H)), ("final", (S, H))]:
        if tuple(side[name].shape) != shape:
            raise HstapError(f"{where}: side.{name}: expected shape {shape}, got {tuple(side[name].shape)}")
    cols = {n: side[n].to(torch.int32).contiguous() for n in INT_NAMES}  # (S,) each
    pos, parent = cols["pos"].long(), cols["parent"].long()
    r = torch.arange(S)
    first = parent >= 0
    bad = (pos < 1) | (pos >= T) | (first & (parent != pos - 1)) | (~first & (-1 - parent >= r))
    prev = (-1 - parent).clamp(0, max(S - 1, 0))
    if S:
        bad |= ~first & (pos != pos[prev] + 1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise HstapError(f"{where}: side row {i}: pos {int(pos[i])}, parent {int(parent[i])}: a row's parent is the "
                         f"sample's position pos-1 (< T={T}) or an earlier side row at pos-1")
    return cols


def side_of_sample(sl: dict[str, torch.Tensor], j: int, dequant) -> dict[str, torch.Tensor]:
    """Sample j's side rows out of a shard's (memory-mapped) tensors; `dequant(x, scale)` for fp8 stores, else None."""
    o = sl["side_offsets"]
    a, b = int(o[j]), int(o[j + 1])
    out = {n: sl[f"side_{n}"][a:b].long() for n in INT_NAMES}  # (S,) each
    aux, final = sl["side_aux"][a:b], sl["side_final"][a:b]  # (S, K, H), (S, H)
    if dequant is not None:
        aux, final = dequant(aux, sl["side_aux_scale"][a:b]), dequant(final, sl["side_final_scale"][a:b])
    return out | {"aux": aux, "final": final}


def shard_shapes(S: int, N: int, K: int, H: int, dt: str, fp8: bool) -> dict[str, tuple[str, list[int]]]:
    """The side tensors of a shard with N samples and S side rows: name -> (safetensors dtype, shape)."""
    want = {"side_offsets": ("I64", [N + 1])} | {f"side_{n}": ("I32", [S]) for n in INT_NAMES}
    if fp8:
        want |= {"side_aux_scale": ("F32", [S, K]), "side_final_scale": ("F32", [S])}
    return want | {"side_aux": (dt, [S, K, H]), "side_final": (dt, [S, H])}
