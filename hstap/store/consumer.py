"""A store's consumer record, STORE/consumer.json (spec: "Consumed shards and back-pressure" in `hstap.store.format`):
which shards a consuming trainer (`hstap train --follow --consume`) has used up and deleted, and the window of shard
files its writers keep to.

The trainer (`hstap.train.follow`) is the only process that writes the record; readers (`open_store`) drop the consumed
shards' entries; writers (`StoreWriter`) wait in `wait_for_room` while their share of the window is full.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from hstap.common import HstapError, atomic_write_bytes, read_json
from hstap.store.format import SHARD_RE, TEMP_RE
from hstap.store.manifest import load_manifest, write_json

CONSUMER_FORMAT = "hstap-store-consumer"
CONSUMER_VERSION = 1
RECORD = "consumer.json"
log = logging.getLogger("hstap.store")


def read_consumer(path: str | os.PathLike, manifest: dict | None = None) -> dict | None:
    """STORE/consumer.json, checked; None when there is none, or when it was made for an earlier store at this path
    (its store_created_unix is neither null nor `manifest`'s created_unix; without `manifest` this is not checked)."""
    f = Path(path) / RECORD
    if not f.is_file():
        return None
    rec = read_json(f, "consumer record")
    where = f"{f}:1"
    if rec.get("format") != CONSUMER_FORMAT:
        raise HstapError(f"{where}: format: expected {CONSUMER_FORMAT!r}, got {rec.get('format')!r}")
    if not isinstance(rec.get("version"), int) or rec["version"] > CONSUMER_VERSION:
        raise HstapError(f"{where}: version: {rec.get('version')!r} is not readable by this hstap "
                         f"(reads <= {CONSUMER_VERSION})")
    consumed = rec.get("consumed")
    if not isinstance(consumed, dict) or not all(k.isdigit() and isinstance(v, int) and v >= 0
                                                 for k, v in consumed.items()):
        raise HstapError(f"{where}: consumed: expected an object of rank -> shards consumed, got {consumed!r}")
    n = rec.get("keep_shards")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(rec.get("active"), bool):
        raise HstapError(f"{where}: keep_shards must be an integer >= 1 and active a boolean")
    born = rec.get("store_created_unix")
    if manifest is not None and born is not None and born != manifest.get("created_unix"):
        return None
    return rec


def claim_store(store: str, keep_shards: int, run: Path, resuming: bool) -> Callable[[], None]:
    """Rank 0 of a consuming run (`hstap.train.follow`), before anything else: write STORE/consumer.json (active, the
    window), creating STORE if no writer has yet, so that writers keep to the window from their first shard. Refuses a
    store another run consumes, or a consumed store this run did not consume before (a resume must be of the run that
    consumed it). Returns the claim's undo: the store as it was (consumer.json as before, or none; STORE removed if the
    claim made it and it is still empty), for a run refused before it starts, which leaves no active claim behind."""
    path = Path(store)
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    m = load_manifest(path) if (path / "manifest.json").is_file() else None
    rec = read_consumer(path, m)
    if rec is not None and rec["run"] != str(run):
        raise HstapError(f"{path / 'consumer.json'}:1: run: the store is consumed by {rec['run']}; one consuming "
                         f"trainer per store (resume that run)")
    if rec is not None and any(rec["consumed"].values()) and not resuming:
        raise HstapError(f"{path / 'consumer.json'}:1: consumed: {run} consumed shards of this store already: pass "
                         f"--resume")
    before = (path / RECORD).read_bytes() if (path / RECORD).is_file() else None
    write_consumer(path, {"run": str(run), "store_created_unix": m.get("created_unix") if m else None, "active": True,
                          "keep_shards": keep_shards, "consumed": rec["consumed"] if rec else {}})

    def undo() -> None:
        if before is not None:
            atomic_write_bytes(path / RECORD, before)
            return
        (path / RECORD).unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):  # a writer has begun the store meanwhile: it stays
                path.rmdir()
    return undo


def is_consumed(entry: dict, rec: dict | None) -> bool:
    """Whether a shard entry is consumed under the record (shard (r, s) is consumed iff s < consumed[r])."""
    return rec is not None and int(entry["seq"]) < int(rec["consumed"].get(str(entry["rank"]), 0))


def write_consumer(path: str | os.PathLike, rec: dict) -> None:
    """Replace STORE/consumer.json atomically (the trainer's rank 0 only)."""
    write_json(Path(path) / RECORD, {"format": CONSUMER_FORMAT, "version": CONSUMER_VERSION, **rec,
                                     "updated_unix": time.time()})


def delete_consumed(path: str | os.PathLike, rec: dict) -> int:
    """Delete the files of consumed shards still on disk (after the record that names them was written); returns how
    many were deleted."""
    n = 0
    shards = Path(path) / "shards"
    for f in shards.iterdir() if shards.is_dir() else []:
        m = SHARD_RE.match(f.name)
        if m and int(m.group(2)) < int(rec["consumed"].get(str(int(m.group(1))), 0)):
            f.unlink(missing_ok=True)
            n += 1
    return n


def own_shard_files(shards_dir: Path, rank: int) -> int:
    """Shard files of `rank` on disk, committed or temporary."""
    n = 0
    for f in os.scandir(shards_dir):
        m = SHARD_RE.match(f.name) or TEMP_RE.match(f.name)
        n += bool(m and int(m.group(1)) == rank)
    return n


def wait_for_room(path: str | os.PathLike, rank: int, world_size: int, poll_s: float = 0.05,
                  max_poll_s: float = 0.5) -> float:
    """Block writer `rank` (of `world_size`) while an active consumer record's window is full for it: while
    max(1, keep_shards // world_size) of its shard files are on disk. Returns the seconds waited (0.0 without an
    active record: a writer alone never waits)."""
    path = Path(path)
    if not (path / RECORD).is_file():
        return 0.0  # the common case, a capture alone: no record, nothing else read
    t0, noted = time.monotonic(), None
    delay, manifest = poll_s, load_manifest(path)  # a record made for an earlier store at this path does not count
    while True:
        rec = read_consumer(path, manifest)
        if rec is None or not rec["active"]:
            break
        quota = max(1, rec["keep_shards"] // world_size)
        have = own_shard_files(path / "shards", rank)
        if have < quota:
            break
        if noted is None or time.monotonic() - noted > 60:
            log.info("%s: rank %d holds %d shard files, its window is %d (%s keeps %d): waiting for the trainer to "
                     "consume", path, rank, have, quota, RECORD, rec["keep_shards"])
            noted = time.monotonic()
        time.sleep(delay)
        delay = min(delay * 1.5, max_poll_s)
    return 0.0 if noted is None else time.monotonic() - t0
