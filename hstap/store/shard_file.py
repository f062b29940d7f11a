"""One shard file of a store (`hstap.store.writer` commits it, `hstap.store.format` specifies it): laid out from the
per-sample tensors without concatenating them, written by one sequential writer that hands the bytes to the disk's
writeback as it goes, while its 16 MiB chunks are hashed on the other threads of the I/O pool."""

from __future__ import annotations

import bisect
import concurrent.futures as futures
import ctypes
import hashlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hstap.store.checksum import CHUNK_BYTES, combine_digests, io_pool
from hstap.store.format import ST_NAMES

START_WRITEBACK = True
"""Start the sink's writeback of a shard file every WRITEBACK_BYTES as it is written (Linux `sync_file_range`).
Without it the kernel keeps a whole shard as dirty pages until the commit's fsync, and the disk idles while the next
shard is copied into the page cache: bursty I/O below the disk's sequential speed (benchmarks/bench_capture.py
--disk-variants old,nowb turns it off for its comparison passes)."""
WRITEBACK_BYTES = 8 << 20

_SFR_WRITE = 2  # SYNC_FILE_RANGE_WRITE: initiate writeback of dirty pages in the range, do not wait for it
_sfr = None
if sys.platform.startswith("linux"):
    try:
        _sfr = ctypes.CDLL(None, use_errno=True).sync_file_range
        _sfr.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        _sfr.restype = ctypes.c_int
    except (OSError, AttributeError):  # a libc without it: the fsync at commit still makes the data durable
        _sfr = None


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing [offset, offset + nbytes) of `fd` to the sink now (no wait, no durability:
    the commit's fsync is what makes it durable). Returns False where unsupported (a no-op there)."""
    if _sfr is None or not START_WRITEBACK:
        return False
    return _sfr(fd, offset, nbytes, _SFR_WRITE) == 0


def _layout(tensors: list[tuple[str, list[torch.Tensor], list[int]]], metadata: dict[str, str]
            ) -> list[tuple[int, memoryview]]:
    """The file as (file offset, bytes) segments: the safetensors header, then every piece's raw bytes in order."""
    header: dict = {"__metadata__": metadata}
    off = 0
    for name, pieces, shape in tensors:
        n = sum(p.numel() * p.element_size() for p in pieces)
        if n != math.prod(shape) * pieces[0].element_size():
            raise AssertionError(f"{name}: {n} bytes of pieces for shape {shape}")
        header[name] = {"dtype": ST_NAMES[pieces[0].dtype], "shape": list(shape), "data_offsets": [off, off + n]}
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
    return segs


def write_shard(path: Path, tensors: list[tuple[str, list[torch.Tensor], list[int]]], metadata: dict[str, str],
                timings: dict[str, float] | None = None) -> tuple[str, int]:
    """Write a safetensors file from per-piece tensors (no concatenation); returns (file_checksum, size).

    `tensors` is [(name, pieces, shape)]: tensor `name` is the pieces' bytes back to back. Pieces are contiguous CPU
    tensors of one dtype. The file is laid out first, then its 16 MiB chunks are written (`pwrite`) and hashed in
    parallel straight from the tensors' memory. The data is fsynced here; the caller renames.

    `timings`, when given, gets seconds added under "write_s" (the sequential writer, start to last byte handed to the
    kernel), "hash_s" (every chunk's hashing, summed over the threads: CPU seconds) and "fsync_s"."""
    segs = _layout(tensors, metadata)
    size = segs[-1][0] + segs[-1][1].nbytes
    starts = [o for o, _ in segs]

    def span(lo: int, hi: int) -> Iterator[tuple[int, memoryview]]:
        """(file offset, bytes) pieces covering [lo, hi) of the file."""
        i = bisect.bisect_right(starts, lo) - 1
        while i < len(segs) and segs[i][0] < hi:
            so, mv = segs[i]
            yield max(lo, so), mv[max(lo, so) - so: min(hi, so + mv.nbytes) - so]
            i += 1

    def hash_chunk(c: int) -> tuple[bytes, float]:
        t0 = time.perf_counter()
        h = hashlib.sha256()
        for _, piece in span(c * CHUNK_BYTES, min(size, (c + 1) * CHUNK_BYTES)):
            h.update(piece)
        return h.digest(), time.perf_counter() - t0

    stop = threading.Event()

    def write_all() -> float:
        # One sequential writer: the kernel serialises writes to one file anyway (inode lock), and large in-order
        # writes are what the sink's bandwidth is measured with. The hashes run beside it on the other threads.
        t0 = time.perf_counter()
        handed = 0  # bytes [0, handed) already handed to the disk's writeback (whole pages, WRITEBACK_BYTES at a time)
        for at, piece in span(0, size):
            done = 0
            while done < piece.nbytes and not stop.is_set():
                done += os.pwrite(fd, piece[done: done + (64 << 20)], at + done)
                end = (at + done) & ~4095  # whole pages only: a partly written page would be written twice
                if end - handed >= WRITEBACK_BYTES:
                    start_writeback(fd, handed, end - handed)  # keep the disk streaming while the rest is copied
                    handed = end
        if size > handed and not stop.is_set():
            start_writeback(fd, handed, size - handed)  # the tail: its fsync follows at once, but the disk can start
        return time.perf_counter() - t0

    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    wrote = None
    try:
        os.ftruncate(fd, size)
        pool = io_pool()
        wrote = pool.submit(write_all)
        hashed = list(pool.map(hash_chunk, range(max(1, -(-size // CHUNK_BYTES)))))
        write_s = wrote.result()
        t0 = time.perf_counter()
        os.fsync(fd)
        if timings is not None:
            for key, s in (("write_s", write_s), ("hash_s", sum(s for _, s in hashed)),
                           ("fsync_s", time.perf_counter() - t0)):
                timings[key] = timings.get(key, 0.0) + s
    finally:
        if wrote is not None:  # never close fd under a running writer: its number could be reused by another file
            stop.set()
            futures.wait([wrote])
        os.close(fd)
    return combine_digests([d for d, _ in hashed]), size
