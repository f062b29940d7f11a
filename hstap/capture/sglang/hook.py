"""The `sglang` engine: capture hidden states inside a running SGLang server (>= 0.5.11; written against 0.5.23).

docs/engines.md has the launch command, what each flag is for, and what was and was not run. Three pieces:

1. `make_hook(config)` (this module): the `--forward-hooks` factory, attached to `logits_processor`, which SGLang calls
   positionally as `(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)`. `hidden_states` is the
   final-norm output (Llama: `residual_batch.final_norm(...)` right before the call); `aux_hidden_states` are the
   EAGLE-3 taps, packed (T, K*H) or a list of K (T, H). The hook demultiplexes the batch per request, starts an async
   copy of the rows it keeps (staged as in capture/staging.py) and hands them to a writer thread
   (capture/sglang/writer.py) feeding the same `StoreWriter` as the embedded engine.
2. `plugin()` (capture/sglang/plugin.py): the `sglang.srt.plugins` entry point. Only when `HSTAP_CAPTURE_LAYERS`
   (canonical ids) is set, it makes the target capture those layers (`set_eagle3_layers_to_capture`) before
   CUDA-graph capture, with no draft model.
3. `run_sglang_capture(cfg)` (capture/sglang/driver.py): the `hstap capture --engine sglang --server URL` driver:
   checks the server's settings, sends prefill-only `/generate` requests and waits until the hook committed each sample
   (the store is shared).
What the three agree on (the hook spec, the events directory, the plugin's variable) is capture/sglang/protocol.py;
none of them imports another. Request ids and session ends are hstap/capture/session.py's (every engine's).

Demultiplexing uses only host-side lists (never a GPU sync):
 - EXTEND and MIXED batches only (DECODE too in tap mode: capture/sglang/tap.py); IDLE / TARGET_VERIFY, DP-attention
   fake extends (`_original_forward_mode` set, or `len(rids) != batch_size`) and rows past `sum(extend_seq_lens_cpu)`
   are ignored;
 - request i owns rows `cumsum(extend_seq_lens_cpu)[i-1] + j`, prompt positions `extend_prefix_lens_cpu[i] + j`;
   chunks are stitched by prefix. A request is complete at its prepared length T (= SGLang's `orig_seq_lens[i]` for
   a prefill-only request, which 0.5.23 keeps only on the GPU); rows at positions >= T (MIXED decode rows) are ignored;
 - a first chunk that starts after position 0 got its prefix from the radix cache (never computed here): the request is
   dropped with an event in `STORE/sglang-events/`, never stored truncated;
 - only attention-TP rank 0 of each data-parallel scheduler writes, its own store rank (`parallel_ranks`); a batch
   whose aux states do not cover its tokens (captured on token-scattered ranks) is refused with an event.

Request ids: `hstap:<session>:<row>:<sha256(id)[:16]>:<attempt>`, ASCII and validated against the prepared set; sample
ids (any string) are only stored as ids, never used in paths. input_ids and loss_mask come from the prepared set
(config `data`); rows whose token ids differ are refused. A new session makes the hook re-open the store.

Tap mode (`tap: true`): every other client's requests are captured too, prompt and generated tokens, and stored when
they finish (capture/sglang/tap.py); the driver's requests are handled as above.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
import uuid
from pathlib import Path

import torch

from hstap.capture.served import Prepared
from hstap.capture.session import RID_PREFIX, decode_rid, sample_digest
from hstap.capture.sglang.protocol import ENV_LAYERS
from hstap.capture.sglang.ranks import parallel_ranks
from hstap.capture.sglang.tap import FINISH_SINKS, TapDemux, decode_graphs_on, install_finish_hooks, tap_target
from hstap.capture.sglang.writer import HookWriter
from hstap.capture.staging import PinnedPool, staging_layout, staging_pack
from hstap.capture.writer_queue import WriterQueue
from hstap.common import HstapError

log = logging.getLogger("hstap.sglang")

_FINISHED_KEEP = 1 << 16  # finished rids remembered (to ignore their decode rows / late echoes)
_DRIVEN = ("piece", "done", "drop", "reset", "session")  # writer actions of the driver's requests (they may wait)


@dataclasses.dataclass
class HookConfig:
    """The `config` object of the `--forward-hooks` spec."""
    store: str
    """Store directory (created by the driver before it sends requests; shared with the driver's machine; in tap mode
    the first tapped request creates it when it does not exist)."""
    layers: list[int]
    """Canonical layer ids the server captures (must equal the store's `layers`)."""
    data: str | None = None
    """Prepared dataset directory (hstap prepare): the hook reads input_ids and loss_mask of each driver sample from it.
    Required unless `tap` (a tap-only server has no driver)."""
    tap: bool = False
    """Tap mode: also capture every other client's requests, prompt + generated tokens, stored when they finish
    (capture/sglang/tap.py). Needs decode outside CUDA graphs (--cuda-graph-backend-decode disabled) and full
    prefills (--disable-radix-cache, else requests with a cached prefix are not tapped)."""
    tap_fraction: float = 1.0
    """Tap mode: the fraction of requests kept (chosen by a hash of the request id)."""
    tap_dtype: str = "bf16"
    """Tap mode: the store's dtype when the tap creates it (bf16, fp8 or fp32)."""
    max_store_gb: float | None = None
    """Tap mode: stop adding samples while the store is this large (GB on disk; null: unbounded). Shards that a
    `train --follow --keep-shards` consumer deletes free room again."""
    target: str | None = None
    """Tap mode: the served model's directory, for the store header's target fingerprint; default: SGLang's own
    --model-path."""
    queue_size: int = 16
    """Batches waiting for the writer thread before the scheduler waits (backpressure)."""
    flush_s: float = 1.0
    """Commit the open shard after this many idle seconds (the driver sees every sample without a full shard)."""
    shard_tokens: int = 1 << 20
    """Tokens per shard file (as `hstap capture --shard-tokens`)."""
    stale_s: float = 1800.0
    """Forget a request not seen for this long (aborted by its client); it is logged as dropped."""
    attn_tp_rank: int | None = None
    """Override the attention-TP rank (tests); default: read from SGLang."""
    dp_rank: int | None = None
    """Override the store rank (the data-parallel scheduler's: `parallel_ranks`); default: read from SGLang."""
    dp_size: int | None = None
    """Override the store's rank count (data-parallel schedulers); default: read from SGLang."""

    @classmethod
    def from_dict(cls, cfg: dict) -> "HookConfig":
        if not isinstance(cfg, dict):
            raise HstapError(f"--forward-hooks: hstap: config must be an object, got {type(cfg).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - names)
        missing = [k for k in ("store", "layers") + (() if cfg.get("tap") else ("data",)) if k not in cfg]
        if unknown or missing:
            raise HstapError(f"--forward-hooks: hstap: config: unknown keys {unknown}, missing keys {missing}")
        c = cls(**cfg)
        if not isinstance(c.layers, list) or not c.layers or not all(isinstance(i, int) for i in c.layers):
            raise HstapError(f"--forward-hooks: hstap: config.layers: expected a list of canonical ids, "
                             f"got {c.layers!r}")
        if not 0.0 < float(c.tap_fraction) <= 1.0 or c.tap_dtype not in ("bf16", "fp8", "fp32"):
            raise HstapError("--forward-hooks: hstap: config: tap_fraction must be in (0, 1], tap_dtype bf16|fp8|fp32")
        return c


@dataclasses.dataclass
class _Active:
    row: int
    sid: str
    T: int
    next_pos: int = 0
    seen: float = 0.0


class CaptureHook:
    """The forward hook (module docstring). `stats` counts what it saw; `close()` flushes and stops the thread. Its
    writer thread (a `HookWriter`) reads `data` (the prepared set), `session` and `pool` and sets `store_dtype`."""

    def __init__(self, config: dict | HookConfig):
        self.cfg = config if isinstance(config, HookConfig) else HookConfig.from_dict(config)
        if self.cfg.data is not None and not (Path(self.cfg.data) / "meta.json").is_file():
            raise HstapError(f"--forward-hooks: hstap: config.data: {self.cfg.data} is not a prepared dataset "
                             "(no meta.json)")
        self.K = len(self.cfg.layers)
        self.stats: collections.Counter = collections.Counter()
        self._ranks: tuple[int, int, int] | None = None
        self.data: Prepared | None = None
        self._active: dict[str, _Active] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.session: str | None = None
        self.store_dtype: str | None = None
        self._last_gc = time.monotonic()
        self.queue = WriterQueue(self.cfg.queue_size, self._writer_loop, "hstap-sglang-writer")
        self._side = None
        self.pool = None
        self._disabled: str | None = None
        self._warned: set[tuple] = set()
        self._hint: str | None = None  # session of the latest hstap request seen (keys the one-time notes)
        self._lock = threading.Lock()
        self.tap = TapDemux(float(self.cfg.tap_fraction), self.stats) if self.cfg.tap else None
        self.tap_session = uuid.uuid4().hex[:12]  # tapped sample ids: unique across server restarts
        self.compute_dtype: str | None = None  # the engine's, from the first batch's states (the tap's store header)
        self._pending: list = []  # tap actions that found the writer's queue full (sent with the next item)
        if self.tap is not None:
            self.store_dtype = _store_dtype(self.cfg.store) or self.cfg.tap_dtype
            self.tap_target = tap_target(self.cfg.target)
            install_finish_hooks()
            FINISH_SINKS.append(self.finished)
            if decode_graphs_on():
                log.warning("hstap tap: this server replays decode batches from CUDA graphs, where no hook runs: every "
                            "tapped request will be dropped; start it with --cuda-graph-backend-decode disabled")

    # -- forward thread ------------------------------------------------------------------------------------------------

    def __call__(self, module, inputs, output):
        try:
            self._forward(inputs)
        except Exception as e:  # noqa: BLE001 - never take the server down; the driver sees the event
            self.stats["hook_errors"] += 1
            self._note("hook_error", f"{type(e).__name__}: {e}")
            log.exception("hstap capture hook failed")
        return None

    def ranks(self) -> tuple[int, int, int]:
        if self._ranks is None:
            tp, dp, dps = parallel_ranks()
            c = self.cfg
            self._ranks = (tp if c.attn_tp_rank is None else c.attn_tp_rank, dp if c.dp_rank is None else c.dp_rank,
                           dps if c.dp_size is None else c.dp_size)
        return self._ranks

    def _note(self, kind: str, message: str) -> None:
        """Tell the driver, once per kind and session (an event line in the store, written by the writer thread)."""
        key = (self._hint, kind)
        if key not in self._warned:
            self._warned.add(key)
            log.warning("hstap capture hook: %s: %s", kind, message)
            self._put({"actions": [("event", {"event": "error", "kind": kind, "message": message,
                                              "session": self._hint})]})

    def _forward(self, inputs) -> None:
        if self._disabled or self.ranks()[0] != 0:  # TP ranks replicate the residual stream: attention-TP rank 0 writes
            return
        self.queue.start()  # now, not at the first sample: a DP rank without samples must still see a session end
        if len(inputs) < 4:
            self._note("signature", f"logits_processor got {len(inputs)} positional inputs, expected >= 4 "
                                    "(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)")
            return
        input_ids, hidden, fb = inputs[0], inputs[1], inputs[3]
        aux = inputs[4] if len(inputs) > 4 else None
        mode = getattr(getattr(fb, "forward_mode", None), "name", None)
        if mode not in ("EXTEND", "MIXED") and not (self.tap is not None and mode == "DECODE"):
            self.stats[f"skipped_{str(mode).lower()}"] += 1
            return
        rids, bs = getattr(fb, "rids", None), getattr(fb, "batch_size", None)
        if getattr(fb, "_original_forward_mode", None) is not None or rids is None or len(rids) != bs:
            self.stats["skipped_dp_fake"] += 1  # DP attention: an idle rank's dummy extend (or no rids before 0.5.10)
            return
        if mode == "DECODE":  # one row per request, at its length before this step
            seq = getattr(fb, "seq_lens_cpu", None)
            ext, pre = [1] * bs, None if seq is None else [int(n) - 1 for n in seq]
        else:
            ext, pre = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        if ext is None or pre is None or len(ext) != bs or len(pre) != bs:
            self.stats["skipped_malformed"] += 1
            return
        ours = next((d for d in map(decode_rid, rids) if d is not None), None)
        if ours is None and self.tap is None:
            self.stats["batches_foreign"] += 1  # no request of ours in this batch
            return
        if ours is not None:
            self._hint = ours[0]
        if aux is None or (isinstance(aux, (list, tuple)) and len(aux) == 0):
            self._note("no_aux", f"the model passes no aux hidden states: start the server with {ENV_LAYERS}="
                                 f"{','.join(map(str, self.cfg.layers))} (hstap plugin) or "
                                 "--enable-return-aux-hidden-states")
            return
        H = int(hidden.shape[-1])
        width = sum(int(a.shape[-1]) for a in aux) if isinstance(aux, (list, tuple)) else int(aux.shape[-1])
        if width != self.K * H:
            self._note("aux_width", f"aux hidden states are {width} wide, expected {self.K} layers x {H}: "
                                    f"the server captures other layers than config.layers={self.cfg.layers} "
                                    f"(set by {ENV_LAYERS} or --return-aux-hidden-state-layer-ids; SGLang never "
                                    "captures the last layer's output, canonical N-1)")
            return
        total = sum(int(n) for n in ext)
        if int(hidden.shape[0]) < total:
            self._note("rows", f"hidden_states has {hidden.shape[0]} rows for {total} extend tokens")
            return
        aux_rows = min(int(a.shape[0]) for a in aux) if isinstance(aux, (list, tuple)) else int(aux.shape[0])
        if aux_rows < total:  # each rank captured its slice of the tokens: no sample can be stitched from it
            self._note("aux_rows", f"the aux hidden states have {aux_rows} rows for {total} extend tokens: this "
                                   "server scatters a batch's tokens over its ranks where SGLang does not gather the "
                                   "aux capture (attention-TP input scattering, context or sequence parallelism)")
            return
        self.stats["batches"] += 1
        if self.compute_dtype is None:
            self.compute_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
                hidden.dtype, str(hidden.dtype))
        actions, ranges = self._demux(rids, [int(n) for n in ext], [int(p) for p in pre])
        if not actions:
            return
        item: dict = {"actions": actions}
        if ranges:
            item.update(self._copy(ranges, input_ids, hidden, aux, H))
        self._put(item)

    def _demux(self, rids, ext: list[int], pre: list[int]):
        """Host-side bookkeeping: which rows of this batch are which sample positions. Returns (actions, ranges)."""
        now = time.monotonic()
        actions: list = []
        ranges: list[tuple[int, int]] = []
        start = 0
        full = self.tap is not None and self.queue.full()  # tapped rows never make the scheduler wait
        for rid, n, p in zip(rids, ext, pre):
            lo, start = start, start + n
            if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
                if self.tap is not None and isinstance(rid, str):
                    self.tap.rows(rid, lo, n, p, actions, ranges, now, full)
                continue  # another client's request
            if rid in self._finished:
                continue  # a finished request's decode row (MIXED) or a late duplicate
            st = self._active.get(rid)
            if st is None:
                st = self._start(rid, actions, now)
                if st is None:
                    continue
            st.seen = now
            if p == 0 and st.next_pos > 0:  # the scheduler restarted the request (retraction): start over
                actions.append(("reset", rid))
                st.next_pos = 0
            if p != st.next_pos:
                hit = st.next_pos == 0
                self._drop(rid, st, actions, "prefix_cache_hit" if hit else "gap",
                           f"chunk starts at position {p}, expected {st.next_pos}" +
                           (" (its prefix came from the radix cache and was never computed)" if hit else ""))
                continue
            take = min(n, st.T - p)  # rows past the prompt are generated tokens (decode rows of a MIXED batch)
            if take <= 0:
                continue
            actions.append(("piece", rid, p, take))
            ranges.append((lo, lo + take))
            st.next_pos = p + take
            self.stats["rows"] += take
            if st.next_pos >= st.T:
                actions.append(("done", rid, st.row, st.sid))
                self._finish(rid)
        if now - self._last_gc > 60.0:
            self._last_gc = now
            for rid, st in list(self._active.items()):
                if now - st.seen > self.cfg.stale_s:
                    self._drop(rid, st, actions, "stale",
                               f"not seen for {self.cfg.stale_s:.0f} s (aborted by its client?)")
            if self.tap is not None:
                self.tap.gc(now, self.cfg.stale_s, actions)
        return actions, ranges

    def finished(self, reqs, outside_stream: bool = False) -> None:
        """Tap mode: the requests SGLang's scheduler streamed or ended outside the stream (`FINISH_SINKS`, called in
        the scheduler thread, capture/sglang/tap.py); those of ours that ended are stored or dropped."""
        try:
            actions: list = []
            self.tap.finished(reqs, actions, outside_stream)
            if actions:
                self._put({"actions": actions})
        except Exception as e:  # noqa: BLE001 - never take the server down
            self.stats["hook_errors"] += 1
            self._note("hook_error", f"{type(e).__name__}: {e}")
            log.exception("hstap tap: finishing requests failed")

    def _start(self, rid: str, actions: list, now: float) -> _Active | None:
        dec = decode_rid(rid)
        if self.data is None and self.cfg.data is not None:
            self.data = Prepared(self.cfg.data)
        if dec is not None and self.data is not None and dec[1] < len(self.data) and \
                sample_digest(self.data.sample_id(dec[1])) == dec[2]:
            session, row, _ = dec
            if session != self.session:  # a new driver run: the writer thread re-opens the store
                self.session = session
                self.store_dtype = _store_dtype(self.cfg.store)  # fp8 is quantized on the device, before the copy
                actions.append(("session", session))
            st = self._active[rid] = _Active(row, self.data.sample_id(row), self.data.lengths[row], 0, now)
            return st
        self.stats["bad_rid"] += 1
        self._finish(rid)
        actions.append(("event", {"event": "dropped", "reason": "bad_rid", "rid": rid[:200], "session": self._hint,
                                  "detail": "rid does not name a sample of config.data (another prepared set?)"}))
        return None

    def _drop(self, rid: str, st: _Active, actions: list, reason: str, detail: str) -> None:
        self.stats[f"dropped_{reason}"] += 1
        actions.append(("drop", rid, st.row, st.sid, reason, detail, self.session))
        self._finish(rid)

    def _finish(self, rid: str) -> None:
        self._active.pop(rid, None)
        self._finished[rid] = None
        if len(self._finished) > _FINISHED_KEEP:
            self._finished.popitem(last=False)

    def _copy(self, ranges: list[tuple[int, int]], input_ids, hidden, aux, H: int) -> dict:
        """Gather this batch's kept rows and start their device-to-host copy (async on CUDA)."""
        def rows(t):  # (R, ...) on t's device
            return t[ranges[0][0]:ranges[0][1]] if len(ranges) == 1 else torch.cat([t[a:b] for a, b in ranges])

        R = sum(b - a for a, b in ranges)
        if isinstance(aux, (list, tuple)):
            a = torch.stack([rows(x) for x in aux], dim=1)  # (R, K, H)
        else:
            a = rows(aux).reshape(R, self.K, H)  # (R, K*H) -> (R, K, H)
        t = {"input_ids": rows(input_ids).to(torch.int32), "aux": a, "final": rows(hidden)}  # (R,), (R,K,H), (R,H)
        if self.store_dtype == "fp8":  # quantize where the data is: halves the D2H bytes
            from hstap.store.fp8 import quantize_fp8

            t["aux"], t["aux_scale"] = quantize_fp8(t["aux"])  # (R, K, H) fp8, (R, K)
            t["final"], t["final_scale"] = quantize_fp8(t["final"])  # (R, H) fp8, (R,)
        dev = hidden.device
        if dev.type != "cuda":
            return {"tensors": {k: v.clone() if len(ranges) == 1 else v for k, v in t.items()}}
        t = {k: v.contiguous() for k, v in t.items()}
        if self._side is None:
            self._side, self.pool = torch.cuda.Stream(device=dev), PinnedPool()
        layout, nbytes = staging_layout(t)
        buf = self.pool.acquire(nbytes)  # (cap,) uint8, pinned
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))  # rows are complete on the compute stream once this fires
        with torch.cuda.stream(self._side):
            self._side.wait_event(ready)  # the side stream waits, the scheduler's stream goes on
            staging_pack(buf, t, layout, non_blocking=True)  # D2H into pinned memory
            for x in t.values():
                x.record_stream(self._side)  # keep x's memory until the copy ran
            done = torch.cuda.Event(blocking=True)
            done.record(self._side)
        return {"done": done, "buf": buf, "layout": layout}

    def _put(self, item: dict) -> None:
        self.queue.start()
        pending = self.take_pending()  # tap actions that found the queue full go first, in order
        if pending:
            item = {**item, "actions": pending + item["actions"]}
        if self.tap is not None and not any(a[0] in _DRIVEN for a in item["actions"]):
            # tap-only: never make the scheduler wait (no rows are taken while the queue is full: _demux)
            if not self.queue.put(item, wait=False):  # an end or an event (no rows): the writer takes it when idle
                with self._lock:
                    self._pending = item["actions"] + self._pending
            return
        if not self.queue.put(item):  # blocks only while queue_size batches wait for storage (back-pressure)
            self._disabled = "writer thread stopped"

    def take_pending(self) -> list:
        """The tap actions waiting for queue space (emptied); the writer thread takes them when idle."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def close(self, timeout: float = 60.0) -> None:
        """Commit everything handed over so far and stop the writer thread (tests; atexit in a server). Gives up
        after `timeout` s when the writer cannot drain (a store waiting for a consumer's room)."""
        if self.finished in FINISH_SINKS:
            FINISH_SINKS.remove(self.finished)
        if not self.queue.close(timeout):
            log.error("hstap capture hook: the writer did not drain in %.0f s; closing without it", timeout)

    # -- writer thread -------------------------------------------------------------------------------------------------

    def _writer_loop(self) -> None:
        from hstap.capture.served import drain

        w = HookWriter(self)
        try:
            drain(self.queue.items, self.cfg.flush_s, w, w.handle)
        except HstapError as e:  # the store writer stopped (a disk error): the hook stops handing work over
            self._disabled = str(e)


def _store_dtype(store: str) -> str | None:
    try:
        return json.loads((Path(store) / "manifest.json").read_bytes()).get("dtype")
    except (OSError, ValueError):
        return None  # no store yet: the writer thread reports it when it tries to open it


def make_hook(config: dict):
    """`--forward-hooks` factory: `{"hook_factory": "hstap.capture.sglang.hook:make_hook", "config": {...}}` (HookConfig)."""
    import atexit

    hook = CaptureHook(config)
    atexit.register(hook.close, 10.0)
    return hook
