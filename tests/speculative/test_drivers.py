"""Speculative decoding: KV rollback, greedy losslessness (real tiny models), pinned accept patterns (stub models with
fixed logits) and the output distribution at temperature > 0 (chi-square, fixed seeds). Exact tree attention and the
tree's nodes: tests/speculative/test_draft_tree.py; the acceptance rule on hand-built trees: tests/speculative/test_acceptance.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hstap.common import HstapError
from hstap.models.drafter import DrafterCache
from hstap.speculative.drivers import (NgramIndex, drafter_extend, new_cache, ngram_generate, prefill, spec_step,
                                speculative_generate, target_forward, target_generate)
from helpers.speculate import (StubDrafter, StubTarget, chi2_pvalue, load_tiny_target, oracle_drafter,
                               random_drafter, random_prompts)


# --- exactness of the pieces ------------------------------------------------------------------------------------------
def _assert_cache_equal(cache, ref):
    assert cache.get_seq_length() == ref.get_seq_length()
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_kv_rollback_equals_fresh_prefill(tiny):
    prompt = random_prompts(tiny.vocab_size, 1, 12, seed=3)[0]
    ref, _ = target_generate(tiny, prompt, 30)
    seq = prompt + ref
    # Decoys at several indices: the right token is the second child there, so accepted paths skip tree slots.
    drafter = oracle_drafter(tiny, seq, second=range(len(prompt) + 2, len(seq), 3))
    st = prefill(tiny, drafter, prompt)
    moved = 0
    for _ in range(5):
        r = spec_step(tiny, drafter, st, topk=2, depth=3, tokens=7)
        moved += r["moved"]
        assert st.ids == seq[:len(st.ids)]
        fresh = new_cache()
        logits, aux = target_forward(tiny, torch.tensor([st.ids[:-1]]), [1, 2, 3], fresh)
        _assert_cache_equal(st.cache, fresh)
        # The drafter cache plus the pending extend equals a drafter extend over the whole sequence from scratch.
        dcache = DrafterCache()
        dcache.k, dcache.v = st.dcache.k.clone(), st.dcache.v.clone()
        drafter_extend(drafter, dcache, *st.pending)
        dref = DrafterCache()
        drafter_extend(drafter, dref, st.ids[1:], aux, 0)
        torch.testing.assert_close(dcache.k, dref.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dcache.v, dref.v, atol=1e-4, rtol=1e-4)
    assert moved > 0  # at least one rollback had to gather a non-contiguous path


def test_deeper_drafter_rollback_keeps_every_layer_cache_exact(tiny):
    """A 2-layer drafter: after rounds with non-contiguous tree paths, each layer's cache plus the pending extend equals
    an extend over the whole sequence from scratch."""
    from hstap.models.drafter import LayerCaches
    prompt = random_prompts(tiny.vocab_size, 1, 12, seed=7)[0]
    ref, _ = target_generate(tiny, prompt, 24)
    seq = prompt + ref
    drafter = oracle_drafter(tiny, seq, second=range(len(prompt) + 2, len(seq), 3), num_layers=2)
    st = prefill(tiny, drafter, prompt)
    assert isinstance(st.dcache, LayerCaches) and len(st.dcache.layers) == 2
    for _ in range(4):
        spec_step(tiny, drafter, st, topk=2, depth=3, tokens=7)
        assert st.ids == seq[:len(st.ids)]
    _, aux = target_forward(tiny, torch.tensor([st.ids[:-1]]), [1, 2, 3], new_cache())
    drafter_extend(drafter, st.dcache, *st.pending)
    fresh = LayerCaches(2)
    drafter_extend(drafter, fresh, st.ids[1:], aux, 0)
    for a, b in zip(st.dcache.layers, fresh.layers):
        torch.testing.assert_close(a.k, b.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.v, b.v, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_layers", [2, 3])
def test_greedy_equals_target_deeper_drafter(tiny, num_layers):
    drafter = random_drafter(tiny, (1, 2, 3), draft_vocab=300, num_layers=num_layers)
    prompt = random_prompts(tiny.vocab_size, 1, 10, seed=8)[0]
    ref, _ = target_generate(tiny, prompt, 16)
    for kw in (dict(mode="chain", k=3), dict(mode="tree", topk=2, depth=3, tokens=6)):
        out, stats = speculative_generate(tiny, drafter, prompt, 16, **kw)
        assert out == ref, kw
    oracle = oracle_drafter(tiny, prompt + ref, num_layers=num_layers)
    out, stats = speculative_generate(tiny, oracle, prompt, 16, mode="chain", k=4)
    assert out == ref and stats["tau"] == pytest.approx(15 / 3)  # 1 + rounds of 5, 5, 5: every draft accepted


# --- greedy losslessness on real models -------------------------------------------------------------------------------
@pytest.mark.parametrize("aux_layers", [(1, 2, 3), ()], ids=["eagle3", "final-only"])
def test_greedy_equals_target_random_drafter(tiny, aux_layers):
    drafter = random_drafter(tiny, aux_layers, draft_vocab=300)
    configs = [dict(mode="chain", k=1), dict(mode="chain", k=3), dict(mode="tree", topk=2, depth=3, tokens=6),
               dict(mode="tree", topk=3, depth=4, tokens=10)]
    for prompt in random_prompts(tiny.vocab_size, 2 if aux_layers else 1, 10, seed=4):
        ref, _ = target_generate(tiny, prompt, 16)
        for kw in configs if aux_layers else configs[1::2]:
            out, stats = speculative_generate(tiny, drafter, prompt, 16, **kw)
            assert out == ref, kw
            assert stats["new_tokens"] == 16 and 1.0 <= stats["tau"] <= stats["depth"] + 1


def test_oracle_drafter_chain_accepts_everything(tiny):
    prompt = random_prompts(tiny.vocab_size, 1, 8, seed=5)[0]
    ref, _ = target_generate(tiny, prompt, 40)
    out, stats = speculative_generate(tiny, oracle_drafter(tiny, prompt + ref), prompt, 32, mode="chain", k=4)
    assert out == ref[:32]
    # 1 token from the prefill, then rounds of 5 (4 drafts + bonus): 6 full rounds and a truncated seventh.
    assert stats["verify_forwards"] == 7 and stats["tau"] == pytest.approx(31 / 7)
    assert stats["per_position_acceptance"] == [1.0] * 4 and stats["accept_counts"] == [7] * 4


def test_oracle_drafter_tree_second_children(tiny):
    prompt = random_prompts(tiny.vocab_size, 1, 8, seed=6)[0]
    ref, _ = target_generate(tiny, prompt, 40)
    drafter = oracle_drafter(tiny, prompt + ref, second=range(len(prompt) + 1, len(prompt) + 40, 2))
    out, stats = speculative_generate(tiny, drafter, prompt, 32, mode="tree", topk=2, depth=4, tokens=12)
    assert out == ref[:32]
    assert stats["kv_moves"] > 0 and stats["tau"] > 2.5
    chain, cstats = speculative_generate(tiny, drafter, prompt, 32, mode="chain", k=4)
    assert chain == ref[:32] and cstats["tau"] < stats["tau"]  # a chain cannot follow second choices


def test_deepseek_mla_target(tiny_deepseek):
    # The DeepSeek-V3 layout (MLA attention, MoE): the 4-D tree mask and the KV gather work on its cache too.
    target = load_tiny_target(tiny_deepseek)[0]
    prompt = random_prompts(target.vocab_size, 1, 10, seed=8)[0]
    ref, _ = target_generate(target, prompt, 20)
    drafter = oracle_drafter(target, prompt + ref, second=range(len(prompt) + 2, len(prompt) + 30, 2))
    out, stats = speculative_generate(target, drafter, prompt, 20, mode="tree", topk=2, depth=4, tokens=10)
    assert out == ref and stats["kv_moves"] > 0
    assert speculative_generate(target, random_drafter(target, (1, 2, 3), 300), prompt, 20, k=3)[0] == ref


def test_eos_stops_generation(tiny):
    prompt = random_prompts(tiny.vocab_size, 1, 8, seed=7)[0]
    ref, _ = target_generate(tiny, prompt, 24)
    eos = ref[9]
    stop = ref.index(eos) + 1
    for fn in (lambda: target_generate(tiny, prompt, 24, eos_ids=[eos]),
               lambda: speculative_generate(tiny, oracle_drafter(tiny, prompt + ref), prompt, 24, k=4, eos_ids=[eos]),
               lambda: ngram_generate(tiny, prompt, 24, eos_ids=[eos])):
        out, _ = fn()
        assert out == ref[:stop]


def test_reference_target_greedy(ref_target):
    from hstap.layers import default_aux_layers

    target, tok = load_tiny_target(ref_target)
    layers = default_aux_layers(target.num_layers)
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
               for text in ("How do I open a file in Python?", "Explain the Linux page cache.")]
    # A random drafter (rejections everywhere) in a chain, and an oracle head that is right one level in two only as
    # a second choice, in a tree (acceptances through second children: KV entries move).
    ref, _ = target_generate(target, prompts[0], 32)
    drafter = random_drafter(target, layers, draft_vocab=2048)
    assert speculative_generate(target, drafter, prompts[0], 32, mode="chain", k=3)[0] == ref
    ref, _ = target_generate(target, prompts[1], 32)
    P = len(prompts[1])
    drafter = oracle_drafter(target, prompts[1] + ref, second=range(P + 1, P + 40, 2), aux_layers=layers)
    out, stats = speculative_generate(target, drafter, prompts[1], 32, mode="tree", topk=4, depth=4, tokens=12)
    assert out == ref and stats["kv_moves"] > 0 and stats["tau"] > 2


# --- pinned accept patterns with stub models (litgpt-style) -----------------------------------------------------------
V = 8


def _onehot(i: int, hi: float = 10.0) -> torch.Tensor:
    x = torch.zeros(V)
    x[i % V] = hi
    return x


def _plus_one(ctx):  # the stub target's greedy continuation: last + 1 (mod V)
    return _onehot(ctx[-1] + 1)


def _run_stub(drafter_fn, **kw):
    target, drafter = StubTarget(_plus_one, V), StubDrafter(drafter_fn, V)
    return speculative_generate(target, drafter, [3, 4, 5, 6, 7], kw.pop("max_new", 11), **kw)


EXPECTED = [i % V for i in range(11)]  # the prompt ends in 7, so the output is 0, 1, 2, ...


def test_stub_accept_all():
    out, s = _run_stub(lambda ctx: _onehot(ctx[-1] + 1), mode="chain", k=3, max_new=9)
    # prefill gives 1 token; each round 3 drafts + bonus = 4 tokens: 2 rounds.
    assert out == EXPECTED[:9] and s["verify_forwards"] == 2 and s["accept_counts"] == [2, 2, 2]


def test_stub_accept_none():
    out, s = _run_stub(lambda ctx: _onehot(ctx[-1] + 2), mode="chain", k=3, max_new=6)
    assert out == EXPECTED[:6] and s["verify_forwards"] == 5 and s["accept_counts"] == [0, 0, 0] and s["tau"] == 1.0


def test_stub_accept_some():
    # The drafter is wrong exactly when the token it predicts sits at a sequence index divisible by 3. Prompt length 5,
    # prefill fills index 5. Round 1 drafts indices 6..8: 6 is wrong -> 0 accepted + bonus. Every later round has its
    # root at 3m and drafts 3m+1, 3m+2 (right), 3m+3 (wrong) -> 2 accepted + bonus.
    def fn(ctx):  # ctx = x[1..t+1] at drafter position t; it predicts x[t+2], whose index is len(ctx) + 1
        return _onehot(ctx[-1] + (2 if (len(ctx) + 1) % 3 == 0 else 1))

    out, s = _run_stub(fn, mode="chain", k=3, max_new=11)
    assert out == EXPECTED[:11]
    assert s["verify_forwards"] == 4 and s["accept_counts"] == [3, 3, 0] and s["tau"] == pytest.approx(10 / 4)


def test_stub_tree_second_choice():
    # Drafter: first choice 5.0, second 4.0. At indices divisible by 3 the right token is its second choice.
    # topk=2, depth=3, tokens=7 keeps A, B, AA, AB, BA, AAA (best cumulative scores; AB before BA on the tie).
    def fn(ctx):
        nxt = ctx[-1] + 1
        wrong = (len(ctx) + 1) % 3 == 0
        x = torch.zeros(V)
        x[(nxt + (1 if wrong else 0)) % V] = 5.0
        x[(nxt + (0 if wrong else 1)) % V] = 4.0
        return x

    out, s = _run_stub(fn, mode="tree", topk=2, depth=3, tokens=7, max_new=8)
    # Round 1 (root at index 5, index 6 wrong): B is right, then BA (index 7), which has no verified children -> 2 +
    # bonus. Rounds 2 and 3 (roots at 8 and 11) repeat the pattern; the output is full (1 + 3 + 3 + 1) during round 3.
    # Every accepted path is [root, B, BA] = tree slots [0, 2, 5]: the KV rollback moves entries each round.
    assert out == EXPECTED[:8]
    assert s["verify_forwards"] == 3 and s["accept_counts"] == [3, 3, 0] and s["kv_moves"] == 3


# --- temperature > 0: the output distribution is the target's --------------------------------------------------------
VS = 4  # tiny vocabulary: the first 3 generated tokens have 64 outcomes


def _table(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VS, 3, VS, generator=g) * scale  # logits by (last token, context length mod 3)


P_TAB, Q_TAB = _table(10, 1.5), _table(11, 1.5)


def _p(ctx):
    return P_TAB[ctx[-1], len(ctx) % 3]


def _q(ctx):
    return Q_TAB[ctx[-1], len(ctx) % 3]


def _exact(prompt: list[int], n: int, temperature: float) -> dict:
    probs = {}
    for seq in itertools.product(range(VS), repeat=n):
        pr, ctx = 1.0, list(prompt)
        for t in seq:
            pr *= float(torch.softmax(_p(ctx) / temperature, -1)[t])
            ctx.append(t)
        probs[seq] = pr
    return probs


@pytest.mark.parametrize("kw,N", [(dict(mode="chain", k=2), 1000), (dict(mode="tree", topk=3, depth=2, tokens=5), 1000),
                                  ("ngram", 600)], ids=["chain", "tree", "ngram"])
def test_sampling_distribution_equals_target(kw, N):
    # Tree: the root's 3 children are drawn without replacement and all verified; of their 9 children only the best
    # one is verified, the others are tried unverified (rule (a) of the module docstring).
    prompt, n, temp = [1, 2, 1, 2, 1], 3, 0.8
    target, drafter = StubTarget(_p, VS), StubDrafter(_q, VS)
    gen = torch.Generator().manual_seed(1234)
    counts: dict = {}
    for _ in range(N):
        if kw == "ngram":
            out, _ = ngram_generate(target, prompt, n, k=2, temperature=temp, generator=gen)
        else:
            out, _ = speculative_generate(target, drafter, prompt, n, temperature=temp, generator=gen, **kw)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    probs = _exact(prompt, n, temp)
    assert chi2_pvalue(counts, probs, N) > 1e-3
    # Power check: the drafter's own distribution is far from the target's, so accepting drafts blindly would fail.
    q_probs = {c: math.prod(float(torch.softmax(_q(list(prompt[1:]) + list(c[:i])) / temp, -1)[c[i]])
                            for i in range(n)) for c in probs}
    assert chi2_pvalue({c: round(p * N) for c, p in q_probs.items()}, probs, N) < 1e-6


# --- small pieces and errors ------------------------------------------------------------------------------------------
def test_ngram_propose():
    assert NgramIndex(3, [5, 6, 7, 8, 9, 5, 6, 7]).propose(3) == [8, 9, 5]  # 3-gram match, runs into the suffix
    assert NgramIndex(3, [1, 2, 9, 1, 2, 3, 4, 2]).propose(2) == [3, 4]  # latest 1-gram match of "2" is at index 4
    assert NgramIndex(3, [1, 2, 3]).propose(4) == []


def test_ngram_index_grown_token_by_token_equals_a_full_scan():
    """NgramIndex extended round by round (as the decoders do) proposes what a scan of the whole list finds, at every
    length, for every n-gram order and draft length."""
    def scan(ids, k, max_ngram):  # the definition: the latest earlier window equal to the last n tokens
        for n in range(min(max_ngram, len(ids) - 1), 0, -1):
            hits = [j for j in range(len(ids) - n) if ids[j:j + n] == ids[-n:]]
            if hits:
                return ids[hits[-1] + n:hits[-1] + n + k]
        return []

    g = torch.Generator().manual_seed(0)
    for max_ngram in (1, 2, 3):
        ids = torch.randint(0, 4, (120,), generator=g).tolist()  # 4 symbols: many repeats, many orders matched
        index, at = NgramIndex(max_ngram, ids[:1]), 1
        while at < len(ids):
            step = int(torch.randint(1, 4, (1,), generator=g))  # rounds append 1-3 tokens
            index.extend(ids[at:at + step])
            at = min(at + step, len(ids))
            for k in (1, 3, 5):
                assert index.propose(k) == scan(ids[:at], k, max_ngram)
    with pytest.raises(HstapError, match="max_ngram must be >= 1"):
        NgramIndex(0)


def test_bad_arguments(tiny):
    drafter = random_drafter(tiny, (1, 2, 3), draft_vocab=300)
    with pytest.raises(HstapError, match="mode"):
        speculative_generate(tiny, drafter, [7, 8], 4, mode="beam")
    with pytest.raises(HstapError, match="empty prompt"):
        speculative_generate(tiny, drafter, [], 4)
    wrong = random_drafter(tiny, (1, 2), draft_vocab=300)
    wrong.config.aux_layers = [1, 2, 3]  # fc built for 2 layers
    with pytest.raises(HstapError, match="fc takes"):
        speculative_generate(tiny, wrong, [7, 8], 4)
    tiny.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(HstapError, match="4-D mask"):
            speculative_generate(tiny, drafter, [7, 8], 4, mode="tree")
    finally:
        tiny.config._attn_implementation = "sdpa"


def test_replayed_training_eval_predicts_chain_decoding(tiny):
    """The simulation `hstap train` logs (sim_chain_tau: TTT eval runs replayed by `replay_chain`) is chain decoding
    itself when the eval answers are the target's own greedy outputs: train a real drafter a little on such answers,
    then compare the replay with `speculative_generate` on the same prompts, round count for round count."""
    from hstap.train.ttt import TTTModel, replay_chain, target_distribution

    K, k, n_new = 4, 3, 40
    prompts = random_prompts(tiny.vocab_size, 8, 12, seed=11)
    outs = [target_generate(tiny, p, n_new)[0] for p in prompts]
    seqs = [p + o for p, o in zip(prompts, outs)]
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)  # (B, T)
    lm = torch.zeros(len(seqs), T, dtype=torch.long)  # (B, T): the answers
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        lm[b, len(p):len(s)] = 1
    lengths = torch.tensor([len(s) for s in seqs])
    aux, final, _ = tiny.capture(ids, [1, 2, 3])  # (B, T, K, H), (B, T, H)
    drafter = random_drafter(tiny, (1, 2, 3), seed=3).train()
    hot = torch.arange(tiny.vocab_size) + drafter.d2t  # (Vd,) the whole vocabulary
    tb = target_distribution(final, lm, lengths, tiny.lm_head.weight.detach(), hot, drafter.t2d)
    model = TTTModel(drafter, ttt=K)
    opt = torch.optim.AdamW([q for q in drafter.parameters() if q.requires_grad], lr=3e-3)
    denom = torch.tensor([float(tb["s"].numel())] * K)
    torch.manual_seed(0)
    for _ in range(60):  # fits these answers well enough for long accepted runs, not perfectly
        loss, _ = model(ids, aux, tb, denom)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    drafter.eval()
    with torch.no_grad():
        _, _, runs = model(ids, aux, tb, evaluate=True)
    tokens, rounds = replay_chain(runs, lm, lengths, K)

    forwards = produced = 0
    for p, o in zip(prompts, outs):
        out, st = speculative_generate(tiny, drafter, p, n_new, mode="chain", k=k)
        assert out == o
        forwards, produced = forwards + st["verify_forwards"], produced + st["verify_tokens"]
    assert produced == tokens[k - 1] == sum(len(o) - 1 for o in outs)
    assert produced / forwards > 1.5  # the drafter accepts long runs: the comparison says something
    # equal here (146 rounds both ways); the slack only absorbs a rare argmax flip between the two float paths
    assert abs(forwards - rounds[k - 1]) <= max(1, forwards // 50), (forwards, rounds[k - 1])
