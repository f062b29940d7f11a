"""The draft vocabulary map: which target token ids the drafter predicts, and how its logits map back. Its one home:
the rule that builds it, the check, the file (PREPARED/ and a store's copy), its identity and `VocabMap`, the map a
training run resolved.

`hstap prepare` picks the N = min(--draft-vocab, V) most frequent loss-masked tokens of the prepared set
(`build_vocab_map`) and writes them to PREPARED/vocab_map.safetensors (`write_vocab_map`, as the serve loop writes its
trainer's map); training reads it back (`load_vocab_map`) and export checks the map a drafter carries
(`check_vocab_map`). Two tensors, as EAGLE-3 drafters store them:

    d2t int64 [N]  draft index k -> target id k + d2t[k] (the hot ids, strictly increasing)
    t2d bool  [V]  target id -> whether it is a hot id

`check_vocab_map` is the one validity rule (hot ids strictly increasing inside [0, V), t2d true exactly there).

Capture copies the prepared set's file into the store and records it in the store header (`vocab_map_record`:
{"file", "sha256", "size"}); `load_store_vocab_map` is how training finds it there. A drafter carries the map it was
trained with as buffers, and its drafter.json records the map's identity (`vocab_map_sha256`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hstap.common import HstapError, atomic_write_bytes, one_line, sha256_bytes

if TYPE_CHECKING:
    import torch

VOCAB_MAP_FILE = "vocab_map.safetensors"


@dataclass(frozen=True, eq=False)
class VocabMap:
    """A draft vocabulary map, as EAGLE-3 drafters store it, and where it came from (what a training run resolved,
    `hstap.train.plan.TrainPlan.vocab`)."""

    d2t: torch.Tensor
    """(Vd,) long: draft id -> the offset of its target id (target id = draft id + d2t[draft id])."""
    t2d: torch.Tensor
    """(V,) bool: target id is in the draft vocabulary."""
    source: str
    """Where it came from (a file, the prepared set's map copied by capture, the top N of the store's token counts)."""

    @property
    def size(self) -> int:
        """Vd, the draft vocabulary's size."""
        return int(self.d2t.numel())

    def sha256(self) -> str:
        """Its identity (`vocab_map_sha256`)."""
        return vocab_map_sha256(self.d2t, self.t2d)


def vocab_map_sha256(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    """Identity of a draft vocabulary map: sha256 over d2t as little-endian int64 and t2d as uint8 bytes."""
    import torch

    h = hashlib.sha256()
    h.update(d2t.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes())
    h.update(b"|")
    h.update(t2d.detach().to("cpu", torch.bool).contiguous().numpy().astype("u1").tobytes())
    return h.hexdigest()


def build_vocab_map(freq: np.ndarray, draft_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [N], t2d bool [V]): the N = min(draft_vocab, V) most frequent ids; ties and the fill (ids never
    seen, when fewer than N were) go to the lower id."""
    V = len(freq)
    n = min(draft_vocab, V)
    order = np.argsort(-freq, kind="stable")  # (V,) by count, then id: zero counts come last, lowest id first
    hot = np.sort(order[:n])  # (N,)
    t2d = np.zeros(V, dtype=bool)  # (V,)
    t2d[hot] = True
    return (hot - np.arange(n)).astype(np.int64), t2d


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def check_vocab_map(d2t, t2d, vocab_size: int) -> None:
    """HstapError unless hot ids = arange(N) + d2t are strictly increasing inside [0, vocab_size) and t2d (length
    vocab_size) is true exactly there. Takes torch tensors or numpy arrays."""
    d, t = _numpy(d2t), _numpy(t2d)
    if d.ndim != 1 or len(d) == 0 or d.dtype.kind not in "iu":
        raise HstapError(f"vocab map: d2t must be a non-empty 1-D integer array, got {d.dtype} {d.shape}")
    if t.ndim != 1 or t.dtype != np.bool_ or len(t) != vocab_size:
        raise HstapError(f"vocab map: t2d must be a bool array of length {vocab_size}, got {t.dtype} {t.shape}")
    hot = np.arange(len(d)) + d.astype(np.int64)
    if len(d) > vocab_size or hot[0] < 0 or hot[-1] >= vocab_size:
        raise HstapError(f"vocab map: hot ids (arange + d2t) leave the vocabulary [0, {vocab_size})")
    if len(hot) > 1 and not np.all(np.diff(hot) > 0):
        raise HstapError("vocab map: hot ids (arange + d2t) are not strictly increasing")
    if int(t.sum()) != len(hot) or not t[hot].all():
        raise HstapError("vocab map: t2d is not true exactly at the hot ids (arange + d2t)")


def write_vocab_map(path: str | os.PathLike, d2t, t2d) -> None:
    """The map (d2t [N] and t2d [V], numpy arrays or tensors) as the vocab_map.safetensors file `path`, written
    atomically (temp file, fsync, rename): d2t int64, t2d bool."""
    from safetensors.numpy import save

    atomic_write_bytes(path, save({"d2t": np.ascontiguousarray(_numpy(d2t), dtype=np.int64),
                                   "t2d": np.ascontiguousarray(_numpy(t2d), dtype=np.bool_)}))


def load_vocab_map(path: str | os.PathLike):
    """(d2t LongTensor [N], t2d BoolTensor [V]) from PREPARED/ or a vocab_map.safetensors file, checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        p = p / "vocab_map.safetensors"
    if not p.is_file():
        raise HstapError(f"{p}: vocab map not found")
    try:
        t = load_file(str(p))
    except (SafetensorError, OSError) as e:
        raise HstapError(f"{p}: cannot read: {one_line(e)}") from None
    if set(t) != {"d2t", "t2d"}:
        raise HstapError(f"{p}: expected tensors d2t and t2d, found {sorted(t)}")
    try:
        check_vocab_map(t["d2t"], t["t2d"], t["t2d"].shape[0] if t["t2d"].dim() == 1 else -1)
    except HstapError as e:
        raise HstapError(f"{p}: {e}") from None
    return t["d2t"], t["t2d"]


def vocab_map_record(prepared: str | os.PathLike) -> dict | None:
    """{"file": "vocab_map.safetensors", "sha256": of its bytes, "size": draft ids N} of PREPARED's map, None without
    one."""
    p = Path(prepared) / VOCAB_MAP_FILE
    if not str(prepared) or not p.is_file():
        return None
    d2t, _ = load_vocab_map(p)
    return {"file": VOCAB_MAP_FILE, "sha256": sha256_bytes(p.read_bytes()), "size": int(d2t.numel())}


def load_store_vocab_map(store_dir: str | os.PathLike, header: dict):
    """(d2t, t2d, path) of the map a store's header records (`vocab_map`), checked against its sha256; None when the
    header records none (a store captured before vocab maps were copied, or from data without one)."""
    rec = header.get("vocab_map")
    if not rec:
        return None
    p = Path(store_dir) / rec.get("file", VOCAB_MAP_FILE)
    if not p.is_file():
        raise HstapError(f"{p}: the store header records a draft vocabulary map but the file is missing (re-run the "
                         "capture to restore it, or pass --vocab-map)")
    if sha256_bytes(p.read_bytes()) != rec.get("sha256"):
        raise HstapError(f"{p}: sha256 differs from the one in {Path(store_dir) / 'manifest.json'} (the file was "
                         "changed after capture); pass --vocab-map to choose a map")
    d2t, t2d = load_vocab_map(p)
    return d2t, t2d, p
