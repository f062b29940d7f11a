"""The hidden-state store: on-disk format (this docstring is the spec), writer, memory-mapped reader.

Format `hstap-store`, version 1
===============================

Layout: a store is a directory::

    STORE/manifest.json                                  header + merged list of committed shards
    STORE/parts/rank{rank:03d}.json                      per-rank list of committed shards (the commit record)
    STORE/shards/r{rank:03d}-{seq:06d}.safetensors       one shard: many samples concatenated along tokens
    STORE/shards/.r{rank:03d}-{seq:06d}.safetensors.tmp  a shard being written (never read; deleted on resume)

Other files in STORE (e.g. the capture run's `config.json`) are ignored. Sample ids are strings, unique in a store.

Shard tensors: a valid safetensors file; T = tokens in the shard, N = samples, K = len(layers), H = hidden_size.
Samples are concatenated along T with no padding; sample j is rows `offsets[j]:offsets[j+1]` of every per-token tensor.

| name | dtype | shape | meaning |
|---|---|---|---|
| `offsets` | I64 | [N+1] | `offsets[0] = 0`, `offsets[N] = T`, strictly increasing (a sample has >= 1 token) |
| `input_ids` | I32 | [T] | token ids |
| `aux_scale` | F32 | [T, K] | fp8 stores only: per token per layer dequantization scale |
| `final_scale` | F32 | [T] | fp8 stores only |
| `aux` | BF16 / F32 / F8_E4M3 | [T, K, H] | outputs of decoder layers `layers` (canonical ids, hstap.layers) |
| `final` | BF16 / F32 / F8_E4M3 | [T, H] | output of the final norm (what lm_head consumes) |
| `loss_mask` | U8 | [T] | 1 = token is trained on (assistant), 0 = not |

Tensors are stored in that order (descending alignment: every tensor starts at an offset aligned to its element size);
the JSON header is padded with spaces to a multiple of 8 bytes, as safetensors does. `__metadata__` (string values)
holds `format` ("hstap-store"), `version` ("1"), `ids` (JSON list of the N sample ids, in order), `dtype`, `layers`
(JSON list) and `rank`.

Dtypes (`dtype`): `bf16` (default), `fp32` (exact; CPU tests), `fp8` = float8_e4m3fn with one float32 scale per token
per layer: `scale = amax(|x|, last dim) / 448` (1.0 for an all-zero row), `q = x / scale`, `x ~= q * scale`
(`quantize_fp8`, `dequantize_fp8`). Bytes per token (`store_bytes_per_token`): bf16 `(K+1)*H*2 + 5`,
fp32 `(K+1)*H*4 + 5`, fp8 `(K+1)*(H+4) + 5`; plus per shard 8 + the JSON header + 8*(N+1) bytes of offsets.
Nothing is ever padded.

`manifest.json` (a JSON object)::

    format        "hstap-store"
    version       1 (readers refuse a higher version)
    target        {path, model_type, num_layers, hidden_size, config_sha256, weights_fingerprint, tokenizer_sha256,
                   chat_template_sha256}
    engine        {name, version, device, compute_dtype}
    dtype         "bf16" | "fp8" | "fp32"
    layers        canonical layer ids of `aux` (K = len(layers))
    hidden_size   H
    capture_config, git_commit, ...   any other keys of the writer's header, stored as given
    created       ISO-8601 UTC creation time; created_unix: the same in seconds since the epoch
    checksum      "sha256-chunked-16MiB": how the shard entries' `sha256` field is computed (see below)
    shards        list of shard entries, ordered by (rank, seq)

A shard entry (same in manifest and part files): `file` (path relative to STORE, "shards/r000-000007.safetensors"),
`rank`, `seq`, `sha256` (the file's checksum: sha256 over the concatenated sha256 digests of its consecutive 16 MiB
chunks, `store.file_checksum`; manifest key `checksum` names the scheme), `bytes` (file size), `tokens` (T), `ids` (sample ids, file order),
`lengths` (tokens per sample, file order). A part file is {"format": "hstap-store-part", "version": 1, "rank": r,
"closed": bool, "shards": [entries of rank r]}. Writers put one top-level key and one shard entry per line (readers
must not rely on it).

Commit protocol (one writer per rank; ranks never touch each other's files):
 1. The shard is written to `shards/.rRRR-SSSSSS.safetensors.tmp` (16 MiB chunks written and hashed in parallel), fsynced, renamed
    to `shards/rRRR-SSSSSS.safetensors`, and the directory fsynced.
 2. The rank's part file, holding all of the rank's entries, is atomically replaced (temp + fsync + rename).
    **This is the commit point**: a shard is committed iff an entry in a part file or in manifest.json names it.
 3. `merge_manifest` (rank 0 at `close()`, or by hand) folds all part files into manifest.json, atomically and
    idempotently. Part files are kept; they stay consistent with the manifest.

Creation: rank 0 creates STORE, `shards/`, `parts/` and writes manifest.json with the header and `shards: []`.
Ranks > 0 never create or wipe anything; they wait for manifest.json (or a `barrier` callable given by the caller).

Resume rules (a StoreWriter on an existing store):
 - The header must match in target.{config_sha256, weights_fingerprint, tokenizer_sha256, chat_template_sha256},
   layers, dtype and hidden_size, else HstapError naming the field; `new=True` removes manifest.json, parts/ and
   shards/ first. Other keys (engine, capture_config, paths) may differ; the store keeps those it was created with.
 - Committed ids = the ids of all entries of manifest.json and of every part file. The caller skips them
   (`committed_ids()`); adding one raises.
 - At open, rank r deletes its own temp files and its own shard files that no entry names (a kill between rename
   and part-file write); its sequence numbers continue after its highest committed seq.

Reader guarantees (`open_store`): the store is the union of manifest.json's and the part files' entries, so the
shards of a killed run are visible before any merge. Sample order is shard order (rank, seq), then file order. If two
entries claim one sample id (the protocol never does that), the later entry is ignored and reported by
`merge_manifest` and `Store.verify()`. Shards are read memory-mapped through the safetensors library. ENOSPC or any
other OSError while writing a shard removes the temp file and leaves every committed shard intact.
"""

from __future__ import annotations

import bisect
import datetime
import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from hstap.common import HstapError, atomic_write_bytes, fsync_dir
# Re-exported: the batch sampler and collate live in hstap.batching; callers import them from hstap.store too.
from hstap.batching import BucketBatchSampler, collate  # noqa: F401

FORMAT = "hstap-store"
PART_FORMAT = "hstap-store-part"
VERSION = 1
DTYPES = ("bf16", "fp8", "fp32")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
_ST_NAMES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16",
             torch.float8_e4m3fn: "F8_E4M3"}
# Header fields that decide whether stored hidden states are the ones this run would produce.
CHECKED_FIELDS = ("target.config_sha256", "target.weights_fingerprint", "target.tokenizer_sha256",
                  "target.chat_template_sha256", "layers", "dtype", "hidden_size")
_RESERVED = ("format", "version", "created", "created_unix", "shards")
_SHARD_RE = re.compile(r"^r(\d{3,})-(\d{6,})\.safetensors$")
_TEMP_RE = re.compile(r"^\.r(\d{3,})-(\d{6,})\.safetensors\.tmp$")
_NEW_SLACK_S = 60.0  # see StoreWriter._wait_for_rank0
_MAX_OPEN_SHARDS = 256
log = logging.getLogger("hstap.store")


def store_bytes_per_token(num_aux: int, hidden_size: int, dtype: str = "bf16") -> int:
    """Bytes per token in a shard (aux + final + fp8 scales + int32 id + uint8 mask), without per-shard overhead."""
    if dtype not in DTYPES:
        raise HstapError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    elem, scale = {"bf16": (2, 0), "fp32": (4, 0), "fp8": (1, 4)}[dtype]  # bytes per value, per row (fp8 scale)
    return (num_aux + 1) * (hidden_size * elem + scale) + 5


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H) float -> (q (..., H) float8_e4m3fn, scale (...) float32), one scale per row; runs on x's device."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # (..., 1)
    # tiny floor: a denormal amax would make amax/448 underflow to 0; all-zero rows get scale 1 so q = 0 exactly.
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # (..., H)
    return q, scale.squeeze(-1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., H) float8 and (...) float32 scales -> (..., H) `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def _header_diff(old: dict, new: dict) -> tuple[str, object, object] | None:
    """The first of CHECKED_FIELDS that differs: (dotted name, old value, new value)."""
    for name in CHECKED_FIELDS:
        a, b = old, new
        for k in name.split("."):
            a, b = (a.get(k) if isinstance(a, dict) else None), (b.get(k) if isinstance(b, dict) else None)
        if a != b:
            return name, a, b
    return None


def _check_header(header: dict) -> dict:
    if not isinstance(header, dict):
        raise HstapError(f"store header: expected a dict, got {type(header).__name__}")
    for k in _RESERVED:
        if k in header:
            raise HstapError(f"store header: key {k!r} is reserved for the manifest")
    if header.get("dtype") not in DTYPES:
        raise HstapError(f"store header: dtype: expected one of {', '.join(DTYPES)}, got {header.get('dtype')!r}")
    layers = header.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise HstapError(f"store header: layers: expected a non-empty list of canonical layer ids, got {layers!r}")
    if not isinstance(header.get("hidden_size"), int) or header["hidden_size"] < 1:
        raise HstapError(f"store header: hidden_size: expected a positive int, got {header.get('hidden_size')!r}")
    try:  # the header goes into JSON: fail now, not at the first commit
        return json.loads(json.dumps(header))
    except (TypeError, ValueError) as e:
        raise HstapError(f"store header: not JSON-serialisable: {e}") from None


def _write_json(path: Path, obj: dict) -> None:
    """Atomically write a manifest/part file: one key per line, one shard entry per line.

    Not `atomic_write_json`: its indented output goes through json's pure-Python encoder, and a part file is
    rewritten at every commit: O(shards^2) Python time per rank. This uses the C encoder and stays grep-able."""
    lines = []
    for k, v in obj.items():
        if k == "shards" and v:
            body = ",\n".join("  " + json.dumps(e, separators=(", ", ": ")) for e in v)
            lines.append(f' "shards": [\n{body}\n ]')
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    atomic_write_bytes(path, ("{\n" + ",\n".join(lines) + "\n}\n").encode())


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
    except json.JSONDecodeError as e:
        raise HstapError(f"{path}:{e.lineno}: {what} is not valid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise HstapError(f"{path}:1: {what}: expected a JSON object")
    return obj


def _load_manifest(path: Path) -> dict:
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise HstapError(f"{path}: not an hstap store (no manifest.json)")
    m = _read_json(mpath, "manifest")
    if m.get("format") != FORMAT:
        raise HstapError(f"{mpath}:1: format: expected {FORMAT!r}, got {m.get('format')!r}")
    if not isinstance(m.get("version"), int) or m["version"] > VERSION:
        raise HstapError(f"{mpath}:1: version: {m.get('version')!r} is not readable by this hstap (reads <= {VERSION})")
    if not isinstance(m.get("shards"), list):
        raise HstapError(f"{mpath}:1: shards: expected a list")
    return m


def _load_parts(path: Path) -> list[tuple[Path, dict]]:
    out = []
    pdir = path / "parts"
    if pdir.is_dir():
        for p in sorted(pdir.glob("rank*.json")):
            part = _read_json(p, "part file")
            if part.get("format") != PART_FORMAT or not isinstance(part.get("shards"), list):
                raise HstapError(f"{p}:1: not an hstap store part file (format {part.get('format')!r})")
            out.append((p, part))
    return out


def _union(manifest: dict, parts: list[tuple[Path, dict]]) -> tuple[list[dict], list[str], set[str]]:
    """Committed entries = manifest ∪ part files, keyed by file, ordered by (rank, seq), duplicate sample ids dropped.

    Returns (entries, problems, files named by any entry, dropped ones included)."""
    by_file: dict[str, dict] = {}
    problems: list[str] = []
    sources = [("manifest.json", manifest["shards"])] + [(f"parts/{p.name}", q["shards"]) for p, q in parts]
    for source, entries in sources:
        for e in entries:
            if not isinstance(e, dict) or not all(k in e for k in ("file", "rank", "seq", "sha256", "ids", "lengths")):
                problems.append(f"{source}: malformed shard entry {str(e)[:120]}")
                continue
            old = by_file.get(e["file"])
            if old is None:
                by_file[e["file"]] = e
            elif old != e:
                problems.append(f"{source}: entry for {e['file']} differs from an earlier one (kept the first)")
    files = set(by_file)
    out, owner = [], {}
    for e in sorted(by_file.values(), key=lambda e: (e["rank"], e["seq"])):
        clash = [i for i in e["ids"] if i in owner]
        if clash:
            problems.append(f"{e['file']}: {len(clash)} sample id(s) already committed by {owner[clash[0]]} "
                            f"(e.g. {clash[0]!r}); entry ignored")
            continue
        for i in e["ids"]:
            owner[i] = e["file"]
        out.append(e)
    return out, problems, files


def merge_manifest(path: str | os.PathLike) -> dict:
    """Fold every part file into manifest.json (atomic, idempotent). Returns {shards, samples, tokens, problems}."""
    path = Path(path)
    m = _load_manifest(path)
    entries, problems, _ = _union(m, _load_parts(path))
    merged = {k: v for k, v in m.items() if k != "shards"} | {"shards": entries}
    if merged != m:
        _write_json(path / "manifest.json", merged)
    for p in problems:
        log.warning("%s: %s", path, p)
    return {"shards": len(entries), "samples": sum(len(e["ids"]) for e in entries),
            "tokens": sum(int(e["tokens"]) for e in entries), "problems": problems}


class _Shard:
    """One open shard's tensors, stored by reference (no copies): lists of per-sample tensors."""

    def __init__(self):
        self.ids: list[str] = []
        self.id_set: set[str] = set()
        self.lengths: list[int] = []
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.on_written: list[Callable[[], object]] = []  # run once this shard is committed (StoreWriter.when_written)

    def append(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        self.ids.append(sample_id)
        self.id_set.add(sample_id)
        self.lengths.append(int(tensors["input_ids"].shape[0]))
        for k, t in tensors.items():
            self.parts.setdefault(k, []).append(t)


CHECKSUM = "sha256-chunked-16MiB"
CHUNK_BYTES = 16 << 20
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:  # hashlib and os.pwrite/os.pread release the GIL: chunks really run in parallel
        _POOL = ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 1) + 1), thread_name_prefix="hstap-shard-io")
    return _POOL


def _drop_pool_after_fork() -> None:
    global _POOL
    _POOL = None  # a forked child has the executor object but none of its threads: make a fresh one on first use


os.register_at_fork(after_in_child=_drop_pool_after_fork)


def _combine(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def file_checksum(path: str | os.PathLike) -> str:
    """The store's checksum of a file: sha256 over the concatenated sha256 digests of its consecutive 16 MiB chunks.

    A chunked (one-level tree) hash instead of one sha256 stream so that writing and verifying hash chunks on several
    cores: a single sha256 stream runs at ~1.2 GB/s, slower than the GPU produces hidden states."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def work(c: int) -> bytes:
            lo, n = c * CHUNK_BYTES, min(CHUNK_BYTES, size - c * CHUNK_BYTES)
            h, done = hashlib.sha256(), 0
            while done < n:
                b = os.pread(fd, min(n - done, 4 << 20), lo + done)
                if not b:
                    raise OSError(f"{path}: file shrank while reading")
                h.update(b)
                done += len(b)
            return h.digest()

        return _combine(list(_pool().map(work, range(max(1, -(-size // CHUNK_BYTES))))))
    finally:
        os.close(fd)


def _write_safetensors(path: Path, tensors: list[tuple[str, list[torch.Tensor], list[int]]], metadata: dict[str, str]
                       ) -> tuple[str, int]:
    """Write a safetensors file from per-piece tensors (no concatenation); returns (file_checksum, size).

    `tensors` is [(name, pieces, shape)]: tensor `name` is the pieces' bytes back to back. Pieces are contiguous CPU
    tensors of one dtype. The file is laid out first, then its 16 MiB chunks are written (`pwrite`) and hashed in
    parallel straight from the tensors' memory. The data is fsynced here; the caller renames."""
    header: dict = {"__metadata__": metadata}
    off = 0
    for name, pieces, shape in tensors:
        n = sum(p.numel() * p.element_size() for p in pieces)
        if n != math.prod(shape) * pieces[0].element_size():
            raise AssertionError(f"{name}: {n} bytes of pieces for shape {shape}")
        header[name] = {"dtype": _ST_NAMES[pieces[0].dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # safetensors pads with spaces so the data starts 8-byte aligned
    segs: list[tuple[int, memoryview]] = [(0, memoryview(len(hb).to_bytes(8, "little") + hb))]
    pos = len(segs[0][1])
    for _, pieces, _ in tensors:
        for p in pieces:
            if p.numel():
                # raw bytes straight from the tensor's memory (bf16/fp8 have no numpy dtype: view as uint8)
                mv = memoryview(p.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
                segs.append((pos, mv))
                pos += mv.nbytes
    size = pos
    starts = [o for o, _ in segs]

    def span(lo: int, hi: int) -> Iterator[tuple[int, memoryview]]:
        """(file offset, bytes) pieces covering [lo, hi) of the file."""
        i = bisect.bisect_right(starts, lo) - 1
        while i < len(segs) and segs[i][0] < hi:
            so, mv = segs[i]
            yield max(lo, so), mv[max(lo, so) - so: min(hi, so + mv.nbytes) - so]
            i += 1

    def hash_chunk(c: int) -> bytes:
        h = hashlib.sha256()
        for _, piece in span(c * CHUNK_BYTES, min(size, (c + 1) * CHUNK_BYTES)):
            h.update(piece)
        return h.digest()

    def write_all() -> None:
        # One sequential writer: the kernel serialises writes to one file anyway (inode lock), and large in-order
        # writes are what the sink's bandwidth is measured with. The hashes run beside it on the other threads.
        for at, piece in span(0, size):
            done = 0
            while done < piece.nbytes:
                done += os.pwrite(fd, piece[done: done + (64 << 20)], at + done)

    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.ftruncate(fd, size)
        pool = _pool()
        wrote = pool.submit(write_all)
        digests = list(pool.map(hash_chunk, range(max(1, -(-size // CHUNK_BYTES)))))
        wrote.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    return _combine(digests), size


class StoreWriter:
    """Append samples to a store, committing a shard each `shard_tokens` tokens (see the module docstring).

    `add()` takes ownership of the tensors it is given: tensors already in the store dtype (and contiguous) are kept by
    reference until their shard is written, so the caller must not modify or reuse them (e.g. a pinned staging buffer)
    after `add`; anything else is converted (a copy). Thread-safety: `add`, `flush` and `close` share a lock, so one
    thread may add while another flushes; several writers can flush in parallel threads (hashing and writing release
    the GIL). Use as a context manager or call `close()`; on an exception inside `with`, samples not yet committed are
    dropped (a re-run redoes them) and the manifest is not merged.

    `barrier`: an optional callable (e.g. `torch.distributed.barrier`) called by every rank after rank 0 prepared the
    store and again in `close()` before rank 0 merges. Without it, ranks > 0 poll for manifest.json (up to `wait_s`);
    with new=True they additionally wait for a manifest created at most 60 s before they started (so they never resume
    from the store rank 0 is about to wipe), and rank 0's `close()` merges whatever is committed at that time (readers
    see the rest through the part files; `merge_manifest` can be re-run).
    """

    def __init__(self, path: str | os.PathLike, header: dict, rank: int = 0, world_size: int = 1,
                 shard_tokens: int = 1 << 20, new: bool = False, *, shard_bytes: int | None = None,
                 barrier: Callable[[], object] | None = None, wait_s: float = 600.0):
        if not 0 <= rank < world_size:
            raise HstapError(f"store: rank {rank} is out of range for world_size {world_size}")
        if shard_tokens < 1 or (shard_bytes is not None and shard_bytes < 1):
            raise HstapError(f"store: shard_tokens/shard_bytes must be >= 1 (got {shard_tokens}, {shard_bytes})")
        started = time.time()
        self.path = Path(path)
        self.header = _check_header(header)
        self.rank, self.world_size, self.new = rank, world_size, new
        self.shard_tokens, self.shard_bytes = shard_tokens, shard_bytes
        self.dtype: str = self.header["dtype"]
        self.num_aux, self.hidden_size = len(self.header["layers"]), self.header["hidden_size"]
        self.bytes_per_token = store_bytes_per_token(self.num_aux, self.hidden_size, self.dtype)
        self._barrier = barrier if world_size > 1 else None
        self._lock = threading.RLock()
        self._open = _Shard()
        self._open_tokens = 0
        self._closed = False
        self._failed: str | None = None
        self.summary: dict | None = None  # merge_manifest's result after close() on rank 0

        if rank == 0:
            self._prepare(new)
        if self._barrier is not None:
            self._barrier()
        elif rank > 0:
            self._wait_for_rank0(started, wait_s)
        manifest = _load_manifest(self.path)
        diff = _header_diff(manifest, self.header)
        if diff:
            name, old, now = diff
            raise HstapError(f"{self.path / 'manifest.json'}:1: {name}: the store was made with {old!r}, this run has "
                             f"{now!r}; pass new=True (--new) to replace it, or write to another directory")
        self.shards_dir, self.parts_dir = self.path / "shards", self.path / "parts"
        self.part_path = self.parts_dir / f"rank{rank:03d}.json"
        parts = _load_parts(self.path)
        entries, problems, referenced = _union(manifest, parts)
        for p in problems:
            log.warning("%s: %s", self.path, p)
        self._committed: set[str] = {i for e in entries for i in e["ids"]}
        own: dict[str, dict] = {}
        for e in manifest["shards"] + [e for p, q in parts if p == self.part_path for e in q["shards"]]:
            if isinstance(e, dict) and e.get("rank") == rank:
                own.setdefault(e["file"], e)
        self._entries = sorted(own.values(), key=lambda e: e["seq"])
        self._next_seq = max((e["seq"] for e in self._entries), default=-1) + 1
        self._remove_orphans(referenced)
        self._write_part(closed=False)

    # -- setup ---------------------------------------------------------------------------------------------------------

    def _prepare(self, new: bool) -> None:
        """Rank 0: wipe (new=True) and create the store if needed."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise HstapError(f"{p}: exists and is not a directory")
        has_manifest = (p / "manifest.json").is_file()
        if new:
            for name in ("manifest.json", "parts", "shards"):  # only the store's own files, never the whole directory
                q = p / name
                if q.is_dir():
                    shutil.rmtree(q)
                elif q.exists():
                    q.unlink()
            has_manifest = False
        elif not has_manifest and (p / "parts").is_dir() and any((p / "parts").glob("*.json")):
            # Committed part files without a manifest: the manifest is written before any shard is, so this store was
            # damaged by hand. Empty shards/ and parts/ are only a creation interrupted by a kill: start over.
            raise HstapError(f"{p}: has shards/ or parts/ but no manifest.json (a damaged store); "
                             f"pass new=True to start over")
        if not has_manifest:
            (p / "shards").mkdir(parents=True, exist_ok=True)
            (p / "parts").mkdir(exist_ok=True)
            now = datetime.datetime.now(datetime.timezone.utc)
            _write_json(p / "manifest.json", {"format": FORMAT, "version": VERSION, **self.header,
                                              "created": now.isoformat(timespec="seconds"),
                                              "created_unix": now.timestamp(), "checksum": CHECKSUM,
                                              "shards": []})

    def _wait_for_rank0(self, started: float, wait_s: float) -> None:
        deadline, delay = started + wait_s, 0.02
        while True:
            mpath = self.path / "manifest.json"
            if mpath.is_file():
                m = _load_manifest(self.path)
                fresh = m.get("created_unix", 0.0) >= started - _NEW_SLACK_S
                if not self.new or (fresh and _header_diff(m, self.header) is None):
                    return
            if time.time() > deadline:
                raise HstapError(f"{self.path}: rank {self.rank} waited {wait_s:.0f}s for rank 0 to "
                                 f"{'re' if self.new else ''}create manifest.json (pass barrier= to synchronise ranks)")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _remove_orphans(self, referenced: set[str]) -> None:
        """Delete this rank's leftovers of a killed run: temp shards, uncommitted shards, temp part files."""
        for f in self.shards_dir.iterdir():
            m = _SHARD_RE.match(f.name) or _TEMP_RE.match(f.name)
            if m and int(m.group(1)) == self.rank and (f.name.startswith(".") or f"shards/{f.name}" not in referenced):
                f.unlink()
                log.info("%s: removed uncommitted %s", self.path, f.name)
        for f in self.parts_dir.glob(f".{self.part_path.name}.*.tmp"):  # atomic_write_bytes' temp names
            f.unlink()

    def _write_part(self, closed: bool) -> None:
        _write_json(self.part_path, {"format": PART_FORMAT, "version": VERSION, "rank": self.rank, "closed": closed,
                                     "shards": self._entries})

    # -- writing -------------------------------------------------------------------------------------------------------

    def committed_ids(self) -> set[str]:
        """Ids committed by any rank: read from disk now, plus this writer's own commits."""
        entries, _, _ = _union(_load_manifest(self.path), _load_parts(self.path))
        with self._lock:
            return {i for e in entries for i in e["ids"]} | self._committed

    @property
    def committed_samples(self) -> int:
        """Samples committed in the store as this writer knows it (all ranks at open + its own commits since)."""
        return len(self._committed)

    def add(self, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
            final: torch.Tensor, aux_scale: torch.Tensor | None = None,
            final_scale: torch.Tensor | None = None) -> None:
        """Queue one sample; commits the open shard once it holds >= shard_tokens tokens (or shard_bytes bytes).

        input_ids (T,) int, loss_mask (T,) 0/1 (bool or int), aux (T, K, H), final (T, H), all on the CPU. aux/final in
        the store dtype or any float dtype (converted; quantized for fp8 stores); with aux_scale (T, K) and
        final_scale (T,) given, aux/final are already float8_e4m3fn (fp8 stores only)."""
        sample_id = str(sample_id)
        t = self._prepare_sample(sample_id, input_ids, loss_mask, aux, final, aux_scale, final_scale)
        with self._lock:
            if self._failed:
                raise HstapError(f"{self.path}: writer stopped after an error ({self._failed})")
            if self._closed:
                raise HstapError(f"{self.path}: add() after close()")
            if sample_id in self._committed:
                raise HstapError(f"{self.path}: sample id {sample_id!r} is already committed (skip committed_ids())")
            if sample_id in self._open.id_set:
                raise HstapError(f"{self.path}: sample id {sample_id!r} was added twice")
            self._open.append(sample_id, t)
            self._open_tokens += int(t["input_ids"].shape[0])
            if self._open_tokens >= self.shard_tokens or (
                    self.shard_bytes is not None and self._open_tokens * self.bytes_per_token >= self.shard_bytes):
                self._flush_locked()

    def _prepare_sample(self, sid, input_ids, loss_mask, aux, final, aux_scale, final_scale) -> dict[str, torch.Tensor]:
        K, H = self.num_aux, self.hidden_size
        where = f"{self.path}: sample {sid!r}"
        for name, x in (("input_ids", input_ids), ("loss_mask", loss_mask), ("aux", aux), ("final", final)):
            if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
                raise HstapError(f"{where}: {name}: expected a CPU tensor (copy device->host before add)")
        T = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
        if T < 1:
            raise HstapError(f"{where}: input_ids: expected shape (T,) with T >= 1, got {tuple(input_ids.shape)}")
        for name, x, shape in (("loss_mask", loss_mask, (T,)), ("aux", aux, (T, K, H)), ("final", final, (T, H))):
            if tuple(x.shape) != shape:
                raise HstapError(f"{where}: {name}: expected shape {shape} (T, K=len(layers), H), got {tuple(x.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise HstapError(f"{where}: input_ids: expected an integer tensor, got {input_ids.dtype}")
        mask = loss_mask.to(torch.uint8).contiguous()  # (T,)
        if not torch.equal(mask, loss_mask.to(torch.bool).to(torch.uint8)):
            raise HstapError(f"{where}: loss_mask: values must be 0 or 1")
        out = {"input_ids": input_ids.to(torch.int32).contiguous(), "loss_mask": mask}  # (T,), (T,)
        if self.dtype == "fp8":
            if (aux_scale is None) != (final_scale is None):
                raise HstapError(f"{where}: pass both aux_scale and final_scale or neither")
            if aux_scale is None:
                if aux.dtype == torch.float8_e4m3fn or final.dtype == torch.float8_e4m3fn:
                    raise HstapError(f"{where}: float8 aux/final need aux_scale and final_scale")
                aux, aux_scale = quantize_fp8(aux)  # (T, K, H), (T, K)
                final, final_scale = quantize_fp8(final)  # (T, H), (T,)
            f8, f32 = torch.float8_e4m3fn, torch.float32
            for name, x, dt, shape in (("aux", aux, f8, (T, K, H)), ("final", final, f8, (T, H)),
                                       ("aux_scale", aux_scale, f32, (T, K)), ("final_scale", final_scale, f32, (T,))):
                if x.dtype != dt or tuple(x.shape) != shape or x.device.type != "cpu":
                    raise HstapError(f"{where}: {name}: expected a CPU {dt} tensor of shape {shape}, got {x.dtype} "
                                     f"{tuple(x.shape)} on {x.device}")
            out |= {"aux_scale": aux_scale.contiguous(), "final_scale": final_scale.contiguous(),
                    "aux": aux.contiguous(), "final": final.contiguous()}
        else:
            if aux_scale is not None or final_scale is not None:
                raise HstapError(f"{where}: aux_scale/final_scale are only for fp8 stores (this one is {self.dtype})")
            dt = TORCH_DTYPES[self.dtype]
            for name, x in (("aux", aux), ("final", final)):
                if not x.dtype.is_floating_point or x.dtype == torch.float8_e4m3fn:
                    raise HstapError(f"{where}: {name}: expected a float tensor, got {x.dtype}")
            out |= {"aux": aux.to(dt).contiguous(), "final": final.to(dt).contiguous()}  # no copy when already dt
        return out

    def when_written(self, fn: Callable[[], object]) -> None:
        """Call `fn()` once every sample added so far is committed (at once when none is pending).

        Lets a caller hand `add()` views of a reusable buffer (a pinned staging buffer) instead of a copy, and take the
        buffer back when its shard is on disk. Never called for samples a failure drops (their memory is just freed)."""
        with self._lock:
            if self._open.ids:
                self._open.on_written.append(fn)
                return
        fn()

    def flush(self) -> None:
        """Commit the open shard now (no-op when it is empty)."""
        with self._lock:
            self._flush_locked()

    def _fail(self, fname: str, err: OSError) -> HstapError:
        what = "no space left on device" if err.errno == 28 else (err.strerror or str(err))
        self._failed = what
        self._open, self._open_tokens = _Shard(), 0
        return HstapError(f"{what} while writing {fname}: committed data is intact ({len(self._committed)} samples); "
                          f"free space and re-run to resume")

    def _flush_locked(self) -> None:
        sh = self._open
        if not sh.ids or self._failed:
            return
        seq, name = self._next_seq, f"r{self.rank:03d}-{self._next_seq:06d}.safetensors"
        final_path, tmp = self.shards_dir / name, self.shards_dir / f".{name}.tmp"
        T, N, K, H = sum(sh.lengths), len(sh.ids), self.num_aux, self.hidden_size
        offsets = torch.zeros(N + 1, dtype=torch.int64)  # (N+1,)
        offsets[1:] = torch.tensor(sh.lengths, dtype=torch.int64).cumsum(0)
        tensors = [("offsets", [offsets], [N + 1]), ("input_ids", sh.parts["input_ids"], [T])]
        if self.dtype == "fp8":
            tensors += [("aux_scale", sh.parts["aux_scale"], [T, K]), ("final_scale", sh.parts["final_scale"], [T])]
        tensors += [("aux", sh.parts["aux"], [T, K, H]), ("final", sh.parts["final"], [T, H]),
                    ("loss_mask", sh.parts["loss_mask"], [T])]
        meta = {"format": FORMAT, "version": str(VERSION), "ids": json.dumps(sh.ids), "dtype": self.dtype,
                "layers": json.dumps(self.header["layers"]), "rank": str(self.rank)}
        try:
            sha, size = _write_safetensors(tmp, tensors, meta)
            os.replace(tmp, final_path)
            fsync_dir(self.shards_dir)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            final_path.unlink(missing_ok=True)  # renamed but its directory entry may not be durable: not committed
            raise self._fail(str(final_path), e) from e
        entry = {"file": f"shards/{name}", "rank": self.rank, "seq": seq, "sha256": sha, "bytes": size, "tokens": T,
                 "ids": list(sh.ids), "lengths": list(sh.lengths)}
        self._entries.append(entry)
        try:
            self._write_part(closed=False)  # the commit point
        except OSError as e:
            self._entries.pop()
            final_path.unlink(missing_ok=True)  # not committed: do not leave it for a reader to wonder about
            raise self._fail(str(self.part_path), e) from e
        self._committed.update(sh.ids)
        self._next_seq += 1
        self._open, self._open_tokens = _Shard(), 0
        sh.parts.clear()  # the shard's tensors are on disk: drop them before handing their memory back
        for fn in sh.on_written:
            fn()

    def close(self) -> None:
        """Commit the open shard, mark this rank's part file closed and (rank 0, after `barrier`) merge the manifest."""
        with self._lock:
            if self._closed:
                return
            if self._failed:
                raise HstapError(f"{self.path}: writer stopped after an error ({self._failed})")
            self._flush_locked()
            self._write_part(closed=True)
            self._closed = True
        if self._barrier is not None:
            self._barrier()
        if self.rank == 0:
            self.summary = merge_manifest(self.path)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            with self._lock:
                self._open, self._open_tokens, self._closed = _Shard(), 0, True


# ---------------------------------------------------------------------------------------------------------------------
# Reading


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
            f = self.path / self.manifest["shards"][si]["file"]
            if not f.is_file():
                raise HstapError(f"{f}: shard file is missing (run Store.verify())")
            h = safe_open(str(f), framework="pt")
            sl = self._handles[si] = {name: h.get_tensor(name) for name in h.keys()}
            if len(self._handles) > _MAX_OPEN_SHARDS:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(si)
        return sl

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
        return {"id": self.ids[i], "input_ids": sl["input_ids"][a:b].long(),  # (T,)
                "loss_mask": sl["loss_mask"][a:b].long(), "aux": aux, "final": final}

    def __getstate__(self) -> dict:  # DataLoader spawn workers pickle the Dataset object itself (no file is unpickled)
        return {k: v for k, v in self.__dict__.items() if k != "_handles"} | {"_handles": OrderedDict()}

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
        dt = _ST_NAMES[TORCH_DTYPES[self.dtype]]
        want = {"offsets": ("I64", [N + 1]), "input_ids": ("I32", [T]), "loss_mask": ("U8", [T]),
                "aux": (dt, [T, K, H]), "final": (dt, [T, H])}
        if self.dtype == "fp8":
            want |= {"aux_scale": ("F32", [T, K]), "final_scale": ("F32", [T])}
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
            if bool(((h.get_tensor("loss_mask") > 1)).any()):
                out.append("loss_mask has values other than 0/1")
            for name in [n for n in ("aux", "final", "aux_scale", "final_scale") if n in want]:
                s = h.get_slice(name)
                row = max(1, math.prod(want[name][1][1:]) * 4)
                step = max(1, chunk_bytes // row)
                for a in range(0, T, step):
                    x = s[a:min(T, a + step)].float()  # bounded chunk: a shard can be far larger than memory
                    if not bool(torch.isfinite(x).all()):
                        out.append(f"{name}: non-finite values (NaN/Inf) in tokens {a}..{min(T, a + step)}")
                        break
                    if name.endswith("_scale") and not bool((x > 0).all()):
                        out.append(f"{name}: non-positive scales")
                        break
        return out


def open_store(path: str | os.PathLike) -> Store:
    """Open a store for reading: manifest.json ∪ part files (see the module docstring). HstapError if not a store."""
    path = Path(path)
    m = _load_manifest(path)
    for k in ("dtype", "layers", "hidden_size"):
        if k not in m:
            raise HstapError(f"{path / 'manifest.json'}:1: {k}: missing")
    if m["dtype"] not in DTYPES:
        raise HstapError(f"{path / 'manifest.json'}:1: dtype: {m['dtype']!r} is not one of {', '.join(DTYPES)}")
    entries, problems, _ = _union(m, _load_parts(path))
    return Store(path, m, entries, problems)
