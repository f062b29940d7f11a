"""The SGLang forward hook on the real `sglang` package: real ForwardBatch / ForwardMode, SGLang's real LogitsProcessor
(CPU), attached by SGLang's own `register_forward_hooks` from the `--forward-hooks` JSON, writing a real store.

Each test feeds batches laid out as SGLang's scheduler lays them out (chunks, prefixes, padding, decode rows, fake DP
batches) with per-sample hidden states known in advance, then reads the store back and compares sample by sample."""

from __future__ import annotations

import importlib.util
import json
import uuid

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # installed but broken must fail, not skip: no importorskip
    pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23, see docs/engines.md)",
                allow_module_level=True)

from helpers.sglang import (  # noqa: E402
    LAYERS,
    H,
    create_store,
    forward_batch,
    logits_root,
    records,
)

from hstap.capture.sglang.hook import CaptureHook  # noqa: E402
from hstap.capture.sglang.plugin import set_capture_layers  # noqa: E402
from hstap.capture.session import decode_rid, encode_rid  # noqa: E402
from hstap.capture.sglang.protocol import ENV_LAYERS, EVENTS_DIR, HOOK_FACTORY, hook_spec  # noqa: E402
from hstap.common import HstapError  # noqa: E402
from hstap.store.reader import open_store  # noqa: E402



def prepared_records() -> list[dict]:
    """The chats of this module's `prepared` set (conftest.py)."""
    return records(8, seed=3)


class Rig:
    """One hook on one LogitsProcessor writing one fresh store; `step` runs one forward pass through it."""

    def __init__(self, tmp, target, data, dtype="fp32", **cfg):
        from sglang.srt.model_executor.hook_manager import register_forward_hooks
        from transformers import AutoConfig

        from hstap.data.prepare import load_prepared

        self.store = tmp / f"store-{uuid.uuid4().hex[:6]}"
        create_store(target, data, self.store, LAYERS, dtype)
        self.ds = load_prepared(data)
        # the --forward-hooks JSON, as SGLang's CLI parses it
        spec = json.loads(json.dumps([hook_spec(self.store, data, LAYERS, flush_s=0.05, **cfg)]))
        self.root = logits_root(AutoConfig.from_pretrained(target))
        register_forward_hooks(self.root, spec)
        hooks = list(self.root.logits_processor._forward_hooks.values())
        assert len(hooks) == 1 and isinstance(hooks[0], CaptureHook)
        self.hook = hooks[0]
        self.session = uuid.uuid4().hex[:8]
        self.gen = torch.Generator().manual_seed(0)

    def T(self, row):
        return len(self.ds[row]["input_ids"])

    def rid(self, row, attempt=0):
        return encode_rid(self.session, row, self.ds[row]["id"], attempt)

    def expected(self, row):
        g = torch.Generator().manual_seed(1000 + row)
        T = self.T(row)
        return {"input_ids": torch.tensor(self.ds[row]["input_ids"]),
                "loss_mask": torch.tensor(self.ds[row]["loss_mask"]),
                "aux": torch.randn(T, len(LAYERS), H, generator=g), "final": torch.randn(T, H, generator=g)}

    def step(self, mode, entries, pad=0, list_aux=False, **fb):
        """entries: (rid, row | None, prefix, n): rows prefix..prefix+n of `row` (garbage past its end or for None)."""
        ids, aux, fin = [], [], []
        for _, row, p, n in entries:
            e = self.expected(row) if row is not None else None
            for pos in range(p, p + n):
                if e is not None and pos < self.T(row):
                    ids.append(e["input_ids"][pos:pos + 1]), aux.append(e["aux"][pos].reshape(1, -1))
                    fin.append(e["final"][pos:pos + 1])
                else:
                    ids.append(torch.randint(0, 300, (1,), generator=self.gen))
                    aux.append(torch.randn(1, len(LAYERS) * H, generator=self.gen))
                    fin.append(torch.randn(1, H, generator=self.gen))
        for _ in range(pad):  # DP / graph padding rows past sum(extend_seq_lens)
            ids.append(torch.zeros(1, dtype=torch.long)), aux.append(torch.full((1, len(LAYERS) * H), 7.0))
            fin.append(torch.full((1, H), 7.0))
        ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)  # (R,)
        a = torch.cat(aux) if aux else torch.zeros(0, len(LAYERS) * H)  # (R, K*H)
        f = torch.cat(fin) if fin else torch.zeros(0, H)  # (R, H)
        if "ext" in fb:
            ext, pre = fb.pop("ext"), fb.pop("pre")
        elif mode in ("EXTEND", "MIXED"):
            ext, pre = [n for *_, n in entries], [p for _, _, p, _ in entries]
        else:
            ext = pre = None
        rids = fb.pop("rids") if "rids" in fb else [e[0] for e in entries]
        batch = forward_batch(mode, rids, ext, pre, ids, **fb)
        if list_aux:  # models not migrated to the packer pass a list of K (R, H) tensors
            a = list(a.reshape(-1, len(LAYERS), H).unbind(1))
        out = self.root.logits_processor(ids, f, self.root.lm_head, batch, a)
        assert out.next_token_logits is not None  # the real LogitsProcessor ran to the end

    def finish(self):
        self.hook.close()
        evs = []
        for p in sorted((self.store / EVENTS_DIR).glob("*.jsonl")) if (self.store / EVENTS_DIR).is_dir() else []:
            evs += [json.loads(x) for x in p.read_text().splitlines()]
        return open_store(self.store), evs

    def assert_stored(self, store, rows):
        assert sorted(store.ids) == sorted(self.ds[r]["id"] for r in rows)
        for r in rows:
            s, e = store[store.index_of(self.ds[r]["id"])], self.expected(r)
            assert s["id"] == self.ds[r]["id"]
            assert torch.equal(s["input_ids"], e["input_ids"]) and torch.equal(s["loss_mask"], e["loss_mask"])
            assert torch.equal(s["aux"], e["aux"]) and torch.equal(s["final"], e["final"])


def test_three_requests_in_one_extend_with_hostile_ids(sg, tiny_llama, prepared, tmp_path):
    rig = Rig(tmp_path, tiny_llama, prepared)
    assert {rig.ds[r]["id"] for r in range(3)} == {"../x", "a" * 5000, "nul\x00id"}
    rig.step("EXTEND", [(rig.rid(r), r, 0, rig.T(r)) for r in range(3)], pad=5)
    store, evs = rig.finish()
    rig.assert_stored(store, [0, 1, 2])
    assert store.verify() == []
    files = {p.name for p in rig.store.rglob("*")}  # sample ids never become file names
    assert not any(".." == n or n.startswith("a" * 100) or "\x00" in n or n == "x" for n in files)
    assert evs == [] and rig.hook.stats["samples"] == 3


def test_one_request_in_three_chunks_interleaved_with_others(sg, tiny_llama, prepared, tmp_path):
    rig = Rig(tmp_path, tiny_llama, prepared)
    T = rig.T(3)
    c1, c2 = T // 3, 2 * T // 3
    rig.step("EXTEND", [(rig.rid(4), 4, 0, rig.T(4)), (rig.rid(3), 3, 0, c1)])  # 4 whole, 3's first chunk last
    rig.step("EXTEND", [(rig.rid(3), 3, c1, c2 - c1)], pad=3)  # the middle chunk alone, padded
    rig.step("EXTEND", [(rig.rid(3), 3, c2, T - c2), (rig.rid(5), 5, 0, 4)], list_aux=True)  # 3 ends, 5 starts
    store, _ = rig.finish()
    rig.assert_stored(store, [3, 4])  # 5 is incomplete: not stored
    assert rig.hook._active[rig.rid(5)].next_pos == 4


def test_prefix_cache_hit_is_dropped_not_truncated(sg, tiny_llama, prepared, tmp_path):
    rig = Rig(tmp_path, tiny_llama, prepared)
    T6 = rig.T(6)
    rig.step("EXTEND", [(rig.rid(6), 6, 5, T6 - 5), (rig.rid(7), 7, 0, rig.T(7))])  # 6: 5 tokens came from the cache
    store, evs = rig.finish()
    rig.assert_stored(store, [7])
    drops = [e for e in evs if e["event"] == "dropped"]
    assert [(e["id"], e["reason"]) for e in drops] == [(rig.ds[6]["id"], "prefix_cache_hit")]
    assert drops[0]["session"] == rig.session and rig.hook.stats["dropped_prefix_cache_hit"] == 1


def test_mixed_decode_idle_and_dp_fake_batches(sg, tiny_llama, prepared, tmp_path):
    rig = Rig(tmp_path, tiny_llama, prepared)
    rig.step("EXTEND", [(rig.rid(0), 0, 0, rig.T(0))])
    # MIXED: two prefills first, then running decode rows (a finished hstap request and another client's request)
    rig.step("MIXED", [(rig.rid(1), 1, 0, rig.T(1)), (rig.rid(2), 2, 0, rig.T(2)), (rig.rid(0), 0, rig.T(0), 1),
                       ("client-7", None, 40, 1)])
    n0 = rig.hook.stats["rows"]
    rig.step("DECODE", [(rig.rid(1), 1, rig.T(1), 1), ("client-7", None, 41, 1)], seq_lens=[rig.T(1) + 1, 42])
    rig.step("IDLE", [], batch_size=0, seq_lens=[])
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    # an idle DP rank turned into a fake 1-request EXTEND of 6 dummy rows (prepare_mlp_sync_batch), and decode rows
    # relabelled as 1-token extends: both carry _original_forward_mode
    rig.step("EXTEND", [("x", None, 0, 6)], rids=[], batch_size=1, ext=[6], pre=[0],
             _original_forward_mode=ForwardMode.IDLE)
    rig.step("EXTEND", [(rig.rid(3), 3, 0, 1)], _original_forward_mode=ForwardMode.DECODE)
    assert rig.hook.stats["rows"] == n0  # none of the last four batches contributed a row
    store, evs = rig.finish()
    rig.assert_stored(store, [0, 1, 2])
    st = rig.hook.stats
    assert st["skipped_decode"] == 1 and st["skipped_idle"] == 1 and st["skipped_dp_fake"] == 2 and evs == []


def test_tp_rank_other_than_zero_writes_nothing(sg, tiny_llama, prepared, tmp_path):
    from sglang.srt.runtime_context import get_parallel

    rig = Rig(tmp_path, tiny_llama, prepared)
    # SGLang's own rank source, set as on the second process of a --tp-size 2 server
    with get_parallel().override(tp_size=2, attn_tp_size=2, moe_tp_size=2, tp_rank=1, attn_tp_rank=1, attn_dp_rank=0,
                                 attn_cp_rank=0):
        rig.step("EXTEND", [(rig.rid(r), r, 0, rig.T(r)) for r in range(2)])
    store, evs = rig.finish()
    assert len(store) == 0 and evs == [] and rig.hook.ranks()[0] == 1 and rig.hook.stats["batches"] == 0
    # attention-DP group 1 (its attn-TP rank 0) writes store rank 1
    rig2 = Rig(tmp_path, tiny_llama, prepared, attn_tp_rank=0, dp_rank=1, dp_size=2)
    rig2.step("EXTEND", [(rig2.rid(r), r, 0, rig2.T(r)) for r in range(2)])
    store, _ = rig2.finish()
    rig2.assert_stored(store, [0, 1])
    assert {e["rank"] for e in store.manifest["shards"]} == {1}


def test_foreign_and_forged_request_ids(sg, tiny_llama, prepared, tmp_path):
    rig = Rig(tmp_path, tiny_llama, prepared)
    forged = f"hstap:{rig.session}:4:{'0' * 16}:0"  # right shape, wrong digest for row 4
    out_of_range = encode_rid(rig.session, 999, "whatever")
    rig.step("EXTEND", [("../x", None, 0, 3), ("a" * 10000, None, 0, 2), ("nul\x00", None, 0, 2), (forged, 4, 0, 3),
                        (out_of_range, None, 0, 2), (rig.rid(5), 5, 0, rig.T(5))])
    store, evs = rig.finish()
    rig.assert_stored(store, [5])
    assert sorted(e["reason"] for e in evs) == ["bad_rid", "bad_rid"] and rig.hook.stats["bad_rid"] == 2
    assert decode_rid("../x") is None and decode_rid("a" * 10000) is None and decode_rid("hstap:\x00:1:2:3") is None
    assert decode_rid(f"hstap:s:\u00b2:{'0' * 16}:0") is None  # a non-ASCII digit: refused, not int() -> ValueError
    assert decode_rid(rig.rid(5))[1:] == (5, rig.rid(5).split(":")[3])


def test_restart_and_new_session_reopen(sg, tiny_llama, prepared, tmp_path):
    rig = Rig(tmp_path, tiny_llama, prepared)
    rig.step("EXTEND", [(rig.rid(1), 1, 0, 3)])
    rig.step("EXTEND", [(rig.rid(1), 1, 0, rig.T(1))])  # retracted and rescheduled from 0: starts over
    rig.session = "second"  # a new driver run against the same server
    rig.step("EXTEND", [(rig.rid(2), 2, 0, rig.T(2)), (rig.rid(1), 1, 0, rig.T(1))])  # 1 again: a duplicate, skipped
    store, evs = rig.finish()
    rig.assert_stored(store, [1, 2])
    assert rig.hook.stats["duplicates"] == 1 and evs == []


def test_fp8_store_is_quantized_before_the_copy(sg, tiny_llama, prepared, tmp_path):
    from hstap.store.fp8 import dequantize_fp8, quantize_fp8

    rig = Rig(tmp_path, tiny_llama, prepared, dtype="fp8")
    rig.step("EXTEND", [(rig.rid(r), r, 0, rig.T(r)) for r in (0, 1)])
    store, _ = rig.finish()
    assert rig.hook.store_dtype == "fp8" and sorted(store.ids) == sorted(rig.ds[r]["id"] for r in (0, 1))
    for r in (0, 1):
        s, e = store[store.index_of(rig.ds[r]["id"])], rig.expected(r)
        assert torch.equal(s["aux"], dequantize_fp8(*quantize_fp8(e["aux"])))
        assert torch.equal(s["final"], dequantize_fp8(*quantize_fp8(e["final"])))


def test_hook_config_errors(sg, prepared, tmp_path):
    with pytest.raises(HstapError, match="unknown keys"):
        CaptureHook({"store": str(tmp_path), "data": str(prepared), "layers": [1], "bogus": 1})
    with pytest.raises(HstapError, match="not a prepared dataset"):
        CaptureHook({"store": str(tmp_path), "data": str(tmp_path), "layers": [1]})
    assert hook_spec(tmp_path, prepared, [1, 2])["hook_factory"] == HOOK_FACTORY


class _EagleTarget(torch.nn.Module):
    """What `set_capture_layers` needs from an SGLang model: a config and `set_eagle3_layers_to_capture`."""

    def __init__(self, model_type, num_layers=61):
        super().__init__()
        self.config = type("C", (), {"model_type": model_type, "num_hidden_layers": num_layers})()
        self.ids = None

    def set_eagle3_layers_to_capture(self, ids):
        self.ids = ids


def test_plugin_via_sglang_entry_points(sg, monkeypatch):
    import importlib

    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    mod = importlib.import_module("sglang.srt.model_executor.model_runner_components.attention_backend_setup")
    original = mod.configure_aux_hidden_state_capture
    monkeypatch.delenv(ENV_LAYERS, raising=False)
    monkeypatch.setenv("SGLANG_PLUGINS", "hstap")
    try:
        plugins._plugins_loaded = False
        plugins.load_plugins()  # entry point group sglang.srt.plugins -> hstap.capture.sglang.plugin:plugin: a no-op
        assert mod.configure_aux_hidden_state_capture is original
        monkeypatch.setenv(ENV_LAYERS, "1,15,28")
        plugins._plugins_loaded = False
        plugins.load_plugins()
        assert mod.configure_aux_hidden_state_capture is not original  # patched by HookRegistry
        for model_type, want in (("llama", [1, 15, 28]), ("deepseek_v3", [1, 15, 28])):
            m = _EagleTarget(model_type)
            mod.configure_aux_hidden_state_capture(model=m, eagle_use_aux_hidden_state=False,
                                                   eagle_aux_hidden_state_layer_ids=None,
                                                   dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None,
                                                   is_dspark=False)
            assert m.ids == want
        monkeypatch.setenv(ENV_LAYERS, "2,30,58")  # DeepSeek without the +1 rule: ids name layer inputs
        m = _EagleTarget("deepseek_v3")
        assert set_capture_layers(m, [2, 30, 58]) == [3, 31, 59] and m.ids == [3, 31, 59]
        m = _EagleTarget("llama", num_layers=6)  # the last layer's output (5) is never captured: the server stops
        with pytest.raises(HstapError, match=f"{ENV_LAYERS}: SGLang cannot capture canonical layer 5"):
            set_capture_layers(m, [1, 5])
        assert m.ids is None
    finally:
        HookRegistry.reset()
        mod.configure_aux_hidden_state_capture = original
        plugins._plugins_loaded = False
