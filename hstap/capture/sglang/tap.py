"""Tap mode of the SGLang capture hook (`"tap": true` in the hook's config; off unless asked): the requests of every
client are captured with their generated tokens, in the passes that serve them, and stored when they finish.

Forward-thread bookkeeping (`TapDemux`, owned by the hook in capture/sglang/hook.py), host-side lists only:
 - a request is tapped from its first prefill row at position 0 (`tapped`: a hash of its rid below `tap_fraction`). A
   request first seen later (its prefix came from the radix cache, or it started before the tap) is not tapped, nor
   are SGLang's own health checks (`GET /health` generates one token for a request `HEALTH_CHECK_<hex>`: every load
   balancer's poll would otherwise become a one-token sample, as seen on a live server);
 - its rows, in order: EXTEND chunks and the prefill part of MIXED batches (`extend_prefix_lens_cpu` says where each
   starts), then one row per decode step (DECODE: position `seq_lens_cpu[i] - 1`; MIXED: the running rows, prefix =
   length - 1). The state of the row at position t is the one that predicted token t+1, as capture stores it;
 - a gap (a row not at the next position) drops the request; a restart at position 0 (retraction) starts it over;
 - the end comes from the scheduler: `install_finish_hooks` wraps SGLang's `SchedulerOutputStreamer.stream_output`
   (every streamed request, finished ones with their `finished_reason`) and `Scheduler.send_abort_output` (requests
   ended outside the stream: aborted while queued, preempted, retracted or rejected) and hands the requests to the
   tap-mode hooks of the process (`FINISH_SINKS`). A request that finished with an abort reason (client gone, engine
   error), or outside the stream, is dropped; any other (stop token, stop string, token limit) is stored as
   `origin_input_ids + output_ids_through_stop` minus the last token (never fed, so no state; vLLM's tap keeps the
   same tokens), loss mask 1 on the generated tokens. A row computed after the end (the overlap scheduler's extra
   step) is cut off; rows missing before it drop the request (decode ran in a CUDA graph, where no Python hook runs);
 - a request not seen for `stale_s` is dropped; when the writer's queue is full, the rows of the batch's tapped
   requests are not taken (the scheduler never waits for the tap) and a request that misses rows it needs is dropped
   at its end (counted in the hook's `stats`).
Sample ids: `tap-<hook session>-<SGLang rid>` (unique across server restarts). The writer thread stores the samples
(capture/sglang/writer.py), the first one creating the store with a served-traffic header (hstap/capture/tap.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from pathlib import Path

from hstap.capture.tap import tapped
from hstap.common import HstapError

FINISH_SINKS: list = []  # this process's tap-mode hooks: sink(reqs, outside_stream: bool)
STREAMER = ("sglang.srt.managers.scheduler_components.output_streamer", "SchedulerOutputStreamer", "stream_output")
ABORTS = ("sglang.srt.managers.scheduler", "Scheduler", "send_abort_output")

NOT_TRAFFIC = ("HEALTH_CHECK",)  # rid prefixes of SGLang's own requests (sglang.srt.constants.HEALTH_CHECK_RID_PREFIX)
_DONE_KEEP = 1 << 16  # ended rids remembered (to ignore the overlap scheduler's late rows and second stream)


@dataclasses.dataclass
class _Tapped:
    next_pos: int = 0
    seen: float = 0.0
    lost: int | None = None  # the first position whose row was not taken (the writer's queue was full)


def install_finish_hooks() -> None:
    """Wrap SGLang's output streamer and abort path (module docstring) so that FINISH_SINKS see how requests end; the
    wrappers change nothing else and are installed once per process (a marker on the wrapped method)."""
    import importlib

    def after(fn, outside: bool):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            reqs = [args[1] if len(args) > 1 else kwargs.get("req")] if outside else args[0] if args else \
                kwargs.get("reqs", [])
            for sink in list(FINISH_SINKS):
                sink(reqs, outside)
            return out
        wrapper.hstap_tap = True
        return wrapper

    for (module, cls_name, name), outside in ((STREAMER, False), (ABORTS, True)):
        cls = getattr(importlib.import_module(module), cls_name)
        fn = getattr(cls, name)
        if not getattr(fn, "hstap_tap", False):
            setattr(cls, name, after(fn, outside))


def is_abort(req) -> bool:
    """Whether SGLang ended `req` by aborting it (FINISH_ABORT: client gone, bad input, engine error)."""
    reason = getattr(req, "finished_reason", None)
    if reason is None:
        return False
    try:
        return reason.to_json().get("type") == "abort"
    except Exception:  # noqa: BLE001 - an unknown reason object: judge by its class name
        return "ABORT" in type(reason).__name__.upper()


def decode_graphs_on() -> bool:
    """Whether this SGLang server replays decode batches from CUDA graphs (where no Python hook runs), by its
    published arguments; False when they cannot be read (a test, an older SGLang: the drops then say it)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        sa = get_server_args()
    except Exception:  # noqa: BLE001 - no published server arguments in this process
        return False
    if str(getattr(sa, "device", "cuda")) != "cuda":
        return False
    backend = getattr(getattr(getattr(sa, "cuda_graph_config", None), "decode", None), "backend", None)
    if backend is not None:  # the resolved config (0.5.2x): every flag that can turn decode graphs off lands here
        return str(getattr(backend, "value", backend)) != "disabled"
    return not (getattr(sa, "disable_cuda_graph", False) or getattr(sa, "disable_decode_cuda_graph", False) or
                getattr(sa, "cuda_graph_backend_decode", None) == "disabled")


def tap_target(target: str | None) -> str:
    """The served model's local directory for a tap's store header: config.target, else SGLang's --model-path."""
    if target is None:
        try:
            from sglang.srt.runtime_context import get_server_args

            target = get_server_args().model_path
        except Exception as e:  # noqa: BLE001 - no published server arguments
            raise HstapError(f"--forward-hooks: hstap: config.target: needed in tap mode ({e})") from None
    if not (Path(target) / "config.json").is_file():
        raise HstapError(f"--forward-hooks: hstap: config.target: {target} is not a local model directory (the tap's "
                         "store header fingerprints it); give the served model's directory")
    return str(target)


class TapDemux:
    """Which rows of each batch belong to which tapped request, and which requests ended (module docstring). Methods
    append writer actions: ("tpiece", rid, pos, n) with n rows, ("tdone", rid, token ids, prompt length),
    ("tdrop", rid, reason, detail)."""

    def __init__(self, fraction: float, stats: collections.Counter):
        self.fraction, self.stats = fraction, stats
        self.active: dict[str, _Tapped] = {}
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()

    def rows(self, rid: str, lo: int, n: int, p: int, actions: list, ranges: list, now: float, full: bool) -> None:
        """Rows lo..lo+n of the batch are positions p..p+n of request `rid`; `full`: the writer's queue is full."""
        if rid in self.ended:
            return  # ended: a late row of the overlap scheduler, or not tapped
        st = self.active.get(rid)
        if st is None:
            if rid.startswith(NOT_TRAFFIC):
                self.stats["tap_skipped_health_check"] += 1
                self._end(rid)
                return
            if p != 0:
                self.stats["tap_skipped_joined_late"] += 1  # radix-cache prefix, or started before the tap
                self._end(rid)
                return
            if not tapped(rid, self.fraction):
                self.stats["tap_skipped_fraction"] += 1
                self._end(rid)
                return
            st = self.active[rid] = _Tapped()
        st.seen = now
        if p == 0 and st.next_pos > 0:  # retracted and recomputed from the start
            actions.append(("treset", rid))
            st.next_pos, st.lost = 0, None
        if st.lost is not None:
            return  # rows after a lost one are of no use
        if full:  # not taken; the request is dropped at its end if it needed them (not the overlap's extra row)
            st.lost = p
            return
        if p != st.next_pos:
            self.drop(rid, actions, "gap", f"rows at position {p}, expected {st.next_pos}")
            return
        actions.append(("tpiece", rid, p, n))
        ranges.append((lo, lo + n))
        st.next_pos = p + n
        self.stats["tap_rows"] += n

    def finished(self, reqs, actions: list, outside_stream: bool = False) -> None:
        """The requests the scheduler streamed (SGLang `Req`s), or ended outside the stream; ours that ended end
        here."""
        for req in reqs:
            rid = getattr(req, "rid", None)
            if rid not in self.active:
                continue
            if outside_stream:
                self.drop(rid, actions, "aborted", "ended outside the output stream (aborted while queued, preempted, "
                                                   "retracted or rejected)")
                continue
            if not req.finished():
                continue
            if is_abort(req):
                reason = req.finished_reason
                self.drop(rid, actions, "aborted", str(getattr(reason, "message", reason))[:200])
                continue
            outs = getattr(req, "output_ids_through_stop", req.output_ids)  # past a stop (speculative decoding): cut
            ids = [int(t) for t in req.origin_input_ids] + [int(t) for t in outs]
            st, T = self.active[rid], max(len(req.origin_input_ids), len(ids) - 1)
            if st.lost is not None and st.lost < T:
                self.drop(rid, actions, "queue_full", f"rows from position {st.lost} were not taken: the writer was "
                                                      "behind, and the scheduler never waits for the tap")
                continue
            self.active.pop(rid)
            self._end(rid)
            actions.append(("tdone", rid, ids, len(req.origin_input_ids)))

    def gc(self, now: float, stale_s: float, actions: list) -> None:
        for rid, st in list(self.active.items()):
            if now - st.seen > stale_s:
                self.drop(rid, actions, "stale", f"not seen for {stale_s:.0f} s and never finished")

    def drop(self, rid: str, actions: list, reason: str, detail: str) -> None:
        self.stats[f"tap_dropped_{reason}"] += 1
        self.active.pop(rid, None)
        self._end(rid)
        actions.append(("tdrop", rid, reason, detail))

    def _end(self, rid: str) -> None:
        self.ended[rid] = None
        if len(self.ended) > _DONE_KEEP:
            self.ended.popitem(last=False)
