"""The writer thread of the SGLang capture hook (capture/sglang/hook.py): the pieces of requests the hook demultiplexed
are stitched into samples and handed to a `ServedWriter` (hstap/capture/served.py: the store rank, the checks against
the prepared set, events in STORE/sglang-events/ for the driver, the end of a session). The store rank is the
data-parallel scheduler's (capture/sglang/ranks.py). In tap mode the pieces of tapped requests (capture/sglang/tap.py)
become served-traffic samples when their request finishes; the first one creates the store when there is none.
"""

from __future__ import annotations

import logging

import torch

from hstap.capture.served import ServedWriter
from hstap.capture.tap import TapBudget
from hstap.capture.sglang.protocol import EVENTS_DIR
from hstap.capture.staging import staging_nbytes, staging_views
from hstap.common import HstapError

log = logging.getLogger("hstap.sglang")


class HookWriter:
    """Writer-thread state of a `CaptureHook` (capture/sglang/hook.py, passed as `hook`): pieces of requests in progress
    and the `ServedWriter` (`served`)."""

    def __init__(self, hook):
        self.hook = hook
        self.pieces: dict[str, list] = {}
        self.tpieces: dict[str, list] = {}  # tapped requests in progress: rid -> [(position, rows)]
        self.budget = TapBudget(hook.cfg.store, hook.cfg.max_store_gb) if hook.cfg.tap else None
        self._header: dict | None = None
        _, dp, dps = hook.ranks()
        self.served = ServedWriter(hook.cfg.store, hook.cfg.layers, EVENTS_DIR, rank=dp, world_size=dps,
                                   shard_tokens=hook.cfg.shard_tokens, stats=hook.stats)
        self.served.session = hook.session

    def event(self, obj: dict) -> None:
        self.served.event({"session": self.hook.session, **obj})

    def flush(self) -> None:
        """Idle: the tap's ends that found the queue full, then commit the open shard."""
        pending = self.hook.take_pending()
        if pending:
            self.handle({"actions": pending})
        self.served.flush()

    def check_end(self) -> None:
        if not self.hook.cfg.tap:  # a tapping server keeps its rank open: its samples never end
            self.served.check_end()

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
            if act[0] in ("piece", "tpiece"):
                _, rid, pos, n = act
                if act[0] == "piece":
                    self.pieces.setdefault(rid, []).append((pos, {k: v[off:off + n] for k, v in tensors.items()}))
                else:  # a copy: a view would keep the whole batch's rows alive for as long as the request runs
                    rows = {k: v[off:off + n].clone() for k, v in tensors.items()}
                    self.tpieces.setdefault(rid, []).append((pos, rows))
                off += n
                continue
            try:
                self.act(act)
            except Exception as e:  # noqa: BLE001 - one request's failure must not lose the batch's other requests
                if isinstance(e, HstapError) and "writer stopped" in str(e):
                    raise
                log.exception("hstap: a writer action failed")
                self.event({"event": "error", "kind": "writer", "message": f"{act[0]}: {type(e).__name__}: {e}"})

    def act(self, act: tuple) -> None:
        """One writer action other than rows (hook.py and tap.py say which)."""
        kind = act[0]
        if kind == "tdone":
            self.tap_finish(act[1], act[2], act[3])
        elif kind in ("tdrop", "treset"):
            self.tpieces.pop(act[1], None)
            if kind == "tdrop":
                self.event({"event": "dropped", "id": self.tap_id(act[1]), "reason": act[2], "detail": act[3]})
        elif kind == "done":
            self.finish(act[1], act[2], act[3])
        elif kind == "drop":
            _, rid, row, sid, reason, detail, session = act
            self.pieces.pop(rid, None)
            self.served.event({"event": "dropped", "id": sid, "row": row, "reason": reason, "detail": detail,
                               "session": session})
        elif kind == "reset":
            self.pieces.pop(act[1], None)
        elif kind == "session":
            self.served.new_session(act[1])
            self.pieces = {}
        elif kind == "event":
            self.served.event(act[1])

    def finish(self, rid: str, row: int, sid: str) -> None:
        pieces = sorted(self.pieces.pop(rid, []), key=lambda p: p[0])
        if self.served.writer is None:
            self.served.open()
            self.hook.store_dtype = self.served.dtype
        if sid in self.served.added:
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
        self.served.add(row, sid, (ids_ref, mask), t["input_ids"], t["aux"], t["final"],  # (T,), (T,K,H), (T,H)
                        aux_scale=t.get("aux_scale"), final_scale=t.get("final_scale"))

    def tap_id(self, rid: str) -> str:
        return f"tap-{self.hook.tap_session}-{rid}"

    def tap_finish(self, rid: str, ids: list[int], prompt_len: int) -> None:
        """A tapped request finished: its prompt + generated tokens minus the last (never fed) become a sample."""
        from hstap.store.format import store_bytes_per_token

        pieces = sorted(self.tpieces.pop(rid, []), key=lambda p: p[0])
        sid, T = self.tap_id(rid), max(prompt_len, len(ids) - 1)
        covered = 0
        for pos, t in pieces:
            if pos != covered:
                break
            covered += int(t["input_ids"].shape[0])
        if covered < T:
            hint = " (no decode step reached the hook: decode runs in CUDA graphs? start the server with " \
                   "--cuda-graph-backend-decode disabled)" \
                if covered == prompt_len and pieces else ""
            self.hook.stats["tap_dropped_incomplete"] += 1
            self.event({"event": "dropped", "id": sid, "reason": "incomplete",
                        "detail": f"states of positions 0..{covered} of {T}{hint}"})
            return
        t = {k: torch.cat([p[1][k] for p in pieces])[:T] for k in pieces[0][1]}  # (T,), (T, K, H), (T, H)
        if not all(bool(torch.isfinite(t[k].float()).all()) for k in ("aux", "final")):  # SGLang: "NaN happened"
            self.hook.stats["tap_dropped_nonfinite"] += 1
            self.event({"event": "dropped", "id": sid, "reason": "nonfinite", "detail": "NaN or inf in its states"})
            return
        want = torch.tensor(ids[:T], dtype=torch.long)
        if not torch.equal(t["input_ids"].long(), want):
            bad = int((t["input_ids"].long() != want).nonzero()[0, 0])
            self.hook.stats["tap_dropped_token_mismatch"] += 1
            self.event({"event": "dropped", "id": sid, "reason": "token_mismatch",
                        "detail": f"position {bad}: rows fed token {int(t['input_ids'][bad])}, the request has "
                                  f"{ids[bad]}"})
            return
        H = int(t["final"].shape[-1])
        if not self.budget.take(T * store_bytes_per_token(len(self.hook.cfg.layers), H, self.hook.store_dtype)):
            self.hook.stats["tap_dropped_store_full"] += 1
            return
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[prompt_len:] = 1
        if self.served.add_traffic(sid, want, mask, t["aux"], t["final"], self.header,
                                   aux_scale=t.get("aux_scale"), final_scale=t.get("final_scale")):
            self.hook.store_dtype = self.served.dtype

    def header(self) -> dict:
        """The header a tap creates its store with (only when there is none): the served model, the capture layers,
        `tap_dtype`, `contents`."""
        if self._header is None:
            import sglang

            from hstap.capture.inputs import store_header
            from hstap.capture.tap import contents_block
            from hstap.artifacts.model_dir import target_fingerprint

            c = self.hook.cfg
            engine = {"name": "sglang", "version": getattr(sglang, "__version__", "?"), "device": "server (tap)",
                      "compute_dtype": self.hook.compute_dtype}
            self._header = store_header(target_fingerprint(self.hook.tap_target), engine, c.tap_dtype, list(c.layers),
                                        {"tap": True, "store": c.store},
                                        work={"kind": "served traffic", "producer": "sglang tap", "data": None})
            self._header["contents"] = contents_block("served traffic", tap_fraction=c.tap_fraction,
                                                      max_store_gb=c.max_store_gb)
        return self._header
