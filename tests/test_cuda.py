"""CUDA paths, run on a GPU machine (skipped without CUDA): the async capture pipeline (side stream, events, pinned
buffers, writer thread) against a CPU fp32 capture; compiled flex_attention TTT against the SDPA mask, with gradients;
greedy speculative decoding on the GPU; a few bf16-autocast training steps. Fault tolerance: flex compiles for the
shape a resumed run failed on; SIGKILL + resume of CUDA training and of CUDA capture, and a capture filling a
small tmpfs, in fresh `python -m hstap.cli` processes (tests/helpers/cuda.py)."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _capture(target, prepared, out, device, compute, dtype, **kw):
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    with contextlib.redirect_stdout(io.StringIO()):
        return capture(CaptureConfig(target=str(target), data=str(prepared), out=str(out), layers="1,2,4", dtype=dtype,
                                     device=device, compute_dtype=compute, batch_tokens=512, shard_tokens=700,
                                     queue_size=1, **kw))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_capture_matches_cpu_fp32(tiny_llama, tmp_path, dtype):
    from helpers.capture import make_prepared

    from hstap.store.reader import open_store
    from hstap.verify.stage import compare_stores

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


@pytest.mark.parametrize("num_layers,loss,compile_", [(1, "ce", False), (2, "lk", False), (3, "ce+tv", True),
                                                      (1, "ce+hard", True), (1, "ce+topk", True)])
def test_flex_ttt_matches_sdpa_with_grads(monkeypatch, num_layers, loss, compile_):
    from helpers import drafter as td

    from hstap.train.ttt import TTTModel, plan_rows, target_distribution

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
    from hstap.models.drafter import DrafterConfig

    kw.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return DrafterConfig(**kw)


def test_gpu_speculative_greedy_equals_target(tiny_llama):
    from helpers.speculate import random_drafter

    from hstap.artifacts.model_dir import load_target
    from hstap.speculative.drivers import speculative_generate, target_generate

    target, _ = load_target(tiny_llama, device="cuda", dtype="fp32")
    prompt = [1, 3, 50, 60, 70, 2, 4]
    ref, _ = target_generate(target, prompt, 40)
    for n in (1, 2):
        drafter = random_drafter(target, (1, 2, 3), num_layers=n).cuda()
        for kw in (dict(mode="chain", k=4), dict(mode="tree", topk=3, depth=4, tokens=10)):
            assert speculative_generate(target, drafter, prompt, 40, **kw)[0] == ref, (n, kw)


def test_gpu_training_bf16_runs(tiny_llama, tmp_path):
    from helpers.capture import make_prepared
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    prepared = make_prepared(tiny_llama, tmp_path / "prep", 40)
    _capture(tiny_llama, prepared, tmp_path / "store", "cuda", "bf16", "bf16")
    with contextlib.redirect_stdout(io.StringIO()):
        train(from_flags(TrainConfig, store=str(tmp_path / "store"), target=str(tiny_llama), out=str(tmp_path / "run"),
                         steps=30, ttt=3, lr=3e-3, batch_tokens=1024, device="cuda", draft_vocab=64))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0]


def test_gpu_zero_copy_pipeline_equals_copying_and_reuses_pinned_buffers(tiny_llama, tmp_path, monkeypatch):
    """The writer hands the store views of pinned buffers and takes them back after the shard commit: a buffer
    reused too early would corrupt committed samples. Compare bitwise with the copying path; count pinned buffers."""
    from hstap.batching import pack_by_tokens
    from hstap.capture.hf import runner as hf
    from hstap.artifacts.model_dir import load_target
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


# --- the fast decoder (hstap.speculative.fast): CUDA graphs == eager, one host sync per round ---------------------------
def _fast_setup(path, vocab_draft=None, aux=(1, 2, 3)):
    from helpers.speculate import random_drafter

    from hstap.artifacts.model_dir import load_target

    target, _ = load_target(path, device="cuda", dtype="fp32")
    return target, random_drafter(target, aux, draft_vocab=vocab_draft).cuda()


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_tokenizer, tmp_path_factory):
    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("tiny-qwen3")
    build_random_target(d, tiny_tokenizer[0], model_type="qwen3", num_layers=4, hidden_size=64)
    return d


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    """A Llama with 8 tokens: random drafts are often right, so trees accept through second children (KV moves)."""
    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("vocab8")
    build_random_target(d, None, model_type="llama", num_layers=4, hidden_size=64, vocab_size=8)
    return d


@pytest.mark.parametrize("which", ["llama", "qwen3", "deepseek_v3", "vocab8"])
def test_gpu_fastdecode_graphs_equal_eager(which, tiny_llama, tiny_qwen3, tiny_deepseek, vocab8):
    from hstap.speculative.drivers import ngram_generate, speculative_generate, target_generate
    from hstap.speculative.fast import FastDecoder

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
        lean = FastDecoder(target, drafter, max_len=128, compile=False, lean=True)  # the lean draft steps, captured
        for kw in (dict(mode="chain", k=4), dict(mode="tree", topk=3, depth=4, tokens=10)):
            out, st = lean.speculative_generate(prompt, 40, **kw)
            eager, est = speculative_generate(target, drafter, prompt, 40, **kw)
            assert out == ref and st["graphs"] and st["host_s"] >= 0, kw
            assert st["accept_counts"] == est["accept_counts"], kw


def test_gpu_fastdecode_one_host_sync_per_round(tiny_llama):
    import warnings

    from hstap.speculative.fast import FastDecoder

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


@pytest.mark.parametrize("kernels", ["standard", "fused"])
def test_gpu_fastdecode_compiled_equals_eager(tiny_llama, kernels):
    """torch.compile'd steps inside the graphs (the default on CUDA): the same tokens; compiling takes minutes.
    fused: speculative/fast.py FUSED (`hstap eval --kernels fused`): the lean target and drafter layers, math attention,
    few-row products as fused reductions, coordinate-descent tuning; also the same acceptance as speculative/drivers.py."""
    from hstap.speculative.drivers import ngram_generate, speculative_generate, target_generate
    from hstap.speculative.fast import FUSED, FastDecoder

    target, drafter = _fast_setup(tiny_llama)
    said: list[str] = []
    fd = FastDecoder(target, drafter, max_len=128, compile=True, log=said.append,
                     **(FUSED if kernels == "fused" else {}))
    assert fd.unsupported is None and (fd.lt is not None) == (kernels == "fused"), said
    prompt = [1, 3, 50, 60, 70, 2, 4]
    ref, _ = target_generate(target, prompt, 24)
    out, st = fd.target_generate(prompt, 24)
    assert out == ref and st["graphs"] and st["compiled"]
    for kw in (dict(mode="chain", k=3), dict(mode="tree", topk=3, depth=3, tokens=8)):
        out, st = fd.speculative_generate(prompt, 24, **kw)
        assert out == ref and st["graphs"] and st["compiled"], kw
        if kernels == "fused":
            assert st["accept_counts"] == speculative_generate(target, drafter, prompt, 24, **kw)[1]["accept_counts"]
    out, st = fd.ngram_generate(prompt + ref[:8] + prompt, 16)
    assert out == ngram_generate(target, prompt + ref[:8] + prompt, 16)[0] and st["graphs"] and st["compiled"]
    assert kernels == "standard" or said == [], said


# --- fault tolerance: the flex kernel choice, and SIGKILL / disk full on the GPU path -------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flex_first_call_on_a_short_static_batch_compiles(dtype):
    """The recorded resume failure at its root: the process's first flex call has a static batch and a query shorter
    than 128 (query (7, 4, 79, 16), 2 query heads per kv head). Inductor's flex-decoding kernel had no config for it
    (BLOCK_M 256 > the 128-row query block): NoValidChoicesError. FLEX_KERNEL_OPTIONS takes the main kernel; here it
    must compile (no SDPA fallback) and agree with the SDPA path (fp32: to 1e-4)."""
    from helpers import drafter as td

    from hstap.models.drafter import DrafterConfig, Eagle3Drafter
    from hstap.train.ttt import TTTModel, step_rows, target_distribution

    torch._dynamo.reset()  # forget earlier graphs and dynamic-shape history: this call compiles static, as a fresh run
    g = torch.Generator().manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                        vocab_size=td.V, draft_vocab_size=td.VD, target_hidden_size=32, num_aux=1)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg).cuda()
    hot = torch.tensor([1, 4, 5, 9, 16, 20])
    t2d = torch.zeros(td.V, dtype=torch.bool)
    t2d[hot] = True
    d.set_vocab_map((hot - torch.arange(td.VD)).cuda(), t2d.cuda())
    B, T, K = 7, 79, 3
    ids = torch.randint(0, td.V, (B, T), generator=g).cuda()
    feats = torch.randn(B, T, 1, 32, generator=g).cuda()
    tb = target_distribution(torch.randn(B, T, 32, generator=g).cuda(), torch.ones(B, T, dtype=torch.long).cuda(),
                             torch.full((B,), T).cuda(), torch.randn(td.V, 32, generator=g).cuda(), hot.cuda(),
                             t2d.cuda())
    denom = torch.tensor([float(step_rows(tb, T, k)[0].numel()) for k in range(K)], device="cuda")
    res = {}
    for attn in ("flex", "sdpa"):
        d.zero_grad(set_to_none=True)
        model = TTTModel(d, ttt=K, attn=attn)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss, _ = model(ids, feats, tb, denom)
        loss.backward()
        assert model.attn == attn and model.attn_fallback is None, model.attn_fallback
        res[attn] = (loss.detach(), [p.grad.clone() for p in d.parameters() if p.requires_grad])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "fp32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(res["flex"][0], res["sdpa"][0], **tol)
    if dtype == "fp32":
        for g1, g2 in zip(res["flex"][1], res["sdpa"][1]):
            torch.testing.assert_close(g1, g2, rtol=1e-3, atol=1e-4)


@pytest.fixture(scope="module")
def train_assets(tiny_tokenizer, tmp_path_factory):
    """tests/train/test_train.py's assets (28 samples, an fp32 store): the run that failed on resume ran on these."""
    from helpers.train import build_assets

    return build_assets(tmp_path_factory.mktemp("cuda-train"), tiny_tokenizer[0])


def _train_argv(a, out, **kw) -> list[str]:
    opts = {"store": a["store"], "target": a["target"], "out": out, "batch_tokens": 600, "ttt": 3, "log_every": 1,
            "skip_verify": True, "device": "cuda", "steps": 16, "save_every": 4, "eval_frac": 0.2, "lr": 2e-3,
            "tensorboard": False, **kw}
    argv = ["train"]
    for k, v in opts.items():
        argv += [f"--{k.replace('_', '-')}", str(v).lower() if isinstance(v, bool) else str(v)]
    return argv


@pytest.mark.procs
def test_cuda_training_sigkill_then_resume_follows_the_uninterrupted_trajectory(train_assets, tmp_path):
    """`hstap train --device cuda` (bf16 autocast, compiled flex) killed with SIGKILL at a random moment after its
    first, second or third checkpoint, then `--resume`d: every run completes on flex (no fallback), and the 16 logged
    losses equal an uninterrupted CUDA run's within rtol 5e-3.

    Why that tolerance: resume restores the fp32 weights, AdamW state, schedule, data position and RNG exactly (on CPU
    fp32 the resumed trajectory is bitwise the uninterrupted one, tests/train/test_train.py); what remains on CUDA is which
    compiled kernels ran: a resumed process compiles its first shapes static where the uninterrupted one runs dynamic
    graphs, so inductor's reductions (flex backward's delta, fused epilogues) may sum in another order, in bf16
    autocast: ~1e-3 relative per attention output, far below the several percent by which the loss moves from one
    batch to the next here. The data position and the schedule are checked exactly (tokens seen, lr)."""
    import random

    from helpers.cuda import Cli, record, wait_for
    from helpers.train import metrics

    rng = random.Random(19)
    ref = Cli(_train_argv(train_assets, tmp_path / "ref"), tmp_path / "ref.log")
    victims = []
    for i, ck in enumerate((4, 8, 12)):  # kill after checkpoint `ck`, somewhere in the step after it
        run = tmp_path / f"run{i}"
        victims.append((run, ck, Cli(_train_argv(train_assets, run), tmp_path / f"victim{i}.log")))
    delays = [rng.uniform(0.0, 0.03) for _ in victims]

    def kill_after(run, ck, v, delay):  # one thread per victim: they run at once, each is killed at its own moment
        if wait_for((run / "checkpoints" / f"step_{ck:08d}").exists, v, poll=0.001):
            time.sleep(delay)
            v.kill()

    threads = [threading.Thread(target=kill_after, args=(*x, dl)) for x, dl in zip(victims, delays)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for run, ck, v in victims:
        assert v.wait() == -9, f"not killed after checkpoint {ck}:\n{v.output()[-3000:]}"
    resumed = [Cli(_train_argv(train_assets, run, resume=True), tmp_path / f"resume{i}.log")
               for i, (run, _, _) in enumerate(victims)]
    assert ref.wait() == 0, ref.output()[-3000:]
    (a, ea), report = metrics(tmp_path / "ref"), {"tolerance_rel": 5e-3, "runs": []}
    for (run, ck, _), r in zip(victims, resumed):
        assert r.wait() == 0, r.output()[-3000:]
        log = r.output()
        assert "resumed from step_" in log, log[-2000:]
        at = int(log.split("resumed from step_")[1][:8])  # the newest complete checkpoint: ck, or one written later
        assert at >= ck and "hstap train: TTT attention flex:" in log and "from now on" not in log, log[-3000:]
        b, eb = metrics(run)
        assert [x["step"] for x in b] == list(range(1, 17))
        assert [x["tokens"] for x in b] == [x["tokens"] for x in a] and [x["lr"] for x in b] == [x["lr"] for x in a]
        rel = [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(b, a)]
        report["runs"].append({"killed_after": ck, "resumed_from": at, "max_rel_before": max(rel[:at]),
                               "max_rel_after": max(rel[at:]), "bitwise": rel == [0.0] * 16})
        assert max(rel) <= 5e-3, (ck, rel)
        assert [e["step"] for e in eb] == [e["step"] for e in ea]
    record("cuda_train_resume", report)


@pytest.fixture(scope="module")
def capture_data(tiny_llama, tmp_path_factory):
    """120 prepared samples and their store from one uninterrupted in-process CUDA capture (bf16 compute, bf16 store,
    one sample per batch: the resumed runs below pack the same batches, so their values must be bitwise equal)."""
    from helpers.capture import make_prepared, store_samples

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    root = tmp_path_factory.mktemp("cuda-capture")
    prepared = make_prepared(tiny_llama, root / "prep", 120, seed=4)
    with contextlib.redirect_stdout(io.StringIO()):
        capture(CaptureConfig(target=str(tiny_llama), data=str(prepared), out=str(root / "ref"), layers="1,2,4",
                              dtype="bf16", device="cuda", compute_dtype="bf16", batch_tokens=1, shard_tokens=300))
    return prepared, store_samples(root / "ref")


def _capture_argv(target, prepared, out) -> list[str]:
    return ["capture", "--target", target, "--data", prepared, "--out", out, "--layers", "1,2,4", "--dtype", "bf16",
            "--device", "cuda", "--compute-dtype", "bf16", "--batch-tokens", "1", "--shard-tokens", "300",
            "--queue-size", "1"]


def _same_bitwise(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for sid, x in got.items():
        y = ref[sid]
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "loss_mask", "aux", "final")), sid


@pytest.mark.procs
def test_cuda_capture_sigkill_then_resume_stores_every_sample_once_bitwise(tiny_llama, capture_data, tmp_path):
    """`hstap capture --device cuda` killed with SIGKILL at random moments (after 1-4 commits, plus jitter), then run
    again until done: after every kill the committed shards verify and hold no id twice; the finished store holds every
    sample once, bitwise equal to the uninterrupted capture (same compute dtype, one sample per batch)."""
    import random

    from helpers.capture import store_samples
    from helpers.cuda import Cli, commits, wait_for

    from hstap.store.reader import open_store

    prepared, ref = capture_data
    out, rng, history = tmp_path / "store", random.Random(1919), []
    for i in range(3):
        before = len(open_store(out)) if (out / "manifest.json").exists() else 0
        c = Cli(_capture_argv(tiny_llama, prepared, out), tmp_path / f"kill{i}.log")
        want = commits(out) + rng.randint(1, 4)
        wait_for(lambda: commits(out) >= want, c, timeout=120)
        time.sleep(rng.uniform(0, 0.01))
        alive = c.alive()
        c.kill()
        code = c.wait()
        assert code == (-9 if alive else 0), c.output()[-3000:]  # killed, or it had finished: nothing else
        got = store_samples(out)  # verify() clean, no id twice
        history.append((alive, code, before, len(got)))
        assert len(got) >= before, history  # a kill never loses committed samples
        _same_bitwise(got, {k: ref[k] for k in got})
    assert any(alive and 0 < n < len(ref) for alive, _, _, n in history), history  # a kill landed mid-capture
    c = Cli(_capture_argv(tiny_llama, prepared, out), tmp_path / "final.log")
    assert c.wait() == 0, c.output()[-3000:]
    _same_bitwise(store_samples(out), ref)
    assert not list((out / "shards").glob(".*.tmp"))


@pytest.mark.procs
def test_cuda_capture_on_a_full_disk_stops_with_one_error_line_then_resumes(tiny_llama, capture_data, tmp_path):
    """A 2 MiB tmpfs fills up during a CUDA capture (~6 MB of bf16 states): exit 2 with one `hstap: error:` line naming
    the store's file and 'no space left on device', no traceback; what was committed verifies; once the filesystem is
    remounted larger, the same command completes the store: every sample once, bitwise equal to the uninterrupted
    run."""
    import gc

    from helpers.capture import store_samples
    from helpers.cuda import Cli
    from helpers.store import grow_tmpfs, small_tmpfs

    from hstap.store.reader import open_store

    prepared, ref = capture_data
    with small_tmpfs(tmp_path / "small", "2m") as mnt:
        out = mnt / "store"
        c = Cli(_capture_argv(tiny_llama, prepared, out), tmp_path / "full.log")
        code, log = c.wait(), c.output()
        errors = [ln for ln in log.splitlines() if ln.startswith("hstap: error:")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
        assert str(out) in errors[0] and "no space left on device" in errors[0], errors
        got = store_samples(out)  # the committed shards: verify() clean, no id twice
        assert 0 < len(got) < len(ref), len(got)
        _same_bitwise(got, {k: ref[k] for k in got})
        assert not list((out / "shards").glob(".*.tmp"))  # the failed shard's temp file is gone
        del got
        gc.collect()
        grow_tmpfs(mnt, "64m")  # space freed
        c = Cli(_capture_argv(tiny_llama, prepared, out), tmp_path / "resume.log")
        assert c.wait() == 0, c.output()[-3000:]
        _same_bitwise(store_samples(out), ref)
        assert len(open_store(out)) == len(ref)
