"""CUDA paths, run on a GPU machine (skipped without CUDA): the async capture pipeline (side stream, events, pinned
buffers, writer thread) against a CPU fp32 capture; compiled flex_attention TTT against the SDPA mask, with gradients;
greedy speculative decoding on the GPU; a few bf16-autocast training steps."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _capture(target, prepared, out, device, compute, dtype, **kw):
    from hstap.capture import CaptureConfig, capture

    with contextlib.redirect_stdout(io.StringIO()):
        return capture(CaptureConfig(target=str(target), data=str(prepared), out=str(out), layers="1,2,4", dtype=dtype,
                                     device=device, compute_dtype=compute, batch_tokens=512, shard_tokens=700,
                                     queue_size=1, **kw))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_capture_matches_cpu_fp32(tiny_llama, tmp_path, dtype):
    from _capture_fixtures import make_prepared

    from hstap.store.reader import open_store
    from hstap.verify import compare_stores

    prepared = make_prepared(tiny_llama, tmp_path / "prep", 40)
    _capture(tiny_llama, prepared, tmp_path / "cpu", "cpu", "fp32", "fp32")
    _capture(tiny_llama, prepared, tmp_path / "gpu", "cuda", "bf16", dtype)
    a, b = open_store(tmp_path / "gpu"), open_store(tmp_path / "cpu")
    assert a.verify() == [] and sorted(a.ids) == sorted(b.ids) and len(a) == 40
    for i in range(len(b)):  # ids and masks are exact; states within the bf16/fp8 tolerance of verify
        j = a.index_of(b.ids[i])
        assert torch.equal(a[j]["input_ids"], b[i]["input_ids"]) and torch.equal(a[j]["loss_mask"], b[i]["loss_mask"])
    rep = compare_stores(str(tmp_path / "gpu"), str(tmp_path / "cpu"))
    assert rep["ok"], json.dumps(rep["problems"])[:2000]
    # fp32 compute on the GPU through the same pipeline is near-exact (TF32 off by default in PyTorch for matmul)
    _capture(tiny_llama, prepared, tmp_path / "gpu32", "cuda", "fp32", "fp32")
    c = open_store(tmp_path / "gpu32")
    for i in range(len(b)):
        torch.testing.assert_close(c[c.index_of(b.ids[i])]["aux"], b[i]["aux"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_layers,loss,compile_", [(1, "ce", False), (2, "lk", False), (3, "ce+tv", True)])
def test_flex_ttt_matches_sdpa_with_grads(monkeypatch, num_layers, loss, compile_):
    import _drafter_fixtures as td

    from hstap.ttt import TTTModel, plan_rows, target_distribution

    # flex_attention's CUDA kernels need head_dim >= 16: a wider copy of the CPU test's fixture
    monkeypatch.setattr(td, "DrafterConfig", _wide)
    d, W, hot, t2d, ids, lm, L, aux, final = td.tiny_setup(seed=3, B=2, T=40, lengths=(40, 29), num_layers=num_layers)
    d = d.cuda()
    W, hot, t2d, ids, lm, L, aux, final = (x.cuda() for x in (W, hot, t2d, ids, lm, L, aux, final))
    tb = target_distribution(final, lm, L, W, hot, t2d, chunk=5)
    K, T = 4, ids.shape[1]
    denom = torch.tensor(plan_rows(tb, T, K), device="cuda")
    res = {}
    for attn in ("sdpa", "flex"):  # sdpa first: compile (flex's model only) wraps the drafter's layers in place
        d.zero_grad(set_to_none=True)
        loss_v, _ = TTTModel(d, ttt=K, attn=attn, loss=loss, compile=compile_ and attn == "flex")(ids, aux, tb, denom)
        loss_v.backward()
        res[attn] = (loss_v.detach(), [p.grad.clone() for p in d.parameters() if p.requires_grad])
    torch.testing.assert_close(res["flex"][0], res["sdpa"][0], rtol=1e-4, atol=1e-4)
    for g1, g2 in zip(res["flex"][1], res["sdpa"][1]):
        torch.testing.assert_close(g1, g2, rtol=1e-3, atol=1e-4)


def _wide(**kw):
    from hstap.drafter import DrafterConfig

    kw.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return DrafterConfig(**kw)


def test_gpu_speculative_greedy_equals_target(tiny_llama):
    from _speculate_fixtures import random_drafter

    from hstap.model_dir import load_target
    from hstap.speculate import speculative_generate, target_generate

    target, _ = load_target(tiny_llama, device="cuda", dtype="fp32")
    prompt = [1, 3, 50, 60, 70, 2, 4]
    ref, _ = target_generate(target, prompt, 40)
    for n in (1, 2):
        drafter = random_drafter(target, (1, 2, 3), num_layers=n).cuda()
        for kw in (dict(mode="chain", k=4), dict(mode="tree", topk=3, depth=4, tokens=10)):
            assert speculative_generate(target, drafter, prompt, 40, **kw)[0] == ref, (n, kw)


def test_gpu_training_bf16_runs(tiny_llama, tmp_path):
    from _capture_fixtures import make_prepared

    from hstap.train import TrainConfig, train

    prepared = make_prepared(tiny_llama, tmp_path / "prep", 40)
    _capture(tiny_llama, prepared, tmp_path / "store", "cuda", "bf16", "bf16")
    with contextlib.redirect_stdout(io.StringIO()):
        train(TrainConfig(store=str(tmp_path / "store"), target=str(tiny_llama), out=str(tmp_path / "run"), steps=30,
                          ttt=3, lr=3e-3, batch_tokens=1024, device="cuda", draft_vocab=64))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0]


def test_gpu_zero_copy_pipeline_equals_copying_and_reuses_pinned_buffers(tiny_llama, tmp_path, monkeypatch):
    """The writer hands the store views of pinned buffers and takes them back after the shard commit: a buffer
    reused too early would corrupt committed samples. Compare bitwise with the copying path; count pinned buffers."""
    from hstap.batching import pack_by_tokens
    from hstap.engines import hf
    from hstap.model_dir import load_target
    from hstap.store.reader import open_store
    from hstap.store.writer import StoreWriter

    target, _ = load_target(tiny_llama, device="cuda", dtype="bf16")
    g = torch.Generator().manual_seed(0)
    samples = [{"id": f"s{i:03d}", "input_ids": torch.randint(0, 200, (int(torch.randint(5, 120, (1,), generator=g)),),
                                                              generator=g), "loss_mask": None} for i in range(80)]
    for s in samples:
        s["loss_mask"] = torch.ones_like(s["input_ids"], dtype=torch.uint8)
    batches = [[samples[i] for i in b] for b in pack_by_tokens([len(s["input_ids"]) for s in samples], 256)]
    hdr = {"target": {}, "engine": {}, "dtype": "bf16", "layers": [1, 2, 4], "hidden_size": target.hidden_size}
    stats = {}
    for mode, limit in (("zero_copy", 1 << 40), ("copy", 0)):
        monkeypatch.setattr(hf, "ZERO_COPY_MAX_SHARD", limit)
        w = StoreWriter(tmp_path / mode, hdr, shard_tokens=300)
        stats[mode] = hf.run_capture(target, [1, 2, 4], w, batches, dtype="bf16", queue_size=1)
        w.close()
    a, b = open_store(tmp_path / "zero_copy"), open_store(tmp_path / "copy")
    assert a.verify() == [] and a.ids == b.ids and len(a) == 80
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["aux"], y["aux"]) and torch.equal(x["final"], y["final"])
    # alive at once: queue (1) + in copy (1) + in the writer (1) + held by the open shard (<= 300 tokens, >= 1 batch)
    assert stats["zero_copy"]["zero_copy"] and not stats["copy"]["zero_copy"]  # each mode took its own path
    assert len(batches) > 12 and stats["zero_copy"]["pinned_allocations"] <= 8
