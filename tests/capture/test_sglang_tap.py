"""Tap mode of the SGLang hook on the real `sglang` package: real ForwardBatch / ForwardMode (EXTEND, MIXED and DECODE
batches laid out as SGLang's scheduler lays them out), SGLang's real LogitsProcessor with the hook attached by its own
`register_forward_hooks`, real `Req`s with SGLang's finish reasons streamed through SGLang's real
`SchedulerOutputStreamer.stream_output` (and ended outside the stream through its `Scheduler.send_abort_output`),
writing a real store.

Every row's states are a function of (request, position), so each stored sample can be checked row by row."""

from __future__ import annotations

import importlib.util
import json
import uuid
import zlib

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # installed but broken must fail, not skip: no importorskip
    pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23, see docs/engines.md)",
                allow_module_level=True)

from helpers.sglang import H, LAYERS, forward_batch, logits_root  # noqa: E402

from hstap.capture.sglang.hook import CaptureHook  # noqa: E402
from hstap.capture.sglang.protocol import EVENTS_DIR, hook_spec  # noqa: E402
from hstap.capture.sglang.tap import FINISH_SINKS  # noqa: E402
from hstap.capture.tap import tapped  # noqa: E402
from hstap.store.reader import open_store  # noqa: E402



def states(rid: str, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (aux (K*H,), final (H,)) the 'engine' computes for request `rid` at position `pos`."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rid}:{pos}".encode()))
    return torch.randn(len(LAYERS) * H, generator=g), torch.randn(H, generator=g)


def real_streamer_and_scheduler():
    """SGLang's SchedulerOutputStreamer, and its Scheduler's abort path, with recording sockets."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sent = Sent()
    streamer = SchedulerOutputStreamer(
        send_to_detokenizer=sent, tree_cache=None, server_args=get_server_args(), is_generation=True,
        spec_algorithm=SpeculativeAlgorithm.NONE, disaggregation_mode=DisaggregationMode.NULL,
        enable_hicache_storage=lambda: False)
    scheduler = object.__new__(Scheduler)  # only its abort path runs: the sockets it sends on
    scheduler.rust_server, scheduler.ipc_channels = None, SimpleNamespace(send_to_tokenizer=sent)
    return streamer, scheduler, sent


def make_req(rid: str, prompt: list[int], outputs: list[int], reason=None):
    """A real SGLang Req: its prompt, the tokens it generated so far and (when finished) why it finished."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=64))
    req.output_ids.extend(outputs)
    req.finished_reason = reason
    return req


class Sent:
    """The scheduler's sockets to the detokenizer and the tokenizer: records what SGLang would send."""

    def __init__(self):
        self.sent = []

    def send_output(self, *payload):
        self.sent.append(payload)


class TapRig:
    """One tap-mode hook on one LogitsProcessor; `step` runs one forward pass, `stream` streams requests through
    SGLang's own output streamer, `abort` ends one through its scheduler's abort path."""

    def __init__(self, tmp, target, data=None, **cfg):
        from sglang.srt.model_executor.hook_manager import register_forward_hooks
        from transformers import AutoConfig

        self.store = tmp / f"tap-{uuid.uuid4().hex[:6]}"
        cfg = {"tap": True, "tap_dtype": "fp32", "flush_s": 0.05, "queue_size": 4096, **cfg}  # a full queue drops
        spec = json.loads(json.dumps([hook_spec(self.store, data, LAYERS, **cfg)]))
        self.root = logits_root(AutoConfig.from_pretrained(target))
        register_forward_hooks(self.root, spec)
        (self.hook,) = self.root.logits_processor._forward_hooks.values()
        assert isinstance(self.hook, CaptureHook) and self.hook.finished in FINISH_SINKS
        self.streamer, self.scheduler, self.sent = real_streamer_and_scheduler()

    def step(self, mode: str, entries: list[tuple[str, list[int], int]]):
        """entries: (rid, the tokens fed, their first position), in the batch's order."""
        ids, aux, fin = [], [], []
        for rid, toks, p in entries:
            for j, t in enumerate(toks):
                a, f = states(rid, p + j)
                ids.append(t), aux.append(a), fin.append(f)
        ids_t = torch.tensor(ids, dtype=torch.long)  # (R,)
        a, f = torch.stack(aux), torch.stack(fin)  # (R, K*H), (R, H)
        rids = [e[0] for e in entries]
        if mode == "DECODE":
            batch = forward_batch(mode, rids, None, None, ids_t, seq_lens=[p + 1 for _, _, p in entries])
        else:
            batch = forward_batch(mode, rids, [len(t) for _, t, _ in entries], [p for *_, p in entries], ids_t)
        out = self.root.logits_processor(ids_t, f, self.root.lm_head, batch, a)
        assert out.next_token_logits is not None  # the real LogitsProcessor ran to the end

    def stream(self, reqs):
        from sglang.srt.runtime_context import get_parallel

        with get_parallel().override(dp_rank=0, attn_tp_rank=0, tp_rank=0):  # a single-GPU server's scheduler
            self.streamer.stream_output(reqs, False)

    def abort(self, req):
        from sglang.srt.managers.io_struct import AbortReq

        self.scheduler.send_abort_output(AbortReq(rid=req.rid), req)

    def finish(self):
        self.hook.close()
        evs = []
        for p in sorted((self.store / EVENTS_DIR).glob("*.jsonl")) if (self.store / EVENTS_DIR).is_dir() else []:
            evs += [json.loads(x) for x in p.read_text().splitlines()]
        return evs

    def assert_sample(self, store, rid: str, prompt: list[int], outputs: list[int]):
        s = store[store.index_of(f"tap-{self.hook.tap_session}-{rid}")]
        toks = prompt + outputs[:-1]  # the last generated token was never fed: no state
        assert s["input_ids"].tolist() == toks
        assert s["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(outputs) - 1)
        want = [states(rid, p) for p in range(len(toks))]
        assert torch.equal(s["aux"], torch.stack([a for a, _ in want]).reshape(len(toks), len(LAYERS), H))
        assert torch.equal(s["final"], torch.stack([f for _, f in want]))


def test_tap_over_extend_mixed_and_decode_batches(sg, tiny_llama, tmp_path):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN

    rig = TapRig(tmp_path, tiny_llama)
    pa, pb, pc = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25], [31, 32, 33, 34]
    oa, ob, oc = [101, 102, 103], [201, 202, 2], [301]
    # A's prompt in two chunks; "late" joined with 5 tokens from the radix cache (never computed: not tapped)
    rig.step("EXTEND", [("A", pa[:4], 0), ("late", [1, 2, 3], 5)])
    rig.step("EXTEND", [("A", pa[4:], 4), ("B", pb, 0)])  # A's last chunk -> a1; B whole -> b1
    rig.step("DECODE", [("A", oa[:1], 6), ("B", ob[:1], 5)])  # -> a2, b2
    rig.step("MIXED", [("C", pc, 0), ("A", oa[1:2], 7), ("B", ob[1:2], 6)])  # C's prefill, then the decode rows
    rig.stream([make_req("A", pa, oa, FINISH_LENGTH(3)), make_req("B", pb, ob, FINISH_MATCHED_TOKEN(2)),
                make_req("C", pc, oc)])
    rig.step("DECODE", [("A", oa[2:], 8), ("C", oc, 4)])  # the overlap scheduler's extra row for A: cut off
    rig.stream([make_req("A", pa, oa, FINISH_LENGTH(3)), make_req("C", pc, oc + [302], FINISH_ABORT("client gone"))])
    evs = rig.finish()

    store = open_store(rig.store)
    assert sorted(store.ids) == sorted(f"tap-{rig.hook.tap_session}-{r}" for r in "AB")
    rig.assert_sample(store, "A", pa, oa)
    rig.assert_sample(store, "B", pb, ob)
    assert store.verify() == []
    h = store.header
    assert h["contents"]["kind"] == "served traffic" and h["engine"]["name"] == "sglang"
    assert h["engine"]["compute_dtype"] == "fp32" and h["layers"] == LAYERS and h["dtype"] == "fp32"
    drops = [(e["id"], e["reason"]) for e in evs if e["event"] == "dropped"]
    assert drops == [(f"tap-{rig.hook.tap_session}-C", "aborted")]
    st = rig.hook.stats
    assert st["tap_skipped_joined_late"] == 1 and st["tap_dropped_aborted"] == 1 and st["samples"] == 2


def test_ends_outside_the_stream_and_a_drivers_request_beside_tapped_ones(sg, tiny_llama, tiny_tokenizer, tmp_path):
    """A request SGLang ends outside its output stream (aborted while queued, preempted, retracted) is dropped; the
    wrappers are installed once; a driver's request in the same batches is stored as `hstap capture` stores it."""
    from helpers.capture import prepare_records
    from helpers.sglang import create_store, records
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    from hstap.capture.session import encode_rid
    from hstap.data.prepare import load_prepared

    data = prepare_records(tiny_tokenizer[1], tmp_path / "prepared", records(2, seed=5, hostile=False))
    ds = load_prepared(data)
    rig = TapRig(tmp_path, tiny_llama, data=str(data))
    create_store(tiny_llama, data, rig.store, LAYERS, "fp32")  # the driver's store; the tap adds to it
    TapRig(tmp_path, tiny_llama).hook.close()  # a second hook: the wrappers stay single
    assert getattr(SchedulerOutputStreamer.stream_output, "hstap_tap", False)
    assert not getattr(SchedulerOutputStreamer.stream_output.__wrapped__, "hstap_tap", False)
    assert getattr(Scheduler.send_abort_output, "hstap_tap", False)
    drv, T0 = encode_rid("s1", 0, ds[0]["id"]), len(ds[0]["input_ids"])
    ids0 = ds[0]["input_ids"]
    rig.step("EXTEND", [(drv, ids0, 0), ("cl", [7, 8, 9], 0), ("gone", [4, 5], 0)])
    rig.step("DECODE", [("cl", [10], 3), ("gone", [6], 2)])
    rig.abort(make_req("gone", [4, 5], [6]))  # preempted: never streamed as finished
    rig.stream([make_req("cl", [7, 8, 9], [10, 11], FINISH_LENGTH(2))])
    evs = rig.finish()
    store = open_store(rig.store)
    assert sorted(store.ids) == sorted([ds[0]["id"], f"tap-{rig.hook.tap_session}-cl"])
    rig.assert_sample(store, "cl", [7, 8, 9], [10, 11])
    d = store[store.index_of(ds[0]["id"])]
    assert d["input_ids"].tolist() == ids0 and d["loss_mask"].tolist() == ds[0]["loss_mask"]
    assert torch.equal(d["final"], torch.stack([states(drv, q)[1] for q in range(T0)]))
    (ev,) = [e for e in evs if e["event"] == "dropped"]
    assert ev["id"].endswith("-gone") and ev["reason"] == "aborted" and "outside the output stream" in ev["detail"]
    assert [x for x in rig.sent.sent if len(x) == 2]  # SGLang's own abort path ran and sent its output


def test_fraction_retraction_and_decode_in_cuda_graphs(sg, tiny_llama, tmp_path):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    rig = TapRig(tmp_path, tiny_llama, tap_fraction=0.5)
    rids = [f"q{i}" for i in range(16)]
    for r in rids:
        rig.step("EXTEND", [(r, [3, 4, 5], 0)])
        rig.step("DECODE", [(r, [6], 3)])
        rig.stream([make_req(r, [3, 4, 5], [6, 7], FINISH_LENGTH(2))])
    rig.finish()
    kept = [r for r in rids if tapped(r, 0.5)]
    assert 0 < len(kept) < len(rids)
    store = open_store(rig.store)
    assert sorted(store.ids) == sorted(f"tap-{rig.hook.tap_session}-{r}" for r in kept)
    for r in kept:
        rig.assert_sample(store, r, [3, 4, 5], [6, 7])
    assert rig.hook.stats["tap_skipped_fraction"] == len(rids) - len(kept)

    rig = TapRig(tmp_path, tiny_llama)
    # retracted after a decode step and recomputed from the start: stored from the restart
    rig.step("EXTEND", [("re", [1, 2], 0)])
    rig.step("DECODE", [("re", [9], 2)])
    rig.step("EXTEND", [("re", [1, 2, 9], 0)])
    rig.step("DECODE", [("re", [8], 3)])
    rig.stream([make_req("re", [1, 2], [9, 8, 7], FINISH_LENGTH(3))])
    # decode replayed from a CUDA graph: the hook saw the prompt only
    rig.step("EXTEND", [("graph", [1, 2, 3, 4], 0)])
    rig.stream([make_req("graph", [1, 2, 3, 4], [5, 6, 7], FINISH_LENGTH(3))])
    evs = rig.finish()
    store = open_store(rig.store)
    assert store.ids == [f"tap-{rig.hook.tap_session}-re"]
    rig.assert_sample(store, "re", [1, 2], [9, 8, 7])
    (ev,) = [e for e in evs if e["event"] == "dropped"]
    assert ev["id"].endswith("-graph") and ev["reason"] == "incomplete"
    assert "--cuda-graph-backend-decode disabled" in ev["detail"]


def test_store_bound_drops_what_does_not_fit(sg, tiny_llama, tmp_path):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    rig = TapRig(tmp_path, tiny_llama, max_store_gb=1e-9)  # one byte: nothing fits
    rig.step("EXTEND", [("big", [1, 2, 3], 0)])
    rig.step("DECODE", [("big", [4], 3)])
    rig.stream([make_req("big", [1, 2, 3], [4, 5], FINISH_LENGTH(2))])
    rig.finish()
    assert rig.hook.stats["tap_dropped_store_full"] == 1 and rig.hook.stats["samples"] == 0
    assert not (rig.store / "manifest.json").exists()  # nothing half-written: no store without a sample


def test_a_writer_behind_drops_tapped_requests_never_stalls_the_scheduler(sg, tiny_llama, tmp_path):
    import threading
    import time

    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    class Gate:  # an item whose device-to-host copy 'lands' only when the test says so: the writer waits on it
        def __init__(self):
            self.open = threading.Event()

        def synchronize(self):
            self.open.wait(30)

    def drained():  # the writer took everything queued (queue_size 1: the next batch must find room)
        while not rig.hook.queue.items.empty():
            time.sleep(0.001)

    rig = TapRig(tmp_path, tiny_llama, queue_size=1)
    rig.step("EXTEND", [("ok", [1, 2], 0), ("fin", [1, 2], 0)])
    drained()
    rig.step("DECODE", [("ok", [3], 2), ("fin", [5], 2)])  # fin's last needed row: its answer is [5, 6]
    drained()
    gate = Gate()
    rig.hook.queue.items.put({"actions": [], "done": gate})  # the writer takes it and waits (then fails on it: an error event)
    drained()
    rig.hook.queue.items.put({"actions": []})  # the queue (size 1) is full now
    rig.step("EXTEND", [("late", [1, 2], 0)])  # returns at once: late's rows are not taken
    rig.step("DECODE", [("ok", [4], 3), ("fin", [6], 3)])  # ok needs this row; fin's is the overlap's extra row
    rig.stream([make_req("ok", [1, 2], [3, 4, 7], FINISH_LENGTH(3)), make_req("fin", [1, 2], [5, 6], FINISH_LENGTH(2)),
                make_req("late", [1, 2], [5], FINISH_LENGTH(1))])  # the queue is still full: these ends wait
    gate.open.set()
    evs = rig.finish()
    st = rig.hook.stats
    assert st["tap_dropped_queue_full"] == 2 and st["samples"] == 1
    assert sorted(e["id"].rsplit("-", 1)[1] for e in evs if e["event"] == "dropped") == ["late", "ok"]
    rig.assert_sample(open_store(rig.store), "fin", [1, 2], [5, 6])
