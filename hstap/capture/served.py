"""The store side of capture inside a serving engine, shared by the SGLang hook and the vLLM connector: the prepared
set read in the server process (`Prepared`) and the writer that turns finished requests into committed samples
(`ServedWriter`).

Only the engine's writer thread touches the store. It opens it lazily, on the first finished sample of a driver
session, with the header the driver wrote (the engine's layers must equal the store's), as store rank `rank`. A sample
is stored only when its token ids equal the prepared row its request id names (input_ids and loss_mask come from the
prepared set); anything else is dropped with an event line (`hstap.capture.session`). When the driver ends its session
(`end_marker`), the writer closes its rank (`closed: true` in its part file, opening it first if it wrote nothing),
so that a trainer following the store knows that writing has ended.
"""

from __future__ import annotations

import collections
import json
import queue
import logging
import os
import time
from pathlib import Path

import torch

from hstap.common import HstapError, one_line
from hstap.capture.session import END_PREFIX

log = logging.getLogger("hstap.served")

_MANIFEST_ONLY = ("format", "version", "created", "created_unix", "shards")  # manifest keys that are not header keys


class Prepared:
    """Read-only access to the prepared set in the server process (Arrow, memory-mapped)."""

    def __init__(self, path: str):
        import pyarrow.compute as pc

        from hstap.data.prepare import load_prepared

        self.ds = load_prepared(path)
        table = self.ds.flatten_indices().data if getattr(self.ds, "_indices", None) is not None else self.ds.data
        self.ids = table.column("id")
        self.lengths = [int(x or 0) for x in pc.list_value_length(table.column("input_ids")).to_pylist()]

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_id(self, row: int) -> str:
        return str(self.ids[row].as_py())

    def sample(self, row: int) -> tuple[list[int], list[int]]:
        r = self.ds[row]
        return r["input_ids"], r["loss_mask"]


class ServedWriter:
    """Store rank `rank` (of `world_size`) of `store`, written from inside an engine; events go to
    STORE/`events_dir`/r<rank>-<pid>.jsonl. `stats` (the engine's counter, or a new one) counts samples, duplicates
    and drops."""

    def __init__(self, store: str, layers: list[int], events_dir: str, rank: int = 0, world_size: int = 1,
                 shard_tokens: int = 1 << 20, stats: collections.Counter | None = None):
        self.store, self.layers, self.events_dir = store, [int(i) for i in layers], events_dir
        self.rank, self.world_size, self.shard_tokens = rank, world_size, shard_tokens
        self.writer = None
        self.added: set[str] = set()
        self.dirty = False
        self.dtype: str | None = None
        self.session: str | None = None
        self.stats = stats if stats is not None else collections.Counter()
        self.ends = self.end_markers()  # sessions that ended before this writer started are not ours to close

    def end_markers(self) -> set[str]:
        try:
            return {f.name for f in (Path(self.store) / self.events_dir).iterdir() if f.name.startswith(END_PREFIX)}
        except OSError:
            return set()

    def event(self, obj: dict) -> None:
        d = Path(self.store) / self.events_dir
        try:
            d.mkdir(parents=True, exist_ok=True)
            with open(d / f"r{self.rank:03d}-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps({"t": round(time.time(), 3), "session": self.session, **obj}) + "\n")
                f.flush()
        except OSError:
            log.exception("hstap: cannot write an event to %s", d)

    def open(self, create: dict | None = None) -> None:
        """Open the rank in the store the driver created; with `create` (a header: tap mode, no driver), create the
        store first when it does not exist."""
        from hstap.store.reader import open_store
        from hstap.store.writer import StoreWriter

        if create is not None and not (Path(self.store) / "manifest.json").is_file():
            StoreWriter(self.store, create, world_size=self.world_size, shard_tokens=self.shard_tokens,
                        claim=False).close()
        s = open_store(self.store)  # created by the driver; HstapError if it is not there
        header = {k: v for k, v in s.header.items() if k not in _MANIFEST_ONLY}
        if list(header.get("layers", [])) != self.layers:
            raise HstapError(f"{self.store}: store layers {header.get('layers')} != the engine's capture layers "
                             f"{self.layers}")
        self.writer = StoreWriter(self.store, header, rank=self.rank, world_size=max(self.world_size, self.rank + 1),
                                  shard_tokens=self.shard_tokens, wait_s=30.0)
        self.added = set(self.writer.committed_ids())
        self.dtype = header["dtype"]

    def new_session(self, session: str) -> None:
        """A new driver run: commit what is open and drop (never close) the rank: --new may have wiped the store."""
        self.flush()
        self.writer, self.session = None, session

    def flush(self) -> None:
        if self.writer is not None and self.dirty:
            self.writer.flush()
            self.dirty = False

    def check_end(self) -> None:
        """Close this rank when a driver session ended since the last check (called when idle)."""
        now = self.end_markers()
        if now <= self.ends:
            return
        self.ends |= now
        try:
            if self.writer is None:
                self.open()  # a rank that wrote nothing this session closes too: the follower waits on every rank
            self.writer.close()
        except Exception as e:  # noqa: BLE001 - keep serving; the driver reports ranks that did not close
            log.exception("hstap: closing the store rank failed")
            self.event({"event": "error", "kind": "close", "message": f"{type(e).__name__}: {e}"})
        self.writer = None  # the next session's first sample re-opens the rank

    def drop(self, sid: str, row: int, reason: str, detail: str, session: str | None = None) -> None:
        self.stats[f"dropped_{reason}"] += 1
        self.event({"event": "dropped", "id": sid, "row": row, "reason": reason, "detail": detail,
                    **({"session": session} if session is not None else {})})

    def add(self, row: int, sid: str, ref: tuple[list[int], list[int]], ids: torch.Tensor, aux: torch.Tensor,
            final: torch.Tensor, aux_scale: torch.Tensor | None = None, final_scale: torch.Tensor | None = None) -> bool:
        """Store the states of prepared row `row` (`ref` = its input_ids and loss_mask) that the engine computed for
        tokens `ids` (T,): aux (T, K, H), final (T, H). A sample already in the store is skipped; tokens unlike the
        prepared row's are dropped with an event. Returns whether the sample was added."""
        if self.writer is None:
            self.open()
        if sid in self.added:
            self.stats["duplicates"] += 1
            return False
        ids_ref, mask = ref
        want = torch.as_tensor(ids_ref, dtype=torch.long)
        ids = ids.long()
        if ids.shape != want.shape or not torch.equal(ids, want):
            n = min(int(ids.numel()), int(want.numel()))
            bad = int((ids[:n] != want[:n]).nonzero()[0, 0]) if bool((ids[:n] != want[:n]).any()) else n
            got = f"token {int(ids[bad])}" if bad < ids.numel() else "nothing"
            self.stats["dropped_token_mismatch"] += 1
            self.event({"event": "dropped", "id": sid, "row": row, "reason": "token_mismatch",
                        "detail": f"position {bad}: the server computed {got}, the prepared set has "
                                  f"{ids_ref[bad] if bad < len(ids_ref) else 'nothing'}"})
            return False
        self.writer.add(sid, ids, torch.as_tensor(mask, dtype=torch.uint8), aux, final,  # (T,K,H), (T,H)
                        aux_scale=aux_scale, final_scale=final_scale)
        self.added.add(sid)
        self.dirty = True
        self.stats["samples"] += 1
        return True

    def add_traffic(self, sid: str, ids: torch.Tensor, mask: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                    header, aux_scale: torch.Tensor | None = None, final_scale: torch.Tensor | None = None,
                    side: dict | None = None) -> bool:
        """Store a served request (tap mode: no prepared row to check against); `header()` (a callable, made only
        when needed) creates the store if there is none. Returns whether it was added (an id already in the store is
        skipped)."""
        if self.writer is None:
            self.open(create=None if (Path(self.store) / "manifest.json").is_file() else header())
        if sid in self.added:
            self.stats["duplicates"] += 1
            return False
        # ids (T,), mask (T,), aux (T, K, H), final (T, H)
        self.writer.add(sid, ids, mask, aux, final, aux_scale=aux_scale, final_scale=final_scale, side=side)
        self.added.add(sid)
        self.dirty = True
        self.stats["samples"] += 1
        return True


STOPPED = "stopped"
"""The kind of the error event a writer thread leaves as it ends on an error (`drain`): the tap writes no more."""


def stopped_writer(store: str | os.PathLike, events_dir: str) -> str | None:
    """The message of the first "stopped" event (`STOPPED`) among STORE/events_dir's event files: a writer thread that
    ended on an error; None while every writer is running (or ended normally)."""
    for f in sorted(Path(store, events_dir).glob("r*.jsonl")):
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:  # a line being appended
                continue
            if isinstance(e, dict) and e.get("event") == "error" and e.get("kind") == STOPPED:
                return str(e.get("message"))
    return None


def drain(q: queue.Queue, flush_s: float, writer, handle) -> None:
    """An in-server writer thread's loop: `handle(item)` each queued item until None; when idle for `flush_s`, commit
    the open shard and look for the end of a session (`writer.flush()`, `writer.check_end()`). A failing item becomes
    an error event for the driver (`writer.event`); serving goes on. Whatever ends the loop otherwise (a writer that
    stopped, a `flush_s` the queue refuses) is a "stopped" error event before it propagates: the thread is gone and
    the tap writes nothing more, which the driver must report as a failure (`hstap serve-loop`: `tap_stopped`)."""
    try:
        _drain(q, flush_s, writer, handle)
    except BaseException as e:
        log.exception("hstap: the capture writer thread stopped")
        writer.event({"event": "error", "kind": STOPPED, "message": f"{type(e).__name__}: {one_line(e)}"})
        raise


def _drain(q: queue.Queue, flush_s: float, writer, handle) -> None:
    while True:
        try:
            item = q.get(timeout=flush_s)
        except queue.Empty:
            try:
                writer.flush()
                writer.check_end()
            except Exception as e:  # noqa: BLE001 - as an item's failure: an event, and serving goes on
                log.exception("hstap: the capture writer failed while idle")
                writer.event({"event": "error", "kind": "writer", "message": f"{type(e).__name__}: {e}"})
                if isinstance(e, HstapError) and "writer stopped" in str(e):
                    raise
            continue
        if item is None:
            writer.flush()
            return
        try:
            handle(item)
        except Exception as e:  # noqa: BLE001 - keep serving; the driver reads the event
            log.exception("hstap: the capture writer failed")
            writer.event({"event": "error", "kind": "writer", "message": f"{type(e).__name__}: {e}"})
            if isinstance(e, HstapError) and "writer stopped" in str(e):
                raise
