"""Writing a store (`hstap.store.format` holds the format spec, `hstap.store.reader` the reader):
`StoreWriter` appends samples to shards and commits them with the protocol of the spec; `hstap.store.shard_file` lays
out one shard file and writes it while hashing its chunks."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hstap.common import HstapError, fsync_dir
from hstap.store.consumer import RECORD, wait_for_room
from hstap.store.checksum import CHECKSUM
from hstap.store.format import (FORMAT, PART_FORMAT, PART_VERSION, SHARD_RE, TEMP_RE, TORCH_DTYPES,
                                store_bytes_per_token)
from hstap.store.fp8 import quantize_fp8
from hstap.store.header import check_header, header_diff, refuse_other_header
from hstap.store.manifest import check_store_dir, load_manifest, load_parts, merge_manifest, union_entries, write_json
from hstap.store.shard_file import write_shard
from hstap.store.side import INT_NAMES as SIDE_INTS, check_side, empty_side, store_version

_NEW_SLACK_S = 60.0  # see StoreWriter._wait_for_rank0
log = logging.getLogger("hstap.store")

STATS = ("samples", "shards", "bytes", "prepare_s", "flush_s", "room_wait_s", "write_s", "hash_s", "fsync_s",
         "commit_s")
"""`StoreWriter.stats`: samples added, shards committed and their bytes; seconds in `add`'s checks and conversions
(prepare_s) and in committing shards (flush_s: from waiting for a consumer's room, room_wait_s, to the commit point),
of which the shard file's sequential write (write_s), its fsync (fsync_s), the rename, directory fsync and part file
(commit_s); hash_s is the chunks' hashing, which runs beside the write on other threads (CPU seconds, summed)."""


class _Shard:
    """One open shard's tensors, stored by reference (no copies): lists of per-sample tensors."""

    def __init__(self):
        self.ids: list[str] = []
        self.id_set: set[str] = set()
        self.lengths: list[int] = []
        self.side_rows: list[int] = []  # side branches' rows per sample (stores that carry them)
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.on_written: list[Callable[[], object]] = []  # run once this shard is committed (StoreWriter.when_written)

    def append(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        self.ids.append(sample_id)
        self.id_set.add(sample_id)
        self.lengths.append(int(tensors["input_ids"].shape[0]))
        if "side_input_ids" in tensors:
            self.side_rows.append(int(tensors["side_input_ids"].shape[0]))
        for k, t in tensors.items():
            self.parts.setdefault(k, []).append(t)


class StoreWriter:
    """Append samples to a store, committing a shard each `shard_tokens` tokens (format: `hstap.store.format`).

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

    Before writing a shard it waits while a consuming trainer's window is full for its rank (`wait_for_room`; never
    without an active consumer record). `claim=False`: create or check the store only, writing no part file of rank
    `rank` (the SGLang driver: the server's hook writers own the ranks).
    """

    def __init__(self, path: str | os.PathLike, header: dict, rank: int = 0, world_size: int = 1,
                 shard_tokens: int = 1 << 20, new: bool = False, *, shard_bytes: int | None = None,
                 barrier: Callable[[], object] | None = None, wait_s: float = 600.0, claim: bool = True):
        if not 0 <= rank < world_size:
            raise HstapError(f"store: rank {rank} is out of range for world_size {world_size}")
        if shard_tokens < 1 or (shard_bytes is not None and shard_bytes < 1):
            raise HstapError(f"store: shard_tokens/shard_bytes must be >= 1 (got {shard_tokens}, {shard_bytes})")
        started = time.time()
        self.path = Path(path)
        self.header = check_header(header)
        self.rank, self.world_size, self.new, self.claim = rank, world_size, new, claim
        self.shard_tokens, self.shard_bytes = shard_tokens, shard_bytes
        self.dtype: str = self.header["dtype"]
        self.version = store_version(self.header)  # 2 when the samples carry side branches (hstap.store.side)
        self.num_aux, self.hidden_size = len(self.header["layers"]), self.header["hidden_size"]
        self.bytes_per_token = store_bytes_per_token(self.num_aux, self.hidden_size, self.dtype)
        self._limit = shard_tokens  # tokens at which a shard closes (the bytes limit converted, when tighter)
        if shard_bytes is not None:
            self._limit = min(shard_tokens, -(-shard_bytes // self.bytes_per_token))
        self._barrier = barrier if world_size > 1 else None
        self._lock = threading.RLock()
        self._open = _Shard()
        self._open_tokens = 0
        self._expect: int | None = None  # tokens still to come in this run (expect()); None: unknown
        self._closed = False
        self._failed: str | None = None
        self.summary: dict | None = None  # merge_manifest's result after close() on rank 0
        self.stats: dict[str, float] = dict.fromkeys(STATS, 0)
        """Where this writer's time went, summed over its shards (STATS; a few clock reads per sample and per shard)."""

        if rank == 0:
            self._prepare(new)
        if self._barrier is not None:
            self._barrier()
        elif rank > 0:
            self._wait_for_rank0(started, wait_s)
        manifest = load_manifest(self.path)
        refuse_other_header(self.path, manifest, self.header)
        if int(manifest.get("version", 1)) != self.version:
            with_side = "carries side branches" if int(manifest.get("version", 1)) >= 2 else "has no side branches"
            raise HstapError(f"{self.path / 'manifest.json'}:1: side_branches: the store {with_side}, this run's "
                             f"would {'not ' if self.version < 2 else ''}(the same setting, or another store)")
        self.shards_dir, self.parts_dir = self.path / "shards", self.path / "parts"
        self.part_path = self.parts_dir / f"rank{rank:03d}.json"
        parts = load_parts(self.path)
        entries, problems, referenced = union_entries(manifest, parts)
        for p in problems:
            log.warning("%s: %s", self.path, p)
        self._committed: set[str] = {i for e in entries for i in e["ids"]}
        own: dict[str, dict] = {}
        for e in manifest["shards"] + [e for p, q in parts if p == self.part_path for e in q["shards"]]:
            if isinstance(e, dict) and e.get("rank") == rank:
                own.setdefault(e["file"], e)
        self._entries = sorted(own.values(), key=lambda e: e["seq"])
        self._next_seq = max((e["seq"] for e in self._entries), default=-1) + 1
        if claim:
            self._remove_orphans(referenced)
            self._write_part(closed=False)

    # -- setup ---------------------------------------------------------------------------------------------------------

    def _prepare(self, new: bool) -> None:
        """Rank 0: wipe (new=True) and create the store if needed."""
        p = self.path
        has_manifest = check_store_dir(p)  # a directory of other files is neither written into nor wiped
        if new:
            for name in ("manifest.json", "parts", "shards", RECORD):  # only the store's own files, never the whole directory
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
            write_json(p / "manifest.json", {"format": FORMAT, "version": self.version, **self.header,
                                              "writers": self.world_size, "created": now.isoformat(timespec="seconds"),
                                              "created_unix": now.timestamp(), "checksum": CHECKSUM,
                                              "shards": []})
        elif (m := load_manifest(p)).get("writers") != self.world_size and header_diff(m, self.header) is None:
            write_json(p / "manifest.json", {**m, "writers": self.world_size})  # a resume with another world size

    def _wait_for_rank0(self, started: float, wait_s: float) -> None:
        deadline, delay = started + wait_s, 0.02
        while True:
            mpath = self.path / "manifest.json"
            if mpath.is_file():
                m = load_manifest(self.path)
                fresh = m.get("created_unix", 0.0) >= started - _NEW_SLACK_S
                if not self.new or (fresh and header_diff(m, self.header) is None):
                    return
            if time.time() > deadline:
                raise HstapError(f"{self.path}: rank {self.rank} waited {wait_s:.0f}s for rank 0 to "
                                 f"{'re' if self.new else ''}create manifest.json (pass barrier= to synchronise ranks)")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _remove_orphans(self, referenced: set[str]) -> None:
        """Delete this rank's leftovers of a killed run: temp shards, uncommitted shards, temp part files."""
        for f in self.shards_dir.iterdir():
            m = SHARD_RE.match(f.name) or TEMP_RE.match(f.name)
            if m and int(m.group(1)) == self.rank and (f.name.startswith(".") or f"shards/{f.name}" not in referenced):
                f.unlink()
                log.info("%s: removed uncommitted %s", self.path, f.name)
        for f in self.parts_dir.glob(f".{self.part_path.name}.*.tmp"):  # atomic_write_bytes' temp names
            f.unlink()

    def _write_part(self, closed: bool) -> None:
        write_json(self.part_path, {"format": PART_FORMAT, "version": PART_VERSION, "rank": self.rank, "closed": closed,
                                     "shards": self._entries})

    # -- writing -------------------------------------------------------------------------------------------------------

    def committed_ids(self) -> set[str]:
        """Ids committed by any rank: read from disk now, plus this writer's own commits."""
        entries, _, _ = union_entries(load_manifest(self.path), load_parts(self.path))
        with self._lock:
            return {i for e in entries for i in e["ids"]} | self._committed

    @property
    def committed_samples(self) -> int:
        """Samples committed in the store as this writer knows it (all ranks at open + its own commits since)."""
        return len(self._committed)

    def add(self, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
            final: torch.Tensor, aux_scale: torch.Tensor | None = None,
            final_scale: torch.Tensor | None = None, side: dict | None = None) -> None:
        """Queue one sample; commits the open shard once it holds >= shard_tokens tokens (or shard_bytes bytes).

        input_ids (T,) int, loss_mask (T,) 0/1 (bool or int), aux (T, K, H), final (T, H), all on the CPU. aux/final in
        the store dtype or any float dtype (converted; quantized for fp8 stores); with aux_scale (T, K) and
        final_scale (T,) given, aux/final are already float8_e4m3fn (fp8 stores only). side: the sample's side
        branches ({input_ids, pos, parent, step, accepted} (S,), aux (S, K, H), final (S, H); `hstap.store.side`),
        only in a store whose header has `side_branches` (None there: no side rows)."""
        sample_id = str(sample_id)
        t0 = time.perf_counter()
        t = self._prepare_sample(sample_id, input_ids, loss_mask, aux, final, aux_scale, final_scale)
        t |= self._prepare_side(sample_id, side, int(t["input_ids"].shape[0]))
        with self._lock:
            self.stats["prepare_s"] += time.perf_counter() - t0
            if self._failed:
                raise HstapError(f"{self.path}: writer stopped after an error ({self._failed})")
            if self._closed or not self.claim:
                raise HstapError(f"{self.path}: add() after close() (or on a claim=False writer)")
            if sample_id in self._committed:
                raise HstapError(f"{self.path}: sample id {sample_id!r} is already committed (skip committed_ids())")
            if sample_id in self._open.id_set:
                raise HstapError(f"{self.path}: sample id {sample_id!r} was added twice")
            self._open.append(sample_id, t)
            self.stats["samples"] += 1
            T = int(t["input_ids"].shape[0]) + (int(t["side_input_ids"].shape[0]) if "side_input_ids" in t else 0)
            self._open_tokens += T  # side rows count as tokens: they take as many bytes
            if self._expect is not None:
                # more than announced: back to full-size shards (not a stream of floor-sized ones)
                self._expect = None if self._expect == 0 else max(0, self._expect - T)
            if self._open_tokens >= self._shard_limit():
                self._flush_locked()

    def expect(self, tokens: int) -> None:
        """Announce that `tokens` more tokens will be added in this run (optional).

        A shard is written only once it closes, so whatever the open shard holds when the last sample arrives is written
        after the producer is done (with 1 GiB shards, most of a second of drain at disk speed). Knowing what is left,
        the writer closes shards early toward the end: a shard also closes once it holds a third of the tokens still
        to come, but never below 1/16 of the shard limit, so shards shrink geometrically (x3/4 each) near the end while
        each is still written while the next fills whenever the sink is >= 4/3 the producer's speed. A small run (under
        ~3 shard limits) thus writes several small shards instead of one. Samples beyond the announced count get
        full-size shards again."""
        if tokens < 0:
            raise HstapError(f"store: expect() needs tokens >= 0 (got {tokens})")
        with self._lock:
            if self._closed:
                raise HstapError(f"{self.path}: expect() after close()")
            self._expect = int(tokens)

    @property
    def shard_limit_bytes(self) -> int:
        """Bytes of states at which a full shard closes (the tighter of shard_tokens and shard_bytes, in whole tokens);
        a shard overshoots it by at most its last sample."""
        return self._limit * self.bytes_per_token

    def _shard_limit(self) -> int:
        """Tokens at which the open shard closes now (see expect())."""
        if self._expect is None:
            return self._limit
        return min(self._limit, max(-(-self._limit // 16), -(-self._expect // 3)))

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

    def _prepare_side(self, sid: str, side: dict | None, T: int) -> dict[str, torch.Tensor]:
        """A sample's side rows as shard tensors `side_*` ({} in a store without side branches)."""
        where = f"{self.path}: sample {sid!r}"
        if self.version < 2:
            if side is not None:
                raise HstapError(f"{where}: side branches given to a store without them (its header has no "
                                 f"side_branches)")
            return {}
        K, H = self.num_aux, self.hidden_size
        if side is None:
            side = empty_side(K, H, torch.float32)
        cols = check_side(where, side, T, K, H)
        out = {f"side_{n}": c for n, c in cols.items()}  # (S,) int32 each
        aux, final = side["aux"], side["final"]  # (S, K, H), (S, H)
        for name, x in (("aux", aux), ("final", final)):
            if not x.dtype.is_floating_point or x.dtype == torch.float8_e4m3fn:
                raise HstapError(f"{where}: side.{name}: expected a float tensor, got {x.dtype}")
        if self.dtype == "fp8":  # quantized as the sample's own states
            (aux, aux_scale), (final, final_scale) = quantize_fp8(aux), quantize_fp8(final)
            out |= {"side_aux_scale": aux_scale.contiguous(), "side_final_scale": final_scale.contiguous()}
        dt = TORCH_DTYPES[self.dtype]
        return out | {"side_aux": aux.to(dt).contiguous(), "side_final": final.to(dt).contiguous()}

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
        tensors = self._shard_tensors(sh, offsets, T, N, K, H)
        meta = {"format": FORMAT, "version": str(self.version), "ids": json.dumps(sh.ids), "dtype": self.dtype,
                "layers": json.dumps(self.header["layers"]), "rank": str(self.rank)}
        st, t0 = self.stats, time.perf_counter()
        st["room_wait_s"] += wait_for_room(self.path, self.rank, self.world_size)  # a consuming trainer's window
        try:
            sha, size = write_shard(tmp, tensors, meta, st)
            t1 = time.perf_counter()
            os.replace(tmp, final_path)
            fsync_dir(self.shards_dir)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            final_path.unlink(missing_ok=True)  # renamed but its directory entry may not be durable: not committed
            raise self._fail(str(final_path), e) from e
        entry = {"file": f"shards/{name}", "rank": self.rank, "seq": seq, "sha256": sha, "bytes": size, "tokens": T,
                 "ids": list(sh.ids), "lengths": list(sh.lengths)}
        if self.version >= 2:
            entry["side_rows"] = list(sh.side_rows)
        self._entries.append(entry)
        try:
            self._write_part(closed=False)  # the commit point
        except OSError as e:
            self._entries.pop()
            final_path.unlink(missing_ok=True)  # not committed: do not leave it for a reader to wonder about
            raise self._fail(str(self.part_path), e) from e
        t2 = time.perf_counter()
        st["commit_s"] += t2 - t1
        st["flush_s"] += t2 - t0
        st["shards"] += 1
        st["bytes"] += size
        self._committed.update(sh.ids)
        self._next_seq += 1
        self._open, self._open_tokens = _Shard(), 0
        sh.parts.clear()  # the shard's tensors are on disk: drop them before handing their memory back
        for fn in sh.on_written:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the shard is committed; a caller's callback must not undo that
                log.exception("%s: a when_written callback failed", self.path)

    def _shard_tensors(self, sh: _Shard, offsets: torch.Tensor, T: int, N: int, K: int, H: int) -> list:
        """[(name, pieces, shape)] of a shard in the spec's order (descending alignment); side tensors in a version-2
        store only, each after the sample tensors of its alignment (a version-1 shard is laid out as before)."""
        p, side = sh.parts, self.version >= 2
        S = sum(sh.side_rows)
        so = torch.zeros(N + 1, dtype=torch.int64)  # (N+1,)
        so[1:] = torch.tensor(sh.side_rows, dtype=torch.int64).cumsum(0) if side else 0
        t = [("offsets", [offsets], [N + 1])] + ([("side_offsets", [so], [N + 1])] if side else [])
        t += [("input_ids", p["input_ids"], [T])] + ([(f"side_{n}", p[f"side_{n}"], [S]) for n in SIDE_INTS]
                                                     if side else [])
        if self.dtype == "fp8":
            t += [("aux_scale", p["aux_scale"], [T, K]), ("final_scale", p["final_scale"], [T])]
            if side:
                t += [("side_aux_scale", p["side_aux_scale"], [S, K]), ("side_final_scale", p["side_final_scale"], [S])]
        t += [("aux", p["aux"], [T, K, H]), ("final", p["final"], [T, H])]
        if side:
            t += [("side_aux", p["side_aux"], [S, K, H]), ("side_final", p["side_final"], [S, H])]
        return t + [("loss_mask", p["loss_mask"], [T])]

    def close(self) -> None:
        """Commit the open shard, mark this rank's part file closed and (rank 0, after `barrier`) merge the manifest."""
        with self._lock:
            if self._closed:
                return
            if self._failed:
                raise HstapError(f"{self.path}: writer stopped after an error ({self._failed})")
            self._flush_locked()
            if self.claim:
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
