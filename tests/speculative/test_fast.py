"""The fast decoder (hstap.speculative.fast: static caches, device-side trees and acceptance) against the eager one
(hstap.speculative.drivers) on tiny random CPU targets: the same tokens (greedy; Llama, Qwen2, Qwen3, DeepSeek-V3), the same
EAGLE-2 trees node for node, caches after tree rounds equal to a fresh prefill, the output law at temperature > 0
(chi-square), one host read per round, and the one-line fallbacks."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from helpers.speculate import chi2_pvalue, load_tiny_target, oracle_drafter, random_drafter

from hstap.common import HstapError
from hstap.models.drafter import DrafterCache
from hstap.speculative.device_tree import TreeShape, accept_greedy, best, draft, ranks, top_k
from hstap.speculative.draft_tree import draft_tree, tree_mask
from hstap.speculative.drivers import (drafter_extend, new_cache, ngram_generate, prefill, speculative_generate,
                                target_forward, target_generate)
from hstap.speculative.fast import FastDecoder
from hstap.speculative.static_kv import DrafterStaticCache

TYPES = ["llama", "qwen2", "qwen3", "deepseek_v3"]


@pytest.fixture(scope="module")
def tiny_models(tiny_llama, tiny_deepseek, tiny_tokenizer, tmp_path_factory) -> dict:
    from hstap.demo.toy import build_random_target

    paths = {"llama": tiny_llama, "deepseek_v3": tiny_deepseek}
    for mt in ("qwen2", "qwen3"):
        d = tmp_path_factory.mktemp(f"tiny-{mt}")
        build_random_target(d, tiny_tokenizer[0], model_type=mt, num_layers=4, hidden_size=64)
        paths[mt] = d
    return {mt: load_tiny_target(p)[0] for mt, p in paths.items()}


def _prompt(V: int, n: int, seed: int) -> list[int]:
    return torch.randint(6, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mt", TYPES)
def test_static_forward_equals_model(tiny_models, mt):
    target = tiny_models[mt]
    fd = FastDecoder(target, max_len=64)
    assert fd.unsupported is None and fd.S == 256
    prompt = _prompt(target.vocab_size, 9, seed=1)
    logits, aux = fd._prefill(prompt, (1, 2))
    ref_logits, ref_aux = target_forward(target, torch.tensor([prompt]), [1, 2], new_cache())
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mt", TYPES)
def test_greedy_equals_eager_and_target(tiny_models, mt):
    target = tiny_models[mt]
    prompt = _prompt(target.vocab_size, 8, seed=6)
    ref, _ = target_generate(target, prompt, 40)
    random_d = random_drafter(target, (1, 2, 3), draft_vocab=300)
    oracle = oracle_drafter(target, prompt + ref, second=range(len(prompt) + 1, len(prompt) + 40, 2))
    runs = [(random_d, dict(mode="chain", k=3)), (random_d, dict(mode="tree", topk=3, depth=4, tokens=10)),
            (oracle, dict(mode="chain", k=4)), (oracle, dict(mode="tree", topk=2, depth=4, tokens=12))]
    for drafter, kw in runs:
        fd = FastDecoder(target, drafter, max_len=64)
        out, st = fd.speculative_generate(prompt, 32, **kw)
        eager, est = speculative_generate(target, drafter, prompt, 32, **kw)
        assert out == eager == ref[:32], kw
        assert st["accept_counts"] == est["accept_counts"] and st["kv_moves"] == est["kv_moves"], kw
        assert fd.host_reads == st["verify_forwards"] == est["verify_forwards"]  # one read per round, no more
    assert st["kv_moves"] > 0 and st["tau"] > 2.5  # the oracle tree accepted through second children
    fd = FastDecoder(target, max_len=64)
    assert fd.target_generate(prompt, 40)[0] == ref
    out, st = fd.ngram_generate(prompt + ref[:20] + prompt, 30)  # repeats: n-gram drafts get accepted
    eager, est = ngram_generate(target, prompt + ref[:20] + prompt, 30)
    assert out == eager and st["accept_counts"] == est["accept_counts"]


def test_sort_free_selections_equal_sorts():
    """top_k / ranks / best (the device tree's sort-free selections) equal topk and a stable descending sort, ties
    to the lower index; the greedy acceptance's path equals the sorted on-path nodes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g)
    v, i = top_k(x, 4)
    rv, ri = x.topk(4, -1)
    assert torch.equal(v, rv) and torch.equal(i, ri)
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    assert top_k(tied, 4)[1].tolist() == [[1, 2, 4, 5]]
    wide = torch.randn(3, 8192, generator=g)  # two stages (blocks of ids), ties across blocks
    assert torch.equal(top_k(wide, 5)[1], wide.topk(5, -1).indices)
    wide[1] = 0.0
    wide[1, [7000, 300, 5]] = 2.0
    assert top_k(wide, 5)[1][1].tolist() == [5, 300, 7000, 0, 1]
    for s in (torch.randn(37, generator=g), torch.randint(0, 4, (37,), generator=g).float()):
        order = torch.sort(s, descending=True, stable=True).indices
        assert torch.equal(ranks(s).argsort(), order) and torch.equal(best(s, 9), order[:9])
    # a tree 0 -> {1, 2}, 1 -> {3}, 3 -> {4}; the target's argmax at each node
    parent = torch.tensor([0, 0, 0, 1, 3])
    anc = tree_mask([-1, 0, 0, 1, 3], 0, torch.float32, "cpu")[0, 0] == 0
    tok = torch.tensor([9, 5, 6, 7, 8])
    logits = torch.full((5, 10), -1.0)
    for node, am in enumerate([5, 7, 0, 8, 2]):
        logits[node, am] = 1.0
    a, path, y = accept_greedy(logits, tok, parent, anc, P=5)
    assert (int(a), path[:4].tolist(), int(y)) == (3, [0, 1, 3, 4], 2)


@pytest.mark.parametrize("topk,depth,tokens", [(3, 4, 10), (2, 5, 8), (4, 3, 30), (3, 3, 50), (1, 5, 6)])
def test_device_tree_equals_draft_tree(tiny_models, topk, depth, tokens):
    """The on-device EAGLE-2 construction keeps the eager tree's nodes, parents and depths, in the same order."""
    target = tiny_models["llama"]
    drafter = random_drafter(target, (1, 2, 3), draft_vocab=300, seed=topk)
    st = prefill(target, drafter, _prompt(target.vocab_size, 11, seed=depth))
    h_last = drafter_extend(drafter, st.dcache, *st.pending)  # (1, 1, H)
    L = len(st.ids)
    ref = draft_tree(drafter, st.dcache, h_last, st.ids[-1], L - 1, topk, depth, tokens)
    c = drafter.config
    dc = DrafterStaticCache(c.num_key_value_heads, c.head_dim, 64, torch.float32, "cpu")
    dc.k[:, :, :L - 1], dc.v[:, :, :L - 1] = st.dcache.k, st.dcache.v
    hot = torch.arange(c.draft_vocab_size) + drafter.d2t
    t = draft(drafter, dc, h_last[0], torch.tensor(st.ids[-1]), torch.tensor(L - 1), torch.arange(64),
              TreeShape(topk, depth, tokens), hot)
    assert t["tok"].tolist() == ref.tokens and t["depth"].tolist() == ref.depths
    assert t["parent"].tolist() == [max(p, 0) for p in ref.parents]
    assert torch.equal(t["anc"], tree_mask(ref.parents, 0, torch.float32, "cpu")[0, 0] == 0)
    assert len(ref.tokens) == min(tokens, TreeShape(topk, depth, tokens).C + 1)


def test_caches_after_tree_rounds_equal_fresh_prefill(tiny_models):
    target = tiny_models["llama"]
    prompt = _prompt(target.vocab_size, 12, seed=3)
    ref, _ = target_generate(target, prompt, 30)
    seq = prompt + ref
    drafter = oracle_drafter(target, seq, second=range(len(prompt) + 2, len(seq), 3))
    fd = FastDecoder(target, drafter, max_len=64)
    out, st = fd.speculative_generate(prompt, 24, mode="tree", topk=2, depth=3, tokens=7)
    assert out == ref[:24] and st["kv_moves"] > 0  # accepted paths skipped tree slots: entries were gathered
    b = next(s.buf for s in fd.steps.values() if hasattr(s, "buf"))
    n = len(prompt) + len(out) - 1  # committed on the host; the device may be ahead (a round cut by max_new)
    assert int(b["start"]) >= n
    fresh = new_cache()
    _, aux = target_forward(target, torch.tensor([seq[:n]]), [1, 2, 3], fresh)
    for layer, want in zip(fd.cache.layers, fresh.layers):
        torch.testing.assert_close(layer.keys[:, :, :n], want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values[:, :, :n], want.values, atol=1e-5, rtol=1e-5)
    m = min(n, int(b["start"]) - int(b["pend_n"]))  # drafter entries before the pending pairs
    dref = DrafterCache()
    drafter_extend(drafter, dref, seq[1:n + 1], aux, 0)
    torch.testing.assert_close(fd.dcache.k[:, :, :m], dref.k[:, :, :m], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fd.dcache.v[:, :, :m], dref.v[:, :, :m], atol=1e-4, rtol=1e-4)


def test_eos_stops(tiny_models):
    target = tiny_models["llama"]
    prompt = _prompt(target.vocab_size, 8, seed=7)
    ref, _ = target_generate(target, prompt, 24)
    eos = ref[9]
    stop = ref.index(eos) + 1
    fd = FastDecoder(target, oracle_drafter(target, prompt + ref), max_len=64)
    assert fd.target_generate(prompt, 24, eos_ids=[eos])[0] == ref[:stop]
    assert fd.speculative_generate(prompt, 24, k=4, eos_ids=[eos])[0] == ref[:stop]
    assert fd.ngram_generate(prompt, 24, eos_ids=[eos])[0] == ref[:stop]


# --- temperature > 0: the output law is the target's -------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab4(tmp_path_factory):
    """A 2-layer Llama with a 4-token vocabulary (64 outcomes for 3 tokens) and a drafter over 3 of them."""
    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("vocab4")
    build_random_target(d, None, model_type="llama", num_layers=2, hidden_size=16, num_heads=2, num_kv_heads=1,
                        intermediate_size=32, vocab_size=4)
    target = load_tiny_target(d)[0]
    return target, random_drafter(target, (0, 1), draft_vocab=3, seed=1)


def _law(target, prompt: list[int], n: int, temperature: float) -> dict:
    probs = {}
    for seq in itertools.product(range(target.vocab_size), repeat=n):
        pr = 1.0
        logits, _ = target_forward(target, torch.tensor([prompt + list(seq[:-1])]), [], new_cache())  # (T, V)
        for i, t in enumerate(seq):
            pr *= float(torch.softmax(logits[len(prompt) - 1 + i] / temperature, -1)[t])
        probs[seq] = pr
    return probs


@pytest.mark.parametrize("method,N", [("chain", 500), ("ngram", 400), ("target", 300)])
def test_sampling_law_equals_target(vocab4, method, N):
    target, drafter = vocab4
    prompt, n, temp = [1, 2, 1, 3, 1, 2, 1], 3, 1.0  # repeats: n-gram lookup finds drafts
    fd = FastDecoder(target, drafter, max_len=32)
    gen = torch.Generator().manual_seed(1234)
    counts: dict = {}
    accepted = 0
    for _ in range(N):
        if method == "chain":
            out, st = fd.speculative_generate(prompt, n, mode="chain", k=2, temperature=temp, generator=gen)
        elif method == "ngram":
            out, st = fd.ngram_generate(prompt, n, k=2, temperature=temp, generator=gen)
        else:
            out, st = fd.target_generate(prompt, n, temperature=temp, generator=gen)
        accepted += sum(st.get("accept_counts", [0]))
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    probs = _law(target, prompt, n, temp)
    assert chi2_pvalue(counts, probs, N) > 1e-3
    assert chi2_pvalue(counts, _law(target, prompt, n, temp / 3), N) < 1e-6  # the test tells close laws apart
    assert method == "target" or accepted > N // 4  # drafts were accepted and rejected: both branches ran


# --- fallbacks, said once ------------------------------------------------------------------------------------------
def test_tree_sampling_falls_back_with_one_line(tiny_models):
    target = tiny_models["llama"]
    drafter = random_drafter(target, (1, 2, 3), draft_vocab=300)
    said: list[str] = []
    fd = FastDecoder(target, drafter, max_len=64, log=said.append)
    prompt = _prompt(target.vocab_size, 8, seed=2)
    kw = dict(mode="tree", topk=2, depth=3, tokens=6, temperature=0.8)
    for _ in range(2):
        out, _ = fd.speculative_generate(prompt, 10, generator=torch.Generator().manual_seed(5), **kw)
        assert out == speculative_generate(target, drafter, prompt, 10, generator=torch.Generator().manual_seed(5),
                                           **kw)[0]
    assert len(said) == 1 and "eager decoder" in said[0] and "temperature > 0" in said[0]


def test_deeper_drafter_falls_back_with_one_line(tiny_models):
    target = tiny_models["llama"]
    drafter = random_drafter(target, (1, 2, 3), draft_vocab=300, num_layers=2)
    said: list[str] = []
    fd = FastDecoder(target, drafter, max_len=64, log=said.append)
    prompt = _prompt(target.vocab_size, 8, seed=3)
    for _ in range(2):
        assert fd.speculative_generate(prompt, 10, k=3)[0] == speculative_generate(target, drafter, prompt, 10, k=3)[0]
    assert len(said) == 1 and "2-layer drafter" in said[0] and "eager decoder" in said[0]


def test_unsupported_cache_falls_back_with_one_line(tiny_tokenizer, tmp_path):
    from hstap.demo.toy import build_random_target

    build_random_target(tmp_path, tiny_tokenizer[0], model_type="mistral", num_layers=2, hidden_size=64,
                        sliding_window=32)
    target = load_tiny_target(tmp_path)[0]
    said: list[str] = []
    fd = FastDecoder(target, random_drafter(target, (0, 1), draft_vocab=300), max_len=64, log=said.append)
    assert "sliding window 32" in fd.unsupported
    prompt = _prompt(target.vocab_size, 8, seed=9)
    ref, _ = target_generate(target, prompt, 12)
    assert fd.target_generate(prompt, 12)[0] == ref and fd.speculative_generate(prompt, 12, k=2)[0] == ref
    assert len(said) == 1 and "eager decoder" in said[0]
    with pytest.raises(HstapError, match="needs a CUDA target"):
        FastDecoder(target, graphs=True)


@pytest.mark.parametrize("kernels", ["standard", "fused"])
def test_eval_fast_engine_on_cpu(tiny_llama, tmp_path, capsys, kernels):
    from hstap.artifacts.drafter_dir import save_drafter
    from hstap.config import from_flags
    from hstap.speculative.config import EvalConfig
    from hstap.speculative.evaluate import evaluate

    target = load_tiny_target(tiny_llama)[0]
    save_drafter(tmp_path / "d", random_drafter(target, (1, 2, 3), draft_vocab=300))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content": c}]}) + "\n"
                            for i, c in enumerate(["def parse(s):", "json.dumps"])))
    evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(tmp_path / "d"), data=str(data),
                        out=str(tmp_path / "r"), mode="tree", topk=2, depth=3, tokens=6, max_new_tokens=10,
                        baseline="ngram", device="cpu", engine="fast", kernels=kernels))
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["engine"] == "fast" and rep["lossless"] is True and set(rep["methods"]) == {"target", "ngram", "eagle"}
    assert rep["kernels"] == kernels and f"({kernels} kernels)" in (tmp_path / "r" / "report.md").read_text()
    assert rep["compiled"] is False  # torch.compile'd steps are for CUDA (the CPU runs them as they are)
    for m in rep["methods"].values():
        assert m["verify_ms_per_round"] > 0 and m["host_ms_per_round"] >= 0
    from hstap.speculative.latency import round_model

    eagle = rep["methods"]["eagle"]
    assert rep["predicted_speedup"] == pytest.approx(round_model(eagle, rep["methods"]["target"]))
    assert eagle["predicted_speedup_naive"] == pytest.approx(rep["tau"] / (1 + eagle["draft_s"] / eagle["verify_s"]))
    assert "predicted speedup (hstap.speculative.latency.round_model)" in (tmp_path / "r" / "report.md").read_text()
    err = capsys.readouterr().err  # progress per method on the fast engine too: prompts done / total, tokens/s
    for m in ("target", "ngram", "eagle"):
        assert f"hstap eval: {m}: 2/2 prompts, " in err and "tokens/s" in err, err
    assert (tmp_path / "r" / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the lean draft path (FastDecoder(lean=True)): fewer kernels, the same drafts ---------------------------------
@pytest.mark.parametrize("mt,attention,fuse_rows", [("llama", "sdpa", 0), ("qwen3", "sdpa", 0), ("llama", "math", 8)])
def test_lean_drafter_equals_drafter(tiny_models, mt, attention, fuse_rows):
    """LeanDrafter (fused q/k/v and gate/up GEMMs, rotary tables, grouped SDPA) is the drafter's forward."""
    from hstap.models.lean_drafter import LeanDrafter
    from hstap.speculative.static_kv import causal_rows

    target = tiny_models[mt]
    drafter = random_drafter(target, (1, 2, 3), draft_vocab=300)
    c = drafter.config
    assert c.num_attention_heads > c.num_key_value_heads  # grouped heads: the stacked-query path is exercised
    S, T = 64, 5
    lean = LeanDrafter(drafter, S, attention, fuse_rows)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (1, T), generator=g)
    hidden = torch.randn(1, T, c.hidden_size, generator=g)
    pos = torch.tensor([[3, 9, 10, 11, 40]])
    slots = torch.tensor([3, 9, 10, 11, 40])
    caches = [DrafterStaticCache(c.num_key_value_heads, c.head_dim, S, torch.float32, "cpu") for _ in range(2)]
    for dc in caches:  # the same earlier entries in both
        dc.k.copy_(torch.randn(dc.k.shape, generator=torch.Generator().manual_seed(1)))
        dc.v.copy_(torch.randn(dc.v.shape, generator=torch.Generator().manual_seed(2)))
    mask = causal_rows(torch.arange(S), slots)  # (T, S)
    want = drafter(ids, hidden, pos, caches[0].at(slots), mask)
    got = lean(ids, hidden, pos, caches[1].at(slots), mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lean.compute_logits(got), drafter.compute_logits(want), atol=1e-5, rtol=1e-5)
    aux = torch.randn(1, T, len(c.aux_layers), c.target_hidden_size, generator=g)
    torch.testing.assert_close(lean.project(aux), drafter.project(aux), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-6, rtol=1e-6)


def test_lean_decoding_equals_eager(tiny_models):
    """lean=True: chains draft with argmax alone, trees through LeanDrafter; tokens and acceptance as speculative/drivers.py."""
    target = tiny_models["qwen3"]
    prompt = _prompt(target.vocab_size, 8, seed=6)
    ref, _ = target_generate(target, prompt, 32)
    random_d = random_drafter(target, (1, 2, 3), draft_vocab=300)
    oracle = oracle_drafter(target, prompt + ref, second=range(len(prompt) + 1, len(prompt) + 32, 2))
    for drafter, kw in [(random_d, dict(mode="chain", k=3)), (random_d, dict(mode="tree", topk=3, depth=3, tokens=8)),
                        (oracle, dict(mode="chain", k=4)), (oracle, dict(mode="tree", topk=2, depth=4, tokens=12))]:
        fd = FastDecoder(target, drafter, max_len=64, lean=True)
        out, st = fd.speculative_generate(prompt, 24, **kw)
        eager, est = speculative_generate(target, drafter, prompt, 24, **kw)
        assert out == eager == ref[:24], kw
        assert st["accept_counts"] == est["accept_counts"] and st["kv_moves"] == est["kv_moves"], kw
    assert st["tau"] > 2  # the oracle's drafts were accepted: the argmax chain and the lean tree ran for real


# --- the lean target layers (FastDecoder(target_layers="lean"), attention "sdpa" or "math") --------------------------
@pytest.mark.parametrize("attention,fuse_rows", [("sdpa", 0), ("math", 0), ("math", 16)])
@pytest.mark.parametrize("mt", TYPES)
def test_lean_target_forward_equals_model(tiny_models, mt, attention, fuse_rows):
    """hstap.models.lean_target (fused q/k/v and gate/up, rotary tables, one grouped attention call) is the model's forward
    for the Llama family (Qwen2's biases, Qwen3's q/k norms); DeepSeek-V3 keeps its own layers after one line."""
    target = tiny_models[mt]
    said: list[str] = []
    fd = FastDecoder(target, max_len=64, target_layers="lean", attention=attention, fuse_rows=fuse_rows,
                     log=said.append)
    assert fd.unsupported is None
    if mt == "deepseek_v3":
        assert fd.lt is None and len(said) == 1 and "model type 'deepseek_v3'" in said[0], said
    else:
        assert fd.lt is not None and not said, said
    prompt = _prompt(target.vocab_size, 9, seed=1)
    logits, aux = fd._prefill(prompt, (1, 2))
    ref_logits, ref_aux = target_forward(target, torch.tensor([prompt]), [1, 2], new_cache())
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)


def test_fuse_bytes_caps_the_reductions():
    """lean_target.linear: a few-row product is a broadcast sum only for weights up to fuse_bytes; above, F.linear
    itself (bitwise)."""
    from hstap.models.lean_target import linear

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 64, generator=g), torch.randn(48, 64, generator=g)  # w: 12 KiB of fp32
    ref = torch.nn.functional.linear(x, w)
    assert torch.equal(linear(x, w, None, 8, fuse_bytes=w.numel() * 4 - 1), ref)
    assert torch.equal(linear(x, w, None, 8, fuse_bytes=w.numel() * 4), (x.unsqueeze(-2) * w).sum(-1))
    torch.testing.assert_close(linear(x, w, None, 8), ref)


@pytest.mark.parametrize("mt,attention,fuse_rows,fuse_bytes", [("llama", "sdpa", 0, 16 << 20),
                                                               ("qwen2", "math", 8, 16 << 20),
                                                               ("llama", "math", 16, 40 << 10)])
def test_lean_target_decoding_equals_eager(tiny_models, mt, attention, fuse_rows, fuse_bytes):
    """Every method over the lean target layers (and the lean drafter) gives speculative/drivers.py's tokens and acceptance."""
    target = tiny_models[mt]
    prompt = _prompt(target.vocab_size, 8, seed=6)
    ref, _ = target_generate(target, prompt, 32)
    oracle = oracle_drafter(target, prompt + ref, second=range(len(prompt) + 1, len(prompt) + 32, 2))
    fd = FastDecoder(target, oracle, max_len=64, target_layers="lean", lean=True, attention=attention,
                     fuse_rows=fuse_rows, fuse_bytes=fuse_bytes)
    assert fd.lt is not None
    assert fd.target_generate(prompt, 32)[0] == ref
    assert fd.ngram_generate(prompt, 32, k=3)[0] == ngram_generate(target, prompt, 32, k=3)[0] == ref
    for kw in [dict(mode="chain", k=4), dict(mode="tree", topk=2, depth=4, tokens=12)]:
        out, st = fd.speculative_generate(prompt, 24, **kw)
        eager, est = speculative_generate(target, oracle, prompt, 24, **kw)
        assert out == eager == ref[:24], kw
        assert st["accept_counts"] == est["accept_counts"] and st["kv_moves"] == est["kv_moves"], kw
    assert st["tau"] > 2 and st["kv_moves"] > 0  # drafts were accepted, through second children


def test_lean_target_keeps_biases_and_leaves_the_model_alone():
    """A Llama with q/k/v/o and MLP biases (random, non-zero): the lean layers keep every bias; the model's own
    weights are not touched (a decoder built on it before keeps valid pointers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hstap.models.target import Target

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, mlp_bias=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    target = Target(model)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    said: list[str] = []
    fd = FastDecoder(target, max_len=32, target_layers="lean", log=said.append)
    assert fd.lt is not None and not said, said
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    prompt = _prompt(96, 7, seed=2)
    logits, aux = fd._prefill(prompt, (0, 1))
    ref_logits, ref_aux = target_forward(target, torch.tensor([prompt]), [0, 1], new_cache())
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)
