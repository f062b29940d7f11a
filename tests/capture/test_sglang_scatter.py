"""Token-scattering server layouts (expert parallelism, DP attention, attention-TP input scattering, context
parallelism, DP replicas): what the driver refuses before capture, judged on real SGLang `ServerArgs` resolved by
SGLang's own code and reported as its /server_info reports them, which store ranks the hooks write, and the hook's own
refusal of a batch whose aux states do not cover its tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # installed but broken must fail, not skip: no importorskip
    pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23, see docs/engines.md)",
                allow_module_level=True)

from helpers.capture import prepare_records  # noqa: E402
from helpers.sglang import LAYERS, H, create_store, forward_batch, logits_root, records  # noqa: E402

from hstap.capture.sglang.driver import server_problems, store_world  # noqa: E402
from hstap.capture.sglang.protocol import EVENTS_DIR, hook_spec  # noqa: E402
from hstap.capture.session import encode_rid  # noqa: E402


def _info(model_dir, *flags):
    """/server_info of a server launched with these flags, as SGLang resolves them (a CPU resolution: the GPU-only
    layouts are still parsed and resolved, only never started)."""
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import build_server_info

    sa = prepare_server_args(["--model-path", str(model_dir), "--device", "cpu", *flags])
    sa.resolve_once()
    return json.loads(json.dumps(build_server_info(sa, {}), default=str))


@pytest.fixture(scope="module")
def prepared(tiny_tokenizer, tmp_path_factory):
    return prepare_records(tiny_tokenizer[1], tmp_path_factory.mktemp("sg-scatter") / "prepared", records(3, seed=2))


def test_scattered_layouts_refused_and_gathered_ones_accepted(sg, tiny_llama, tiny_deepseek, prepared, tmp_path):
    store = tmp_path / "store"
    base = ["--disable-prefill-cuda-graph", "--forward-hooks", json.dumps([hook_spec(store, prepared, LAYERS)])]

    def problems(model, *flags):
        return server_problems(_info(model, *base, *flags), store, prepared, LAYERS)

    # SGLang gathers the aux capture over attention TP under these: nothing to refuse, one store rank per scheduler
    for model, flags, world in ((tiny_deepseek, ["--tp-size", "8", "--ep-size", "8"], 1),
                                (tiny_deepseek, ["--tp-size", "8", "--moe-a2a-backend", "deepep"], 1),
                                (tiny_deepseek, ["--tp-size", "8", "--dp-size", "4", "--enable-dp-attention"], 4),
                                (tiny_deepseek, ["--tp-size", "8", "--attn-dp-size", "2",
                                                 "--moe-a2a-backend", "deepep"], 2),
                                (tiny_llama, ["--dp-size", "2"], 2)):
        info = _info(model, *base, *flags)
        assert server_problems(info, store, prepared, LAYERS) == [], flags
        assert store_world(info) == world, flags
    info = _info(tiny_deepseek, *base, "--tp-size", "8", "--dp-size", "4", "--enable-dp-attention")
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 4, True)  # 0.5.23's resolution

    # a rank's slice of the tokens is what SGLang captures under these: refused, one line each, with the fix
    p = problems(tiny_deepseek, "--tp-size", "8", "--enable-attn-tp-input-scattered")
    assert len(p) == 1 and "--enable-attn-tp-input-scattered" in p[0] and p[0].endswith("drop it")
    p = problems(tiny_deepseek, "--tp-size", "8", "--enable-prefill-cp", "--cp-strategy", "zigzag")
    assert len(p) == 1 and "--enable-prefill-cp" in p[0] and p[0].endswith("capture without it")

    # an older SGLang's /server_info (no attn_dp_size): --dp-size N is the attention-DP width under
    # --enable-dp-attention, and replicas it does not number are refused
    old = {k: v for k, v in _info(tiny_llama, *base).items() if k != "attn_dp_size"}
    assert store_world(dict(old, dp_size=4, enable_dp_attention=True)) == 4
    p = server_problems(dict(old, dp_size=2), store, prepared, LAYERS)
    assert len(p) == 1 and "use --dp-size 1" in p[0]


def test_store_rank_of_each_data_parallel_scheduler(sg, tiny_llama, prepared, tmp_path):
    from sglang.srt.runtime_context import get_parallel

    from hstap.capture.sglang.hook import CaptureHook
    from hstap.capture.sglang.ranks import parallel_ranks

    p = get_parallel()
    with p.override(tp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, dp_rank=1, dp_size=2):  # replica 1 of 2
        assert parallel_ranks() == (0, 1, 2)
    # --tp-size 4 --attn-dp-size 4: the scheduler of attention group 3 (attention TP 1 wide)
    with p.override(tp_size=4, attn_tp_size=1, attn_dp_size=4, moe_tp_size=4, tp_rank=3, attn_tp_rank=0,
                    attn_dp_rank=3, attn_cp_rank=0):
        assert parallel_ranks() == (0, 3, 4)
    # --tp-size 4 --attn-dp-size 2: attention-TP rank 1 of group 1 replicates rank 0's rows and writes nothing
    with p.override(tp_size=4, attn_tp_size=2, attn_dp_size=2, moe_tp_size=4, tp_rank=3, attn_tp_rank=1,
                    attn_dp_rank=1, attn_cp_rank=0):
        hook = CaptureHook(hook_spec(tmp_path / "s", prepared, LAYERS)["config"])
        assert hook.ranks() == (1, 1, 2)


def test_hook_refuses_aux_rows_that_do_not_cover_the_batch(sg, tiny_llama, prepared, tmp_path):
    """The aux states of a rank's slice of the tokens: an event names the cause, nothing is stored; the same batch
    whole is stored. The sliced batch is handed to the hook as a forward hook is called (module, positional inputs,
    output): SGLang 0.5.23's LogitsProcessor itself indexes the aux rows at each request's last token on the prefill
    path without logprobs (srt/layers/logits_processor.py:717-730) and fails first there; the hook's check covers the others."""
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from transformers import AutoConfig

    from hstap.data.prepare import load_prepared
    from hstap.store.reader import open_store

    ds = load_prepared(prepared)
    ids = torch.tensor(ds[0]["input_ids"])  # (T,)
    T = len(ids)
    aux, fin = torch.randn(T, len(LAYERS) * H), torch.randn(T, H)  # (T, K*H), (T, H)
    for name, rows in (("sliced", (T + 1) // 2), ("whole", T)):
        store = tmp_path / name
        create_store(tiny_llama, prepared, store, LAYERS)
        root = logits_root(AutoConfig.from_pretrained(tiny_llama))
        register_forward_hooks(root, [hook_spec(store, prepared, LAYERS, flush_s=0.05)])
        hook = list(root.logits_processor._forward_hooks.values())[0]
        fb = forward_batch("EXTEND", [encode_rid("s1", 0, ds[0]["id"])], [T], [0], ids)
        if rows < T:
            hook(root.logits_processor, (ids, fin, root.lm_head, fb, aux[:rows]), None)
        else:
            root.logits_processor(ids, fin, root.lm_head, fb, aux)
        hook.close()
        evs = [json.loads(x) for f in sorted((store / EVENTS_DIR).glob("*.jsonl")) for x in f.read_text().splitlines()]
        if name == "sliced":
            assert len(open_store(store)) == 0 and hook.stats["batches"] == 0
            assert [e["kind"] for e in evs] == ["aux_rows"]
            assert f"{rows} rows for {T} extend tokens" in evs[0]["message"]
        else:
            assert open_store(store).ids == [ds[0]["id"]] and evs == []
