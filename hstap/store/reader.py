"""The store's reader: `Store`, the samples of a store as a map-style Dataset read memory-mapped (plus `check`,
`verify` and `token_counts`), and `open_store`. The format is `hstap.store.format`'s, the manifest union the reader
sees `hstap.store.manifest`'s.

`Store.check` is what a stage runs before it reads or extends a store (train, capture's resume): every committed shard
present at the size its entry records, and each hashed once against its recorded checksum, so that a truncated or
corrupt shard stops the run with one line naming the file before anything is trained or reported as captured.
Hashing is a full read of the store: `file_checksum` runs its 16 MiB chunks on parallel threads, and ranks split the
shards between them (benchmarks/RESULTS.md has its cost next to training's)."""

from __future__ import annotations

import json
import math
import os
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from hstap.common import HstapError, one_line
from hstap.store.consumer import is_consumed, read_consumer
from hstap.store.checksum import file_checksum
from hstap.store.format import DTYPES, FORMAT, ST_NAMES, TORCH_DTYPES
from hstap.store.fp8 import dequantize_fp8
from hstap.store.manifest import load_manifest, load_parts, union_entries
from hstap.store.side import shard_shapes, side_of_sample

_MAX_OPEN_SHARDS = 256  # shards a Store keeps open (LRU, `Store._tensors`)

CHECK_CHECKSUMS = True
"""Whether `Store.check` hashes the shards (off: presence and sizes only). Only for measuring what the hashing costs:
benchmarks/bench_train.py --store-checks turns it off for its comparison pass."""


def check_shard(store: Path, entry: dict, checksum: bool | None = None) -> None:
    """One committed shard against its entry: the file present, at its recorded size, and (checksum; default
    `CHECK_CHECKSUMS`) with its recorded sha256; else HstapError naming the file."""
    checksum = CHECK_CHECKSUMS if checksum is None else checksum
    f = store / entry["file"]
    hint = f"the store is damaged (`hstap verify --store {store}` lists every problem)"
    try:
        size = f.stat().st_size
    except FileNotFoundError:
        raise HstapError(f"{f}: shard file is missing; {hint}") from None
    if size != entry.get("bytes"):
        raise HstapError(f"{f}: {size} bytes, its manifest entry records {entry.get('bytes')} (truncated or "
                         f"replaced); {hint}")
    try:
        same = not checksum or file_checksum(f) == entry["sha256"]
    except FileNotFoundError:
        raise HstapError(f"{f}: shard file is missing; {hint}") from None
    except OSError as e:  # shrank while read, unreadable: one line naming the shard
        raise HstapError(f"{f}: cannot be read whole ({type(e).__name__}: {e}); {hint}") from None
    if not same:
        raise HstapError(f"{f}: sha256 differs from the one recorded when it was committed (the file changed or is "
                         f"corrupt); {hint}")


class Store(torch.utils.data.Dataset):
    """A store opened for reading (`open_store`): a map-style Dataset of samples, read memory-mapped."""

    def __init__(self, path: Path, manifest: dict, entries: list[dict], problems: list[str]):
        self.path = path
        self.manifest = {k: v for k, v in manifest.items() if k != "shards"} | {"shards": entries}
        self.header = {k: v for k, v in manifest.items() if k != "shards"}
        self.dtype: str = manifest["dtype"]
        self.layers: list[int] = list(manifest["layers"])
        self.num_aux, self.hidden_size = len(self.layers), int(manifest["hidden_size"])
        self.ids: list[str] = [i for e in entries for i in e["ids"]]
        self.lengths: list[int] = [int(n) for e in entries for n in e["lengths"]]
        counts = [len(e["ids"]) for e in entries]
        self._shard = np.repeat(np.arange(len(entries), dtype=np.int64), counts)  # (N,) shard of each sample
        starts = [np.concatenate([[0], np.cumsum(e["lengths"][:-1], dtype=np.int64)]) for e in entries if e["ids"]]
        self._start = np.concatenate(starts).astype(np.int64) if starts else np.zeros(0, np.int64)  # (N,)
        self._index = {sid: i for i, sid in enumerate(self.ids)}
        self.side = int(manifest.get("version", 1)) >= 2
        """Whether the samples carry side branches (format version 2): `__getitem__` adds "side" (hstap.store.side)."""
        self._within = np.concatenate([np.arange(c, dtype=np.int64) for c in counts]) if counts else \
            np.zeros(0, np.int64)  # (N,) each sample's index in its shard
        self._problems = list(problems)
        if len(self._index) != len(self.ids):
            self._problems.append("duplicate sample ids within a shard entry")
        self._handles: OrderedDict[int, object] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.ids)

    def index_of(self, sample_id: str) -> int:
        try:
            return self._index[sample_id]
        except KeyError:
            raise HstapError(f"{self.path}: no sample with id {sample_id!r}") from None

    def _tensors(self, si: int) -> dict[str, torch.Tensor]:
        """Shard si's tensors, memory-mapped, opened lazily and kept (LRU-capped). get_tensor on a pt safe_open is a
        zero-copy view of the file mapping; slicing it with torch costs ~2 us, safetensors' get_slice ~80 us."""
        if os.getpid() != self._pid:  # mmap handles belong to the process that opened them: re-open after fork
            self._handles, self._pid = OrderedDict(), os.getpid()
        sl = self._handles.get(si)
        if sl is None:
            sl = self._handles[si] = self.read_shard(self.manifest["shards"][si])
            if len(self._handles) > _MAX_OPEN_SHARDS:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(si)
        return sl

    def read_shard(self, e: dict) -> dict[str, torch.Tensor]:
        """The tensors of the shard of entry `e`, memory-mapped, each of the shape its entry and the header say. A
        shard that is missing or truncated, that safetensors cannot open (a damaged header: safetensors' own error is
        no OSError) or whose tensors have other shapes is one line naming the file, said after its checksum is
        compared (a file changed since its commit is named as such), never a traceback."""
        check_shard(self.path, e, checksum=False)  # missing or truncated: one line, not safetensors' error
        f = self.path / e["file"]
        T, K, H = int(e["tokens"]), self.num_aux, self.hidden_size
        want = {"input_ids": [T], "loss_mask": [T], "aux": [T, K, H], "final": [T, H]}
        if self.side:
            want |= {n: shape for n, (_, shape) in self._side_shapes(e).items()}
        try:
            h = safe_open(str(f), framework="pt")
            sl = {name: h.get_tensor(name) for name in h.keys()}
            bad = [n for n, shape in want.items() if n not in sl or list(sl[n].shape) != shape]
            why = f"tensor {bad[0]} is not of shape {want[bad[0]]}" if bad else None
        except Exception as err:  # noqa: BLE001 - whatever safetensors raises on a damaged file
            sl, why = {}, one_line(err)
        if why is not None:
            check_shard(self.path, e, checksum=True)  # a changed file: said by its checksum
            raise HstapError(f"{f}: not a readable shard ({why}); the store is damaged (`hstap verify --store "
                             f"{self.path}` lists every problem)")
        return sl

    def _side_shapes(self, e: dict) -> dict:
        """The side tensors shard entry `e` holds (format version 2): name -> (dtype, shape)."""
        S = sum(int(n) for n in e.get("side_rows", ()))
        return shard_shapes(S, len(e["ids"]), self.num_aux, self.hidden_size, ST_NAMES[TORCH_DTYPES[self.dtype]],
                            self.dtype == "fp8")

    def __getitem__(self, i: int) -> dict:
        n = len(self.ids)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a store of {n}")
        i %= n
        si, a = int(self._shard[i]), int(self._start[i])
        b = a + self.lengths[i]
        sl = self._tensors(si)
        aux, final = sl["aux"][a:b], sl["final"][a:b]  # (T, K, H), (T, H): views of the mmap, no copy
        if self.dtype == "fp8":
            aux = dequantize_fp8(aux, sl["aux_scale"][a:b])  # (T, K, H) float32
            final = dequantize_fp8(final, sl["final_scale"][a:b])  # (T, H) float32
        out = {"id": self.ids[i], "input_ids": sl["input_ids"][a:b].long(),  # (T,)
               "loss_mask": sl["loss_mask"][a:b].long(), "aux": aux, "final": final}
        if self.side:
            out["side"] = side_of_sample(sl, int(self._within[i]), dequantize_fp8 if self.dtype == "fp8" else None)
        return out

    def __getstate__(self) -> dict:  # DataLoader spawn workers pickle the Dataset object itself (no file is unpickled)
        return {k: v for k, v in self.__dict__.items() if k != "_handles"} | {"_handles": OrderedDict()}

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """(V,) int64 counts of loss-masked tokens over every shard (reads only input_ids and loss_mask, never the
        hidden states)."""
        V = vocab_size
        freq = np.zeros(V, dtype=np.int64)  # (V,)
        for e in self.manifest["shards"]:
            sl = self.read_shard(e)  # a damaged file: one line naming it
            ids, lm = sl["input_ids"].long(), sl["loss_mask"].bool()  # (T,), (T,)
            del sl
            if ids.numel() and int(ids.max()) >= V:
                raise HstapError(f"{self.path / e['file']}: token id {int(ids.max())} >= the target's vocab size {V}")
            freq += np.bincount(ids[lm].numpy(), minlength=V)
        return freq

    def check(self, rank: int = 0, world: int = 1, checksums: bool | None = None) -> dict:
        """Every committed shard present at its recorded size (all of them, on every rank: a stat each) and, with
        checksums (default `CHECK_CHECKSUMS`), shards rank::world hashed against their recorded sha256; HstapError
        naming the first bad file. Returns {"shards", "gb" (this rank hashed), "seconds", "checksums"}."""
        checksums = CHECK_CHECKSUMS if checksums is None else checksums
        entries = self.manifest["shards"]

        def one(e: dict, checksum: bool) -> int:
            try:
                check_shard(self.path, e, checksum)
            except HstapError:
                if is_consumed(e, read_consumer(self.path, self.manifest)):
                    return 0  # a following trainer consumed it (and deleted its file) since the store was opened
                raise
            return int(e["bytes"]) if checksum else 0

        for e in entries:
            one(e, False)
        t0 = time.perf_counter()
        nbytes = sum(one(e, True) for e in entries[rank::world]) if checksums else 0
        return {"shards": len(entries), "gb": nbytes / 1e9, "seconds": time.perf_counter() - t0,
                "checksums": checksums}

    def verify(self, chunk_bytes: int = 1 << 28) -> list[str]:
        """Check everything; returns the problems found (empty = OK). Reads every shard once (sha256) plus a scan."""
        problems = list(self._problems)
        for e in self.manifest["shards"]:
            f = self.path / e["file"]
            if not f.is_file():
                problems.append(f"{e['file']}: shard file is missing")
                continue
            if f.stat().st_size != e.get("bytes"):
                problems.append(f"{e['file']}: size {f.stat().st_size} != {e.get('bytes')} in the manifest")
            if file_checksum(f) != e["sha256"]:
                problems.append(f"{e['file']}: sha256 mismatch (file changed or corrupt)")
            try:
                problems += [f"{e['file']}: {p}" for p in self._check_shard(f, e, chunk_bytes)]
            except Exception as err:  # noqa: BLE001 -- a corrupt file can fail anywhere; report, do not crash
                problems.append(f"{e['file']}: unreadable: {type(err).__name__}: {err}")
        return problems

    def _check_shard(self, f: Path, e: dict, chunk_bytes: int) -> list[str]:
        out: list[str] = []
        K, H, lengths = self.num_aux, self.hidden_size, [int(n) for n in e["lengths"]]
        T, N = sum(lengths), len(e["ids"])
        if len(lengths) != N or any(n < 1 for n in lengths):
            out.append("lengths do not match ids or a sample has no tokens")
        if int(e.get("tokens", -1)) != T:
            out.append(f"tokens {e.get('tokens')} != sum(lengths) {T}")
        dt = ST_NAMES[TORCH_DTYPES[self.dtype]]
        want = {"offsets": ("I64", [N + 1]), "input_ids": ("I32", [T]), "loss_mask": ("U8", [T]),
                "aux": (dt, [T, K, H]), "final": (dt, [T, H])}
        if self.dtype == "fp8":
            want |= {"aux_scale": ("F32", [T, K]), "final_scale": ("F32", [T])}
        if self.side:
            if len(e.get("side_rows", ())) != N:
                return out + ["side_rows do not match ids"]
            want |= self._side_shapes(e)
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata() or {}
            if meta.get("format") != FORMAT or json.loads(meta.get("ids", "null")) != e["ids"]:
                out.append("__metadata__ format/ids differ from the manifest entry")
            if set(h.keys()) != set(want):
                return out + [f"tensors {sorted(h.keys())} != {sorted(want)}"]
            for name, (d, shape) in want.items():
                s = h.get_slice(name)
                if s.get_dtype() != d or list(s.get_shape()) != shape:
                    out.append(f"{name}: {s.get_dtype()} {s.get_shape()} != {d} {shape}")
            if out:
                return out
            offsets = h.get_tensor("offsets")  # (N+1,)
            if offsets.tolist() != [0] + np.cumsum(lengths).tolist():
                out.append("offsets do not match the manifest's lengths")
            if self.side and h.get_tensor("side_offsets").tolist() != [0] + np.cumsum(e["side_rows"]).tolist():
                out.append("side_offsets do not match the manifest's side_rows")
            if bool(((h.get_tensor("loss_mask") > 1)).any()):
                out.append("loss_mask has values other than 0/1")
            for name in [n for n in ("aux", "final", "aux_scale", "final_scale", "side_aux", "side_final",
                                     "side_aux_scale", "side_final_scale") if n in want]:
                s = h.get_slice(name)
                row = max(1, math.prod(want[name][1][1:]) * 4)
                step = max(1, chunk_bytes // row)
                rows = want[name][1][0]
                for a in range(0, rows, step):
                    x = s[a:min(rows, a + step)].float()  # bounded chunk: a shard can be far larger than memory
                    if not bool(torch.isfinite(x).all()):
                        out.append(f"{name}: non-finite values (NaN/Inf) in tokens {a}..{min(rows, a + step)}")
                        break
                    if name.endswith("_scale") and not bool((x > 0).all()):
                        out.append(f"{name}: non-positive scales")
                        break
        return out


def open_store(path: str | os.PathLike) -> Store:
    """Open a store for reading: manifest.json ∪ part files, less the consumed shards (see `hstap.store.format`).
    HstapError if not a store."""
    path = Path(path)
    m = load_manifest(path)
    for k in ("dtype", "layers", "hidden_size"):
        if k not in m:
            raise HstapError(f"{path / 'manifest.json'}:1: {k}: missing")
    if m["dtype"] not in DTYPES:
        raise HstapError(f"{path / 'manifest.json'}:1: dtype: {m['dtype']!r} is not one of {', '.join(DTYPES)}")
    entries, problems, _ = union_entries(m, load_parts(path))
    rec = read_consumer(path, m)
    return Store(path, m, [e for e in entries if not is_consumed(e, rec)], problems)
