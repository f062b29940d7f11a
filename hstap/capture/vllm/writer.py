"""The writer thread of hstap's vLLM connector (capture/vllm/connector.py), in vLLM's worker process: finished requests
-> store samples, through a `ServedWriter` (hstap/capture/served.py: the store rank, events in STORE/vllm-events/,
the end of a session).

- A driver's request (its hstap request id in kv_transfer_params): the tokens must equal the prepared row the id names;
  input_ids and loss_mask come from the prepared set; the store is the one the driver created.
- A tapped request (tap mode, any client): input_ids = its prompt + the generated tokens it fed, loss_mask = 1 on the
  generated ones, sample id `tap-<server session>-<vLLM request id>`; the first one creates the store (header: the
  served model, the capture layers, `tap_dtype`, `contents` = served traffic, hstap/capture/tap.py). Bounded: a full
  queue or a store past `max_store_gb` drops the request (counted in `stats`), so serving never waits for the tap.
- `final` = the target's final RMSNorm applied to the last captured slot (hstap/capture/vllm/norm.py), in the
  engine's dtype, as `--engine hf` stores it.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

import torch

from hstap.capture.session import decode_rid, exclusive_lock, sample_digest
from hstap.capture.tap import TapBudget
from hstap.capture.vllm.protocol import EVENTS_DIR, ConnectorConfig
from hstap.capture.writer_queue import WriterQueue

log = logging.getLogger("hstap.vllm")


def _rank_lock(store: str):
    """Hold STORE/vllm-events/rank000.lock for this writer's life: two vLLM processes (an engine left over from a
    killed run, say) never write store rank 0 at once."""
    d = Path(store) / EVENTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    return exclusive_lock(d / "rank000.lock", f"{store}: another vLLM process is writing store rank 0 (it holds "
                                              f"{d / 'rank000.lock'}); stop it first")


class VllmWriter:
    """One thread, a bounded queue of (save, rows (T, L, H) or None, CUDA event or None) (module docstring)."""

    def __init__(self, cfg: ConnectorConfig, layers: list[int], model_dir: str, model_dtype: str):
        from hstap.capture.served import Prepared, ServedWriter
        from hstap.capture.vllm.norm import load_final_norm

        self.cfg, self.layers, self.model_dir, self.model_dtype = cfg, layers, model_dir, model_dtype
        self.served = ServedWriter(cfg.store, layers, EVENTS_DIR, shard_tokens=cfg.shard_tokens)
        self.stats = self.served.stats
        self.data = Prepared(cfg.data) if cfg.data else None
        self.norm = load_final_norm(model_dir)[:2]  # the served model's own final norm: (weight (H,), eps)
        self.session = uuid.uuid4().hex[:12]  # tapped sample ids: unique across server restarts
        self.budget = TapBudget(cfg.store, cfg.max_store_gb)
        self._lock = _rank_lock(cfg.store)
        self.queue = WriterQueue(cfg.queue_size, self._loop, "hstap-vllm-writer")
        self.queue.start()

    def put(self, item) -> None:
        if item[0].rid is None:  # tapped: never make the server wait
            if not self.queue.put(item, wait=False):
                self.stats["tap_dropped_queue_full"] += 1
            return
        if not (self.queue.alive() and self.queue.put(item)):  # a driver's request waits for room
            log.error("hstap: the writer thread stopped; request %s is not stored", item[0].rid)

    def close(self, timeout: float = 60.0) -> None:
        """Commit everything queued so far and stop the thread (vLLM's shutdown)."""
        self.queue.close(timeout)

    def _loop(self) -> None:
        from hstap.capture.served import drain

        try:  # below the engine's threads where cores are short; the shard writes' hashing threads inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass
        drain(self.queue.items, self.cfg.flush_s, self.served, self._handle)

    def _handle(self, item) -> None:
        save, rows, event = item
        if event is not None:
            event.synchronize()  # the device-to-host copy landed
        (self._driven if save.rid is not None else self._tapped)(save, rows)

    def _final(self, rows: torch.Tensor) -> torch.Tensor:
        from hstap.capture.vllm.norm import rms_norm

        return rms_norm(rows[:, -1], *self.norm)  # (T, H), the engine's dtype

    def _driven(self, save, rows) -> None:
        w = self.served
        dec = decode_rid(save.rid)
        if self.data is None or dec is None or dec[1] >= len(self.data) or \
                sample_digest(self.data.sample_id(dec[1])) != dec[2]:
            w.event({"event": "dropped", "reason": "bad_rid", "rid": str(save.rid)[:200],
                     "detail": "the request id names no sample of the prepared set (another prepared set?)"})
            return
        session, row, _ = dec
        sid = self.data.sample_id(row)
        if session != w.session:
            w.new_session(session)
        if rows is None:
            w.drop(sid, row, "incomplete", "the request ended before its prompt was computed (aborted)")
            return
        w.add(row, sid, self.data.sample(row), torch.as_tensor(save.token_ids), rows[:, :-1], self._final(rows))

    def _tapped(self, save, rows) -> None:
        from hstap.store.format import store_bytes_per_token

        side = self._side(save)
        T = len(save.token_ids) + (0 if side is None else int(side["input_ids"].numel()))  # rows stored
        if not self.budget.take(T * store_bytes_per_token(len(self.layers), int(rows.shape[-1]), self.cfg.tap_dtype)):
            self.stats["tap_dropped_store_full"] += 1
            return
        mask = torch.zeros(len(save.token_ids), dtype=torch.uint8)
        mask[save.prompt_len:] = 1
        self.served.add_traffic(f"tap-{self.session}-{save.req_id}", torch.as_tensor(save.token_ids), mask,
                                rows[:, :-1], self._final(rows), self._header, side=side)

    def _side(self, save) -> dict | None:
        """A tapped request's side branches for the store (the tap beside EAGLE-3 keeps them); here none."""
        return None

    def _header(self) -> dict:
        import vllm

        from hstap.capture.inputs import store_header
        from hstap.capture.tap import contents_block
        from hstap.artifacts.model_dir import target_fingerprint

        tb = target_fingerprint(self.model_dir)
        engine = {"name": "vllm", "version": vllm.__version__, "device": "server (tap)",
                  "compute_dtype": {"float32": "fp32", "bfloat16": "bf16"}.get(self.model_dtype, self.model_dtype)}
        h = store_header(tb, engine, self.cfg.tap_dtype, self.layers, {"tap": True, "store": self.cfg.store},
                         work={"kind": "served traffic", "producer": "vllm tap", "data": None})
        h["contents"] = contents_block("served traffic", tap_fraction=self.cfg.tap_fraction,
                                       max_store_gb=self.cfg.max_store_gb)
        return h
