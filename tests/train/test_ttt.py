"""The training-time test against a naive reference written here with explicit loops and matmuls.

The reference re-derives every rule from the spec, position by position: step k at position t feeds x[t+1+k] with the
hidden fc(aux[t]) (k = 0) or the step k-1 output at t, sits at rotary position t+k, attends to step-0 keys s <= t and to
the keys of steps 1..k at t, and is scored against softmax(target logits at t+1+k restricted to the hot ids) where
loss_mask[t+2+k] == 1, t+2+k < length and the target's full-vocabulary argmax is a hot id.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.drafter import tiny_setup

from hstap.train.ttt import (TOPK_K, TTTModel, ce_core, loss_core, plan_rows, replay_chain, soft_ce, soft_ce_rows,
                             step_rows, target_distribution, ttt_block_mask, ttt_flops, ttt_mask)


def _rms(x, w, eps=1e-5):
    return w * (x / torch.sqrt((x * x).mean() + eps))


def _rope(x, pos, theta):
    hd = x.shape[0]
    ang = pos * (1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))  # (hd/2,)
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    return x * cos + torch.cat([-x[hd // 2:], x[:hd // 2]]) * sin


def naive_ttt(d, W, hot, t2d, ids, lm, L, aux, final, K, decay=0.8):
    """Loop reference -> (loss, per-step [sum CE, correct, counted], per-step per-(b,t) (countable, right))."""
    c, m = d.config, d.midlayer
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    B, T = ids.shape
    sums, table = [[0.0, 0, 0] for _ in range(K)], {}
    loss_terms = [[] for _ in range(K)]
    for b in range(B):
        keys = {}  # (step, t) -> (k (nkv, hd), v (nkv, hd))
        h_prev = {}
        for k in range(K):
            for t in range(T):  # keys of this step first: queries at t see keys at t of the same step
                tok = int(ids[b, t + 1 + k]) if t + 1 + k < T else 0
                h_in = d.fc.weight @ aux[b, t].reshape(-1) if k == 0 else h_prev[(k - 1, t)]
                x = torch.cat([_rms(d.embed_tokens.weight[tok], m.input_layernorm.weight),
                               _rms(h_in, m.hidden_norm.weight)])
                kk = (m.self_attn.k_proj.weight @ x).view(nkv, hd)
                keys[(k, t)] = (torch.stack([_rope(kk[j], t + k, c.rope_theta) for j in range(nkv)]),
                                (m.self_attn.v_proj.weight @ x).view(nkv, hd), x, h_in)
            for t in range(T):
                _, _, x, h_in = keys[(k, t)]
                q = (m.self_attn.q_proj.weight @ x).view(nh, hd)
                visible = [keys[(0, s)] for s in range(t + 1)] + [keys[(j, t)] for j in range(1, k + 1)]
                heads = []
                for hh in range(nh):
                    g = hh // (nh // nkv)
                    qh = _rope(q[hh], t + k, c.rope_theta)
                    sc = torch.stack([qh @ kv[0][g] for kv in visible]) / math.sqrt(hd)
                    heads.append((torch.softmax(sc, 0)[:, None] * torch.stack([kv[1][g] for kv in visible])).sum(0))
                r = m.self_attn.o_proj.weight @ torch.cat(heads) + h_in
                u = _rms(r, m.post_attention_layernorm.weight)
                h_out = m.mlp.down_proj.weight @ (F.silu(m.mlp.gate_proj.weight @ u) * (m.mlp.up_proj.weight @ u)) + r
                h_prev[(k, t)] = h_out
                s = t + 1 + k  # the target position this step reads
                if s + 1 >= int(L[b]) or int(lm[b, s + 1]) != 1:
                    continue  # not countable (loss mask / length)
                logits = d.lm_head.weight @ _rms(h_out, d.norm.weight)  # (Vd,)
                zt = W @ final[b, s]  # (V,)
                inv = bool(t2d[zt.argmax()])
                p = torch.softmax(zt[hot], 0)
                right = inv and int(logits.argmax()) == int(p.argmax())
                table[(k, b, t)] = right
                if inv:
                    ce = -(p * torch.log_softmax(logits, 0)).sum()
                    loss_terms[k].append(ce)
                    sums[k][0] += ce.item()
                    sums[k][1] += int(int(logits.argmax()) == int(p.argmax()))
                    sums[k][2] += 1
    loss = sum(decay ** k * torch.stack(loss_terms[k]).sum() / max(1, sums[k][2]) for k in range(K) if loss_terms[k])
    return loss, sums, table


def _model_inputs(d, W, hot, t2d, lm, L, final):
    tb = target_distribution(final, lm, L, W, hot, t2d, chunk=5)
    return tb


@pytest.mark.parametrize("K", [1, 3])
def test_ttt_equals_naive_reference(K):
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup()
    ref_loss, ref_sums, table = naive_ttt(d, W, hot, t2d, ids, lm, L, aux, final, K)
    ref_grads = torch.autograd.grad(ref_loss, [p for p in d.parameters() if p.requires_grad])
    assert all(s[2] > 0 for s in ref_sums), "the fixture must count positions at every step"

    tb = _model_inputs(d, W, hot, t2d, lm, L, final)
    T = ids.shape[1]
    denom = torch.tensor([float(step_rows(tb, T, k)[0].numel()) for k in range(K)])
    assert denom.tolist() == [s[2] for s in ref_sums]
    model = TTTModel(d, ttt=K, attn="sdpa", ce_chunk=3)  # chunk < rows: the fused CE crosses chunk borders
    loss, stats = model(ids, aux, tb, denom)
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[:, 0].float(), torch.tensor([s[0] for s in ref_sums]), rtol=1e-5, atol=1e-4)
    assert stats[:, 1:].tolist() == [[float(s[1]), float(s[2])] for s in ref_sums]
    loss.backward()
    for (n, p), g in zip([(n, p) for n, p in d.named_parameters() if p.requires_grad], ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    assert d.embed_tokens.weight.grad is None  # frozen

    # Evaluation: the simulated chain over positions countable at every step, out-of-vocab targets counting as misses.
    with torch.no_grad():
        est, sim, runs = model(ids, aux, tb, evaluate=True)
    B = ids.shape[0]
    full = [(b, t) for b in range(B) for t in range(T) if all((k, b, t) in table for k in range(K))]
    want = [len(full)] + [sum(all(table[(i, b, t)] for i in range(k + 1)) for b, t in full) for k in range(K)]
    assert sim.tolist() == [float(x) for x in want]
    assert est[:, 1:].tolist() == stats[:, 1:].tolist()
    for b in range(B):  # runs: leading correct steps, a step that cannot be counted ending the run
        for t in range(T):
            n = 0
            while n < K and table.get((n, b, t), False):
                n += 1
            assert runs[b, t] == n, (b, t)


def test_replay_chain_by_hand():
    """One answer x[3..12): rounds start at t = 2, advance by accepted + 1; the last round is cut at the answer end."""
    runs = torch.tensor([[0, 0, 2, 0, 0, 1, 0, 0, 3, 0, 0, 0, 0, 0]])  # (1, T)
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])  # answer span [3, 12)
    tokens, rounds = replay_chain(runs, lm, torch.tensor([14]), 2)
    # k=1: t=2 a=1 (x4,x5) -> t=4 a=0 (x6) -> t=5 a=1 (x7,x8) -> t=7 a=0 (x9) -> t=8 a=1 (x10,x11) -> t=10 stop
    # k=2: t=2 a=2 (x4..x6) -> t=5 a=1 (x7,x8) -> t=7 a=0 (x9) -> t=8 a=2 (x10,x11 + x12 cut: 2) -> stop
    assert tokens.tolist() == [8, 8] and rounds.tolist() == [5, 4]
    two = replay_chain(torch.cat([runs, runs]), torch.cat([lm, lm]), torch.tensor([14, 6]), 1)
    assert two[0].tolist() == [8 + 2] and two[1].tolist() == [5 + 1]  # second row cut at length 6: x4,x5 in 1 round


def test_flex_attention_matches_sdpa_on_cpu():
    """The BlockMask path (flex_attention, eager on CPU, forward only there) gives the SDPA bool-mask numbers."""
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=1)
    tb = _model_inputs(d, W, hot, t2d, lm, L, final)
    K, T = 2, ids.shape[1]
    denom = torch.tensor([float(step_rows(tb, T, k)[0].numel()) for k in range(K)])
    with torch.no_grad():
        outs = {a: (TTTModel(d, ttt=K, attn=a)(ids, aux, tb, denom),
                    TTTModel(d, ttt=K, attn=a)(ids, aux, tb, evaluate=True)) for a in ("sdpa", "flex")}
    (l1, s1), (e1, m1, r1) = outs["sdpa"]
    (l2, s2), (e2, m2, r2) = outs["flex"]
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s1, rtol=1e-5, atol=1e-5)
    assert torch.equal(m2, m1) and torch.equal(r2, r1)
    # and the two masks encode the same pattern, element by element
    bm = ttt_block_mask(T, K - 1, device="cpu")
    dense = torch.stack([torch.tensor([bool(bm.mask_mod(0, 0, torch.tensor(q), torch.tensor(kv)))
                                       for kv in range(K * T)]) for q in range(T)])
    assert torch.equal(dense, ttt_mask(T, K - 1))


def test_ttt_mask_pattern():
    m = ttt_mask(4, 2)  # (4, 12): [causal | diagonal | diagonal]
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    eye = torch.eye(4, dtype=torch.bool)
    assert torch.equal(m[:, 4:8], eye) and torch.equal(m[:, 8:], eye)


def test_masking_rules_out_of_vocab_argmax_is_not_counted():
    """Candidates need loss_mask[s+1] and s+1 < length; counted ones also need the target argmax in the draft vocab."""
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=2)
    B, T = ids.shape
    cold = torch.nonzero(~t2d).squeeze(1)
    final = final.clone()
    forced = {(0, 2): int(cold[0]), (0, 6): int(hot[3]), (1, 3): int(cold[5])}  # (b, s) -> the argmax we force
    for (b, s), j in forced.items():
        final[b, s] = 50 * W[j] / W[j].norm()
        lm[b, s + 1] = 1
    tb = target_distribution(final, lm, L, W, hot, t2d, chunk=4)
    want = [(b, s) for b in range(B) for s in range(T) if s + 1 < int(L[b]) and int(lm[b, s + 1]) == 1]
    assert [(int(x) // T, int(x) % T) for x in tb["s"]] == want
    inv = {(int(x) // T, int(x) % T): bool(v) for x, v in zip(tb["s"], tb["inv"])}
    assert inv[(0, 2)] is False and inv[(1, 3)] is False and inv[(0, 6)] is True
    assert inv == {(b, s): bool(t2d[(W @ final[b, s]).argmax()]) for b, s in want}
    for k in range(3):
        rows_t, _ = step_rows(tb, T, k)
        got = {(int(x) // T, int(x) % T) for x in rows_t}
        assert got == {(b, s - 1 - k) for (b, s) in want if inv[(b, s)] and s - 1 - k >= 0}
        if k == 0:
            assert (0, 1) not in got and (1, 2) not in got and (0, 5) in got  # s = t+1: 2 and 3 are out, 6 is in


def test_fused_soft_ce_equals_autograd():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, 8, generator=g, requires_grad=True)
    w = torch.randn(7, 8, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(13, 7, generator=g), -1)
    _same_as_autograd(lambda: soft_ce(x, w, p, chunk=4), x, w,
                      lambda logits: -(p * torch.log_softmax(logits, -1)).sum(), scale=3.0)


def _same_as_autograd(fused, x, w, ref_of_logits, scale: float) -> None:
    """fused() -> (total, argmax) of a chunked objective over x (N, H) and lm_head w (V, H): its value, argmax and the
    gradients of scale * total in x and w equal autograd of ref_of_logits(x @ w.T) on fresh copies."""
    total, pred = fused()
    (scale * total).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = ref_of_logits(x2 @ w2.t())
    (scale * ref).backward()
    torch.testing.assert_close(total, ref)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert torch.equal(pred, (x2 @ w2.t()).argmax(-1))




def test_soft_ce_rows_is_the_training_cross_entropy():
    """Evaluation's per-row soft CE and training's summed one are one computation: the same bits on CPU fp32."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(11, 8, generator=g), torch.randn(7, 8, generator=g)
    p = torch.softmax(torch.randn(11, 7, generator=g), -1)
    total, pred = soft_ce(x.clone().requires_grad_(), w.clone().requires_grad_(), p, chunk=4)
    rows, pred_rows = soft_ce_rows(x, w, p, chunk=4)
    assert torch.equal(pred_rows, pred)
    assert torch.equal(total.detach(), rows[:4].sum() + rows[4:8].sum() + rows[8:].sum())  # chunk sums, in order
    ref = -(p * torch.log_softmax(x @ w.t(), -1)).sum(-1)
    torch.testing.assert_close(rows, ref)


def test_ttt_flops_by_hand():
    """fc + midlayer weights + counted lm_head rows + target head rows + attention keys (exact or causal-only)."""
    d = tiny_setup()[0]
    c = d.config
    L = torch.tensor([3, 2])
    N, Hd, nh, hd = 5, c.hidden_size, c.num_attention_heads, c.head_dim
    p_mid = 2 * Hd * (nh + 2 * c.num_key_value_heads) * hd + nh * hd * Hd + 3 * Hd * c.intermediate_size
    base = 4 * N * c.num_aux * c.target_hidden_size * Hd + 6 * 2 * N * p_mid + 6 * 7.0 * Hd * c.draft_vocab_size \
        + 2 * 4.0 * Hd * c.vocab_size
    keys = (1 + 2 + 3) + (1 + 2)  # sum over tokens of t+1
    assert ttt_flops(c, L, [4.0, 3.0], 4.0, 2) == base + 12 * nh * hd * (keys + keys + N)
    assert ttt_flops(c, L, [4.0, 3.0], 4.0, 2, exact_attn=False) == base + 12 * nh * hd * (2 * keys)


# --- the TTT attention kernel: chosen up front, and the exact SDPA path when compiling flex_attention fails ---------


def test_attention_kernel_is_chosen_from_the_device_and_head_dim_only():
    from hstap.train.ttt import ttt_attention

    assert ttt_attention("auto", "cuda", 16)[0] == "flex" and ttt_attention("flex", "cuda", 128)[0] == "flex"
    assert ttt_attention("auto", "cpu", 64) == ("sdpa", "CPU: SDPA with the exact TTT mask")
    kernel, why = ttt_attention("flex", "cuda", 8)  # narrower than flex's Triton tiles: SDPA, said so
    assert kernel == "sdpa" and why.startswith("head_dim 8 < 16")
    assert ttt_attention("causal", "cuda", 64) == ("causal", "--attn causal")
    assert ttt_attention("sdpa", "cuda", 64) == ("sdpa", "--attn sdpa")
    assert ttt_attention("flex", "cpu", 8)[0] == "flex"  # asked for on CPU: the eager kernel, as before


def test_compile_failure_finds_the_inductor_error_and_leaves_out_of_memory_alone():
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.select_algorithm import NoValidChoicesError

    from hstap.models.compiled import compile_failure

    def chained(inner, outer=RuntimeError("compiled call failed")):
        try:
            try:
                raise inner
            except BaseException as e:
                raise outer from e
        except BaseException as e:
            return e

    novalid = NoValidChoicesError("No choices to select, please consider adding ATEN into max_autotune_gemm_backends\n"
                                  "  target: flex_attention")
    wrapped = chained(novalid, BackendCompilerFailed(lambda *a: None, novalid, None))
    assert compile_failure(wrapped) == "NoValidChoicesError: No choices to select, please consider adding ATEN into " \
                                       "max_autotune_gemm_backends"
    assert compile_failure(chained(torch.OutOfMemoryError("CUDA out of memory"), wrapped)) is None
    assert compile_failure(chained(ValueError("a bug of ours"))) is None


def test_a_flex_compile_failure_recomputes_the_batch_with_sdpa_exactly(monkeypatch):
    """A compile failure (as a new shape's graph would raise) -> the whole batch is recomputed with SDPA: results equal
    an SDPA run's bitwise, and flex is not tried again. Training: at the first call (eager flex on CPU has no
    backward); evaluation: at the second TTT step, mid-forward."""
    from torch._inductor.select_algorithm import NoValidChoicesError

    import hstap.models.drafter as dr
    from hstap.models.compiled import guard_flex_compile

    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=5, B=3, T=9, lengths=(9, 6, 4))
    tb = target_distribution(final, lm, L, W, hot, t2d)
    K = 3
    denom = torch.tensor([float(step_rows(tb, 9, k)[0].numel()) for k in range(K)])
    calls, fail_at = [], [1]
    eager = dr._flex(False)

    def failing(q, k, v, **kw):  # the compiled region as it fails for one new shape
        calls.append(tuple(k.shape))
        if len(calls) in fail_at:
            raise NoValidChoicesError("No choices to select, please consider adding ATEN")
        return eager(q, k, v, **kw)

    monkeypatch.setattr(dr, "_flex", lambda cuda: guard_flex_compile(failing))
    res = {}
    for attn in ("sdpa", "flex"):
        d.zero_grad(set_to_none=True)
        model = TTTModel(d, ttt=K, attn=attn)
        loss, stats = model(ids, aux, tb, denom)
        loss.backward()
        res[attn] = (loss.detach(), stats, [p.grad.clone() for p in d.parameters() if p.requires_grad], model)
    flex = res["flex"][3]
    assert flex.attn == "sdpa" and "NoValidChoicesError: No choices to select" in flex.attn_fallback
    assert "query (3, 2, 9, 8)" in flex.attn_fallback and "key (3, 1, 9, 8)" in flex.attn_fallback
    assert torch.equal(res["flex"][0], res["sdpa"][0]) and torch.equal(res["flex"][1], res["sdpa"][1])
    assert all(torch.equal(a, b) for a, b in zip(res["flex"][2], res["sdpa"][2]))
    flex(ids, aux, tb, denom)
    assert len(calls) == 1  # later batches go straight to SDPA

    calls.clear()
    fail_at[0] = 2
    with torch.no_grad():
        ev = [TTTModel(d, ttt=K, attn=a)(ids, aux, tb, evaluate=True) for a in ("sdpa", "flex")]
    assert len(calls) == 2 and calls[1] == (3, 1, 18, 8)  # step 0 ran on flex, step 1 failed
    assert all(torch.equal(a, b) for a, b in zip(*ev))

    def broken(q, k, v, **kw):
        raise ValueError("not a compile failure")

    x = torch.zeros(1, 1, 1, 8)
    with pytest.raises(ValueError, match="not a compile failure"):  # passed through unchanged, no SDPA rerun
        guard_flex_compile(broken)(x, x, x)


# --- objectives -------------------------------------------------------------------------------------------------------
def _ref_rows(loss, z, p, mix, decay):
    """Straightforward per-row objectives (autograd reference): z (n, Vd) logits, p (n, Vd) target probabilities."""
    logq = torch.log_softmax(z, -1)
    q = logq.exp()
    terms = {"ce": -(p * logq).sum(-1), "tv": 0.5 * (q - p).abs().sum(-1),
             "rkl": (q * (logq - p.clamp_min(1e-30).log())).sum(-1),
             "hard": -logq.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)}
    top = p.topk(min(TOPK_K, p.shape[-1]), -1).indices  # (n, K)
    terms["topk"] = -(p.gather(-1, top) * logq.gather(-1, top)).sum(-1)
    if loss == "lk":
        w = torch.exp(-decay * (1 - terms["tv"].detach()))  # the cross-entropy's weight, held constant
        return w * terms["ce"] + (1 - w) * terms["tv"]
    a, _, b = loss.partition("+")
    return terms[a] if not b else (1 - mix) * terms[a] + mix * terms[b]


@pytest.mark.parametrize("loss", ["ce", "tv", "rkl", "hard", "ce+tv", "tv+rkl", "ce+hard", "lk", "topk", "ce+topk"])
def test_objectives_equal_autograd_of_a_reference(loss):
    """The closed-form chunked objectives (value, argmax, gradients in x and in the lm_head) against autograd of a
    plain implementation, across chunk borders; topk over a vocabulary wider than its K."""
    g = torch.Generator().manual_seed(7)
    V = TOPK_K + 6 if "topk" in loss else 7
    x = torch.randn(13, 8, generator=g, requires_grad=True)
    w = torch.randn(V, 8, generator=g, requires_grad=True)
    p = torch.softmax(2 * torch.randn(13, V, generator=g), -1)
    _same_as_autograd(lambda: soft_ce(x, w, p, chunk=4, core=loss_core(loss, mix=0.3, lk_decay=2.0)), x, w,
                      lambda logits: _ref_rows(loss, logits, p, 0.3, 2.0).sum(), scale=2.0)


def test_objective_names():
    assert loss_core("ce") is ce_core  # the default is today's function itself: same bits
    for bad in ("foo", "ce+ce", "ce+tv+rkl", "lk+ce", ""):
        with pytest.raises(ValueError, match="loss"):
            loss_core(bad)


def test_plan_rows_equals_step_rows():
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=2)
    tb = target_distribution(final, lm, L, W, hot, t2d, chunk=4)
    T = ids.shape[1]
    counted = plan_rows(tb, T, 4)
    for k in range(4):
        rows_t, rows_c = step_rows(tb, T, k)
        assert torch.equal(tb["rows"][k][0], rows_t) and torch.equal(tb["rows"][k][1], rows_c)
        assert counted[k] == float(rows_c.numel()) == float(tb["counted"][k])


# --- deeper drafters: TTT equals step-by-step decoding ---------------------------------------------------------------
def decoded_ttt(d, W, hot, t2d, ids, lm, L, aux, K, final, decay, loss):
    """TTT re-derived by decoding, position by position, as `hstap.speculative.drivers` runs the drafter: a fresh cache per
    position t, an extend over x[1..t+1] with fc(aux[0..t]) (step 0 at t), then draft steps k = 1..K-1 feeding x[t+1+k]
    and the previous output at rotary position t+k, each attending to the whole cache. -> (loss, table (k, b, t) ->
    right)."""
    from hstap.models.drafter import new_drafter_cache
    B, T = ids.shape
    hidden = d.project(aux)  # (B, T, H)
    terms, counts, table = [[] for _ in range(K)], [0] * K, {}
    for b in range(B):
        for t in range(T):
            cache = new_drafter_cache(d)
            tok = [int(ids[b, j + 1]) if j + 1 < T else 0 for j in range(t + 1)]
            h = d(torch.tensor([tok]), hidden[b:b + 1, :t + 1], torch.arange(t + 1)[None], cache)[:, -1:]  # (1, 1, H)
            for k in range(K):
                if k:
                    x = int(ids[b, t + 1 + k]) if t + 1 + k < T else 0
                    h = d(torch.tensor([[x]]), h, torch.tensor([[t + k]]), cache)  # (1, 1, H)
                s = t + 1 + k
                if s + 1 >= int(L[b]) or int(lm[b, s + 1]) != 1:
                    continue
                zt = W @ final[b, s]
                inv = bool(t2d[zt.argmax()])
                p = torch.softmax(zt[hot], 0)
                logits = d.compute_logits(h)[0, 0]  # (Vd,)
                table[(k, b, t)] = inv and int(logits.argmax()) == int(p.argmax())
                if inv:
                    terms[k].append(_ref_rows(loss, logits[None], p[None], 0.5, 3.0)[0])
                    counts[k] += 1
    total = sum(decay ** k * torch.stack(terms[k]).sum() / counts[k] for k in range(K) if counts[k])
    return total, table


@pytest.mark.parametrize("num_layers,loss", [(2, "ce"), (3, "lk")])
def test_deeper_ttt_equals_step_by_step_decoding(num_layers, loss):
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=4, num_layers=num_layers)
    K, T = 3, ids.shape[1]
    assert len(d.decoder_layers()) == num_layers
    ref, table = decoded_ttt(d, W, hot, t2d, ids, lm, L, aux, K, final, 0.8, loss)
    params = [p for p in d.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref, params)
    tb = target_distribution(final, lm, L, W, hot, t2d, chunk=5)
    denom = torch.tensor(plan_rows(tb, T, K))
    model = TTTModel(d, ttt=K, attn="sdpa", ce_chunk=3, loss=loss)
    out, _ = model(ids, aux, tb, denom)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    out.backward()
    names = [n for n, p in d.named_parameters() if p.requires_grad]
    assert any(n.startswith(f"layers.{num_layers - 1}.") for n in names)
    for n, p, g in zip(names, params, ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    with torch.no_grad():
        _, sim, runs = model(ids, aux, tb, evaluate=True)
    full = [(b, t) for b in range(ids.shape[0]) for t in range(T) if all((k, b, t) in table for k in range(K))]
    assert sim.tolist() == [float(len(full))] + [float(sum(all(table[(i, b, t)] for i in range(k + 1))
                                                           for b, t in full)) for k in range(K)]


def test_ttt_flops_of_a_deeper_drafter():
    """Each layer beyond the midlayer adds its weights (q/k/v over H inputs, not 2H) and its attention keys."""
    one, two = tiny_setup()[0].config, tiny_setup(num_layers=2)[0].config
    L, Hd, nh, hd = torch.tensor([3, 2]), one.hidden_size, one.num_attention_heads, one.head_dim
    p_layer = Hd * (nh + 2 * one.num_key_value_heads) * hd + nh * hd * Hd + 3 * Hd * one.intermediate_size
    keys = (1 + 2 + 3) + (1 + 2)
    extra = 6 * 2 * 5 * p_layer + 12 * nh * hd * (keys + keys + 5)  # ttt 2, N = 5 tokens
    assert ttt_flops(two, L, [4.0, 3.0], 4.0, 2) == ttt_flops(one, L, [4.0, 3.0], 4.0, 2) + extra
