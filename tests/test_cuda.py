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


def test_flex_ttt_matches_sdpa_with_grads(monkeypatch):
    import _drafter_fixtures as td

    from hstap.ttt import TTTModel, step_rows, target_distribution

    # flex_attention's CUDA kernels need head_dim >= 16: a wider copy of the CPU test's fixture
    monkeypatch.setattr(td, "DrafterConfig", _wide)
    d, W, hot, t2d, ids, lm, L, aux, final = td.tiny_setup(seed=3, B=2, T=40, lengths=(40, 29))
    d = d.cuda()
    W, hot, t2d, ids, lm, L, aux, final = (x.cuda() for x in (W, hot, t2d, ids, lm, L, aux, final))
    tb = target_distribution(final, lm, L, W, hot, t2d, chunk=5)
    K, T = 4, ids.shape[1]
    denom = torch.tensor([float(step_rows(tb, T, k)[0].numel()) for k in range(K)], device="cuda")
    res = {}
    for attn in ("sdpa", "flex"):
        d.zero_grad(set_to_none=True)
        loss, _ = TTTModel(d, ttt=K, attn=attn)(ids, aux, tb, denom)
        loss.backward()
        res[attn] = (loss.detach(), [p.grad.clone() for p in d.parameters() if p.requires_grad])
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
    drafter = random_drafter(target, (1, 2, 3)).cuda()
    prompt = [1, 3, 50, 60, 70, 2, 4]
    ref, _ = target_generate(target, prompt, 40)
    for kw in (dict(mode="chain", k=4), dict(mode="tree", topk=3, depth=4, tokens=10)):
        assert speculative_generate(target, drafter, prompt, 40, **kw)[0] == ref, kw


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


# --- the fast decoder (hstap.fastdecode): CUDA graphs == eager, one host sync per round ---------------------------
def _fast_setup(path, vocab_draft=None, aux=(1, 2, 3)):
    from _speculate_fixtures import random_drafter

    from hstap.model_dir import load_target

    target, _ = load_target(path, device="cuda", dtype="fp32")
    return target, random_drafter(target, aux, draft_vocab=vocab_draft).cuda()


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_tokenizer, tmp_path_factory):
    from hstap.toy import build_random_target

    d = tmp_path_factory.mktemp("tiny-qwen3")
    build_random_target(d, tiny_tokenizer[0], model_type="qwen3", num_layers=4, hidden_size=64)
    return d


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    """A Llama with 8 tokens: random drafts are often right, so trees accept through second children (KV moves)."""
    from hstap.toy import build_random_target

    d = tmp_path_factory.mktemp("vocab8")
    build_random_target(d, None, model_type="llama", num_layers=4, hidden_size=64, vocab_size=8)
    return d


@pytest.mark.parametrize("which", ["llama", "qwen3", "deepseek_v3", "vocab8"])
def test_gpu_fastdecode_graphs_equal_eager(which, tiny_llama, tiny_qwen3, tiny_deepseek, vocab8):
    from hstap.fastdecode import FastDecoder
    from hstap.speculate import ngram_generate, speculative_generate, target_generate

    path = {"llama": tiny_llama, "qwen3": tiny_qwen3, "deepseek_v3": tiny_deepseek, "vocab8": vocab8}[which]
    target, drafter = _fast_setup(path, aux=(0, 1, 2))
    said: list[str] = []
    fd = FastDecoder(target, drafter, max_len=128, compile=False, log=said.append)  # graphs alone (compiled: below)
    assert fd.unsupported is None
    prompt = [1, 3, 5, 7, 2, 4, 6, 1, 3] if which == "vocab8" else [1, 3, 50, 60, 70, 2, 4]
    ref, _ = target_generate(target, prompt, 40)
    out, st = fd.target_generate(prompt, 40)
    assert out == ref and st["host_s"] >= 0
    moves = 0
    for kw in (dict(mode="chain", k=4), dict(mode="tree", topk=3, depth=4, tokens=10)):
        for _ in range(2):  # the first call captures, the second replays
            out, st = fd.speculative_generate(prompt, 40, **kw)
            assert out == ref, kw
        eager, est = speculative_generate(target, drafter, prompt, 40, **kw)
        assert st["accept_counts"] == est["accept_counts"] and st["kv_moves"] == est["kv_moves"]
        moves += st["kv_moves"]
    assert fd.ngram_generate(prompt + ref[:10] + prompt, 30)[0] == ngram_generate(target, prompt + ref[:10] + prompt,
                                                                                   30)[0]
    if which == "vocab8":
        assert moves > 0  # paths through second children gathered KV entries inside the graph
    if st["graphs"]:
        assert said == []
    else:  # e.g. a MoE whose routing syncs with the host: one line says so, and the outputs are still exact
        assert len(said) == 1 and "cannot be captured" in said[0] and which == "deepseek_v3"
    if which in ("llama", "qwen3", "vocab8"):
        assert st["graphs"]


def test_gpu_fastdecode_one_host_sync_per_round(tiny_llama):
    import warnings

    from hstap.fastdecode import FastDecoder

    target, drafter = _fast_setup(tiny_llama)
    fd = FastDecoder(target, drafter, max_len=256, compile=False)
    prompt = [1, 3, 50, 60, 70, 2, 4]
    for kw in (dict(mode="chain", k=3), dict(mode="tree", topk=3, depth=3, tokens=8)):
        fd.speculative_generate(prompt, 16, **kw)  # capture
        res = {}
        for n in (8, 48):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _, st = fd.speculative_generate(prompt, n, **kw)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = sum("synchroniz" in str(x.message) for x in w)
            res[n] = (syncs, st["verify_forwards"])
        assert st["graphs"]
        (s1, r1), (s2, r2) = res[8], res[48]
        assert r2 > r1 and s2 - s1 <= r2 - r1, res  # the prefill's syncs cancel: at most one per extra round


def test_gpu_fastdecode_compiled_equals_eager(tiny_llama):
    """torch.compile'd steps inside the graphs (the default on CUDA): the same tokens; compiling takes minutes."""
    from hstap.fastdecode import FastDecoder
    from hstap.speculate import ngram_generate, target_generate

    target, drafter = _fast_setup(tiny_llama)
    fd = FastDecoder(target, drafter, max_len=128, compile=True)
    prompt = [1, 3, 50, 60, 70, 2, 4]
    ref, _ = target_generate(target, prompt, 24)
    out, st = fd.target_generate(prompt, 24)
    assert out == ref and st["graphs"] and st["compiled"]
    for kw in (dict(mode="chain", k=3), dict(mode="tree", topk=3, depth=3, tokens=8)):
        out, st = fd.speculative_generate(prompt, 24, **kw)
        assert out == ref and st["graphs"] and st["compiled"], kw
    out, st = fd.ngram_generate(prompt + ref[:8] + prompt, 16)
    assert out == ngram_generate(target, prompt + ref[:8] + prompt, 16)[0] and st["graphs"] and st["compiled"]
