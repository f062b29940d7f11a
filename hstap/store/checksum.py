"""The store's file checksum (`checksum` "sha256-chunked-16MiB" in the spec, `hstap.store.format`) and the I/O pool
that hashes, writes and verifies a shard's chunks on several cores."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

CHECKSUM = "sha256-chunked-16MiB"
CHUNK_BYTES = 16 << 20
_POOL: ThreadPoolExecutor | None = None


def io_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:  # hashlib and os.pwrite/os.pread release the GIL: chunks really run in parallel
        _POOL = ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 1) + 1), thread_name_prefix="hstap-shard-io")
    return _POOL


def _drop_pool_after_fork() -> None:
    global _POOL
    _POOL = None  # a forked child has the executor object but none of its threads: make a fresh one on first use


os.register_at_fork(after_in_child=_drop_pool_after_fork)


def combine_digests(digests: list[bytes]) -> str:
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

        return combine_digests(list(io_pool().map(work, range(max(1, -(-size // CHUNK_BYTES))))))
    finally:
        os.close(fd)
