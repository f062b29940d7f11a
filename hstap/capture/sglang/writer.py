"""The writer thread of the SGLang capture hook (capture/sglang/hook.py): the pieces of requests the hook demultiplexed
are stitched into samples, checked against the prepared set and added to a `StoreWriter`; drops and errors go to event
files in STORE/sglang-events/ (one per DP rank and process), which the driver (capture/sglang/driver.py) reads.

Only this thread touches the store. It opens it lazily, on the first finished sample of a driver session, with the
header the driver wrote (the hook's layers must equal the store's), as store rank = the attention-DP rank. When the
driver ends its session (`sglang_protocol.end_marker`), the thread closes its rank (`closed: true` in its part file,
opening it first if it wrote nothing), so that a trainer following the store knows that writing has ended.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from hstap.capture.sglang.protocol import END_PREFIX, EVENTS_DIR
from hstap.capture.staging import staging_nbytes, staging_views
from hstap.common import HstapError

log = logging.getLogger("hstap.sglang")

_MANIFEST_ONLY = ("format", "version", "created", "created_unix", "shards")  # manifest keys that are not header keys


class HookWriter:
    """Writer-thread state of a `CaptureHook` (capture/sglang/hook.py, passed as `hook`): pieces of requests in progress,
    the StoreWriter, the event file."""

    def __init__(self, hook):
        self.hook = hook
        self.pieces: dict[str, list] = {}
        self.writer = None
        self.added: set[str] = set()
        self.dirty = False
        self.ends = self.end_markers()  # sessions that ended before this thread started are not ours to close

    def end_markers(self) -> set[str]:
        try:
            return {f.name for f in (Path(self.hook.cfg.store) / EVENTS_DIR).iterdir() if f.name.startswith(END_PREFIX)}
        except OSError:
            return set()

    def event(self, obj: dict) -> None:
        rank = self.hook.ranks()[1]
        d = Path(self.hook.cfg.store) / EVENTS_DIR
        try:
            d.mkdir(parents=True, exist_ok=True)
            with open(d / f"r{rank:03d}-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps({"t": round(time.time(), 3), "session": self.hook.session, **obj}) + "\n")
                f.flush()
        except OSError:
            log.exception("hstap: cannot write an event to %s", d)

    def open(self) -> None:
        from hstap.store.reader import open_store
        from hstap.store.writer import StoreWriter

        _, dp, dps = self.hook.ranks()
        s = open_store(self.hook.cfg.store)  # created by the driver; HstapError if it is not there
        header = {k: v for k, v in s.header.items() if k not in _MANIFEST_ONLY}
        if list(header.get("layers", [])) != list(self.hook.cfg.layers):
            raise HstapError(f"{self.hook.cfg.store}: store layers {header.get('layers')} != hook config.layers "
                             f"{self.hook.cfg.layers}")
        self.writer = StoreWriter(self.hook.cfg.store, header, rank=dp, world_size=max(dps, dp + 1),
                                  shard_tokens=self.hook.cfg.shard_tokens, wait_s=30.0)
        self.added = set(self.writer.committed_ids())
        self.hook.store_dtype = header["dtype"]

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

    def handle(self, item: dict) -> None:
        tensors = item.get("tensors")
        if "done" in item:
            item["done"].synchronize()  # the D2H copy landed
            buf, layout = item["buf"], item["layout"]
            nbytes = staging_nbytes(layout)
            tensors = staging_views(buf[:nbytes].clone(), layout)  # own it: the pinned buffer goes back to the pool
            self.hook.pool.release(buf)
        off = 0
        for act in item["actions"]:
            kind = act[0]
            if kind == "piece":
                _, rid, pos, n = act
                self.pieces.setdefault(rid, []).append((pos, {k: v[off:off + n] for k, v in tensors.items()}))
                off += n
            elif kind == "done":
                self.finish(act[1], act[2], act[3])
            elif kind == "drop":
                _, rid, row, sid, reason, detail, session = act
                self.pieces.pop(rid, None)
                self.event({"event": "dropped", "id": sid, "row": row, "reason": reason, "detail": detail,
                            "session": session})
            elif kind == "reset":
                self.pieces.pop(act[1], None)
            elif kind == "session":
                self.flush()
                self.writer, self.pieces = None, {}  # drop, never close: --new may have wiped the old store
            elif kind == "event":
                self.event(act[1])

    def finish(self, rid: str, row: int, sid: str) -> None:
        pieces = sorted(self.pieces.pop(rid, []), key=lambda p: p[0])
        if self.writer is None:
            self.open()
        if sid in self.added:
            self.hook.stats["duplicates"] += 1
            return
        ids_ref, mask = self.hook.data.sample(row)
        T = len(ids_ref)
        pos = [p for p, _ in pieces]
        lens = [int(t["input_ids"].shape[0]) for _, t in pieces]
        gaps = any(pos[i] + lens[i] != pos[i + 1] for i in range(len(pos) - 1))
        if not pieces or pos[0] != 0 or gaps or sum(lens) != T:
            self.event({"event": "dropped", "id": sid, "row": row, "reason": "incomplete",
                        "detail": f"chunks at {pos} of lengths {lens} do not cover 0..{T}"})
            return
        t = {k: (pieces[0][1][k] if len(pieces) == 1 else torch.cat([p[1][k] for p in pieces])) for k in pieces[0][1]}
        ids = t["input_ids"].long()  # (T,)
        if not torch.equal(ids, torch.as_tensor(ids_ref, dtype=torch.long)):
            bad = int((ids != torch.as_tensor(ids_ref, dtype=torch.long)).nonzero()[0, 0])
            self.hook.stats["dropped_token_mismatch"] += 1
            self.event({"event": "dropped", "id": sid, "row": row, "reason": "token_mismatch",
                        "detail": f"position {bad}: the server computed token {int(ids[bad])}, the prepared set has "
                                  f"{ids_ref[bad]}"})
            return
        self.writer.add(sid, ids, torch.as_tensor(mask, dtype=torch.uint8), t["aux"], t["final"],  # (T,K,H), (T,H)
                        aux_scale=t.get("aux_scale"), final_scale=t.get("final_scale"))
        self.added.add(sid)
        self.dirty = True
        self.hook.stats["samples"] += 1
