"""The training-time test (TTT) of an EAGLE-3 drafter: masks, target distribution, the soft cross-entropy, the TTT
model, chain replay for evaluation, and the FLOP count.

`ttt_mask` / `ttt_block_mask` build the training-time-test attention pattern: step 0 is causal, and at step k a query
also sees the keys of steps 1..k at its own position only (the "diagonal").

Training-time test (`TTTModel`, one module forward per batch so DDP/FSDP can wrap it). Step k = 0..K-1 at position t:
input token x[t+1+k]; hidden input fc(aux[t]) at k = 0, else the step k-1 output h_out at t; rotary position t+k (what
decoding uses for the k-th draft token, and SpecForge's `position_ids + lck`); target distribution softmax over the
draft vocabulary of the target's logits at t+1+k (the frozen target lm_head applied to `final[t+1+k]`, columns of the
hot ids); predicted token x[t+2+k]. A (step, position) is counted when loss_mask[t+2+k] == 1, t+2+k < length and the
target's full-vocabulary argmax at t+1+k lies in the draft vocabulary. Loss = sum_k decay^k * mean over counted
positions of the per-row objective: by default (`TTTModel`) the soft cross-entropy -sum p_target log softmax(draft
logits); `loss_core` gives the others (total variation, reverse KL, hard cross-entropy, HASS's top-k, mixes, the
LK-style hybrid; train's default is ce+hard). Evaluation reports the same objective.

Right padding needs no mask of its own: a counted query (t+2+k < length) only sees step-0 keys at s <= t and diagonal
keys at t, all of which were built from real tokens.

Single-device model code: no I/O, no ranks, no logging.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hstap.models.compiled import FlexCompileError, compile_region
from hstap.models.drafter import DrafterConfig, Eagle3Drafter, new_drafter_cache
from hstap.train.config import loss_terms


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Exact TTT mask for SDPA: (T, (step+1)*T) bool, True = may attend.

    Keys are laid out step-major: [step-0 keys 0..T-1, step-1 keys 0..T-1, ...]. Step-0 keys are causal; keys of steps
    1..step are visible only at the query's own position. With right padding no real query ever sees a padded key
    (causality), so no length mask is needed.
    """
    q = torch.arange(T, device=device)
    kv = torch.arange((step + 1) * T, device=device)
    kstep, kpos = kv // T, kv % T
    return ((kstep[None] == 0) & (kpos[None] <= q[:, None])) | ((kstep[None] > 0) & (kpos[None] == q[:, None]))


def ttt_block_mask(T: int, step: int, device="cuda"):
    """The same pattern as `ttt_mask` as a flex_attention BlockMask (sparse: only diagonal blocks of steps >= 1).

    T enters the mask function as a captured tensor, not a Python int, so a compiled flex_attention does not specialise
    (and recompile) on every sequence length."""
    from torch.nn.attention.flex_attention import create_block_mask

    period = torch.tensor(T, dtype=torch.int32, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        kstep, kpos = kv_idx // period, kv_idx % period
        return ((kstep == 0) & (kpos <= q_idx)) | ((kstep > 0) & (kpos == q_idx))

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=(step + 1) * T, device=device)


@torch.no_grad()
def target_distribution(final: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, head_weight: torch.Tensor,
                        hot: torch.Tensor, t2d: torch.Tensor, chunk: int = 4096, p_dtype=torch.float32) -> dict:
    """The target's next-token distributions over the draft vocabulary, only where some TTT step can count them.

    final (B, T, H) target final-norm states; loss_mask (B, T); lengths (B,); head_weight (V, H) the frozen target
    lm_head (its dtype is the matmul dtype); hot (Vd,) target ids of the draft vocabulary; t2d (V,) bool.
    Position s is a candidate when loss_mask[s+1] == 1 and s+1 < length (its target predicts a trained token).
    Returns {"s": (R,) flat indices b*T+s of the candidates, "p": (R, Vd) softmax of the hot columns of the target
    logits, "tgt": (R,) their argmax (a draft index), "inv": (R,) full-vocabulary argmax lies in the draft vocabulary}.
    Chunked over rows so that the (rows, V) logits never exist for the whole batch.
    """
    B, T, H = final.shape
    dev = final.device
    nxt = F.pad(loss_mask[:, 1:], (0, 1))  # (B, T): loss_mask[s+1]
    cand = (nxt == 1) & (torch.arange(T, device=dev)[None] + 1 < lengths.to(dev)[:, None])  # (B, T)
    s = cand.flatten().nonzero().squeeze(1)  # (R,)
    x = final.reshape(B * T, H).index_select(0, s)  # (R, H)
    R, Vd = s.numel(), hot.numel()
    p = torch.empty(R, Vd, dtype=p_dtype, device=dev)  # (R, Vd)
    tgt = torch.empty(R, dtype=torch.long, device=dev)  # (R,)
    inv = torch.empty(R, dtype=torch.bool, device=dev)  # (R,)
    for a in range(0, R, chunk):
        z = x[a:a + chunk].to(head_weight.dtype) @ head_weight.t()  # (n, V)
        inv[a:a + chunk] = t2d[z.argmax(-1)]
        zh = z.index_select(1, hot).float()  # (n, Vd)
        p[a:a + chunk] = torch.softmax(zh, -1).to(p_dtype)
        tgt[a:a + chunk] = zh.argmax(-1)
    return {"s": s, "p": p, "tgt": tgt, "inv": inv}


def ce_core(z: torch.Tensor, p: torch.Tensor, grad: bool = True):
    """z (n, Vd) fp32 draft logits, p (n, Vd) target probabilities -> loss (n,), d loss / d z (n, Vd) (None unless
    grad), argmax (n,).

    loss = -sum p log softmax(z) = lse * sum(p) - sum(p z); written with sum(p) so a bf16-rounded p stays exact."""
    lse = torch.logsumexp(z, -1, keepdim=True)  # (n, 1)
    psum = p.sum(-1, keepdim=True)  # (n, 1)
    loss = (lse * psum - (p * z).sum(-1, keepdim=True)).squeeze(-1)  # (n,)
    return loss, (torch.exp(z - lse) * psum - p if grad else None), z.argmax(-1)


TOPK_K = 10
"""K of the "topk" term: HASS's harmonized objective distillation (Zhang et al., ICLR 2025) takes the target's 10 most
likely ids; its recipe adds the term to the cross-entropy with weight 1: `--loss ce+topk --loss-mix 0.5` here, which
is that sum times 0.5 (the same direction; AdamW's steps hardly change, the norm that --grad-clip sees halves)."""


def _term(name: str, z, p, q, lse):
    """One loss term and its gradient in z: (n,), (n, Vd). q = softmax(z), lse = logsumexp(z) (n, 1)."""
    if name == "ce":  # soft cross-entropy -sum p log q (= forward KL + H(p))
        psum = p.sum(-1, keepdim=True)  # (n, 1)
        return (lse * psum - (p * z).sum(-1, keepdim=True)).squeeze(-1), q * psum - p
    if name == "hard":  # cross-entropy against the target's argmax: the greedy-decoding surrogate
        onehot = torch.zeros_like(z).scatter_(-1, p.argmax(-1, keepdim=True), 1.0)  # (n, Vd); compiles (no one_hot)
        return (lse - (onehot * z).sum(-1, keepdim=True)).squeeze(-1), q - onehot
    if name == "topk":  # the cross-entropy over the target's TOPK_K most likely ids only (HASS)
        top = p.topk(min(TOPK_K, p.shape[-1]), -1).indices  # (n, K)
        pk = torch.zeros_like(p).scatter_(-1, top, p.gather(-1, top))  # (n, Vd): p outside its top K set to 0
        return _term("ce", z, pk, q, lse)  # the soft cross-entropy against that truncated p
    if name == "tv":  # total variation 0.5 sum |q - p| = 1 - acceptance probability under sampling
        s = torch.sign(q - p)  # (n, Vd)
        return 0.5 * (q - p).abs().sum(-1), 0.5 * q * (s - (s * q).sum(-1, keepdim=True))
    # reverse KL sum q (log q - log p); p clamped away from 0 (a softmax underflow), so log p stays finite
    a = (z - lse) - torch.log(p.clamp_min(1e-30))  # (n, Vd)
    qa = (q * a).sum(-1, keepdim=True)  # (n, 1)
    return qa.squeeze(-1), q * (a - qa)


def loss_core(loss: str = "ce", mix: float = 0.5, lk_decay: float = 3.0):
    """The per-row objective of `--loss` as a core for `soft_ce`: core(z, p, grad) -> (loss (n,), d loss / d z or
    None, argmax (n,)), z fp32 draft logits (n, Vd), p target probabilities (n, Vd). Exact gradients, in closed form.

    "ce" is `ce_core` itself (the soft cross-entropy, bit for bit). "tv", "rkl", "hard", "topk": one term (`_term`).
    "a+b": (1 - mix) * a + mix * b. "lk" (LK-style lambda hybrid, per row): w * ce + (1 - w) * tv with
    w = exp(-lk_decay * (1 - tv)) held constant (no gradient through w): rows the drafter already accepts well are
    trained on acceptance, the others mostly on the cross-entropy."""
    names = loss_terms(loss)
    if loss == "ce":
        return ce_core

    def core(z: torch.Tensor, p: torch.Tensor, grad: bool = True):
        lse = torch.logsumexp(z, -1, keepdim=True)  # (n, 1)
        q = torch.exp(z - lse)  # (n, Vd)
        parts = [_term(n, z, p, q, lse) for n in names]
        if len(parts) == 1:
            total, g = parts[0]
        else:
            (l0, g0), (l1, g1) = parts
            if loss == "lk":  # the second term's (tv's) weight per row, held constant
                w = (1 - torch.exp(-lk_decay * (1 - l1))).unsqueeze(-1)  # (n, 1)
            else:
                w = torch.full_like(l0, mix).unsqueeze(-1)  # (n, 1)
            total = ((1 - w) * l0.unsqueeze(-1) + w * l1.unsqueeze(-1)).squeeze(-1)  # (n,)
            g = (1 - w) * g0 + w * g1  # (n, Vd)
        return total, (g if grad else None), z.argmax(-1)

    return core


def _ce_chunks(x, weight, p, chunk: int, cd, core, grad: bool):
    """The soft cross-entropy of lm_head(x) against p, chunked: the (rows, Vd) logits exist one chunk at a time.

    x (n, H), weight (Vd, H), p (n, Vd); cd the matmul dtype. -> (sum of losses () fp32, losses (n,), argmax (n,),
    d sum / d x (n, H) and d sum / d weight (Vd, H) fp32 when grad, else None)."""
    wc = weight.to(cd)  # (Vd, H)
    n = x.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    loss = torch.empty(n, dtype=torch.float32, device=x.device)  # (n,)
    pred = torch.empty(n, dtype=torch.long, device=x.device)  # (n,)
    gx = torch.empty_like(x) if grad else None  # (n, H)
    gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad else None  # (Vd, H)
    for a in range(0, n, chunk):
        xc = x[a:a + chunk].to(cd)  # (c, H)
        lc, dz, top = core((xc @ wc.t()).float(), p[a:a + chunk].float(), grad)  # (c,), (c, Vd), (c,)
        total += lc.sum()
        loss[a:a + chunk] = lc
        pred[a:a + chunk] = top
        if grad:
            dz = dz.to(cd)
            gx[a:a + chunk] = dz @ wc
            gw += (dz.t() @ xc).float()
    return total, loss, pred, gx, gw


class _SoftCE(torch.autograd.Function):
    """Sum over rows of the soft cross-entropy, with the gradients of x and of the weight computed in the forward
    (what is kept is (rows, H) + (Vd, H)), so no logits are saved for backward."""

    @staticmethod
    def forward(ctx, x, weight, p, chunk, cd, core):
        total, _, pred, gx, gw = _ce_chunks(x, weight, p, chunk, cd, core, grad=True)
        ctx.save_for_backward(gx, gw)
        ctx.w_dtype = weight.dtype
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, g_total, g_pred):
        gx, gw = ctx.saved_tensors
        return gx * g_total.to(gx.dtype), (gw * g_total).to(ctx.w_dtype), None, None, None, None


def soft_ce(x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, chunk: int = 4096, compute_dtype=None, core=None):
    """x (n, H) normed drafter states, weight (Vd, H) drafter lm_head, p (n, Vd) -> (sum of losses (), argmax (n,)).

    Training: differentiable in x and weight. `core` is a `loss_core` objective (default `ce_core`, the soft
    cross-entropy) or a compiled copy of one."""
    return _SoftCE.apply(x, weight, p, chunk, compute_dtype or x.dtype, core or ce_core)


@torch.no_grad()
def soft_ce_rows(x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, chunk: int = 4096, compute_dtype=None,
                 core=None):
    """The same objective per row (default the soft cross-entropy), without gradients (evaluation) -> (losses (n,),
    argmax (n,))."""
    _, loss, pred, _, _ = _ce_chunks(x, weight, p, chunk, compute_dtype or x.dtype, core or ce_core, grad=False)
    return loss, pred


def step_rows(tb: dict, T: int, k: int, counted_only: bool = True):
    """Rows of TTT step k: (rows_t (n,) flat query indices b*T+t, rows_c (n,) indices into tb's candidate rows).

    Step k at t reads the target at s = t+1+k, so t = s-1-k must stay in the same sequence: s % T >= 1+k."""
    keep = (tb["s"] % T) >= 1 + k  # (R,)
    if counted_only:
        keep &= tb["inv"]
    rows_c = keep.nonzero().squeeze(1)  # (n,)
    return tb["s"][rows_c] - (1 + k), rows_c


FLEX_MIN_HEAD_DIM = 16
"""Narrowest head flex_attention's Triton kernels are given (their tl.dot tiles need K >= 16); narrower: SDPA."""


def ttt_attention(requested: str, device: str, head_dim: int) -> tuple[str, str]:
    """The TTT attention kernel of a run and why, decided before the first batch -> ("flex" | "sdpa" | "causal", the
    reason: train's run-log line). requested: --attn (auto, flex, sdpa, causal); device: "cuda" or "cpu".

    The choice depends on the device and the drafter's shape only, never on the batches, so a resumed run takes the
    kernel of the uninterrupted one. flex and sdpa compute the same exact TTT attention; flex is faster (sparse)."""
    if requested in ("sdpa", "causal"):
        return requested, f"--attn {requested}"
    if device != "cuda":
        if requested == "flex":
            return "flex", "--attn flex on CPU: eager flex_attention (forward only)"
        return "sdpa", "CPU: SDPA with the exact TTT mask"
    if head_dim < FLEX_MIN_HEAD_DIM:
        return "sdpa", (f"head_dim {head_dim} < {FLEX_MIN_HEAD_DIM}, narrower than flex_attention's Triton kernels "
                        f"take: SDPA with the exact TTT mask")
    return "flex", ("compiled flex_attention, its main Triton kernel for every shape (hstap.models.drafter.FLEX_KERNEL_OPTIONS)"
                    " with the sparse exact TTT mask; SDPA with the exact mask if compiling it ever fails")


def plan_rows(tb: dict, T: int, K: int) -> list[float]:
    """The counted rows of TTT steps 0..K-1 (`step_rows(tb, T, k)`, the same tensors) at once, with two host syncs in
    all instead of one per step inside the forward. Adds tb["rows"] = [(rows_t, rows_c)] per step and tb["counted"]
    (K,) float64 on the device (read by `TTTModel` in training); returns the counted rows per step as floats."""
    s = tb["s"]  # (R,)
    keep = ((s % T)[None] >= torch.arange(1, K + 1, device=s.device)[:, None]) & tb["inv"][None]  # (K, R)
    counts = keep.sum(1)  # (K,)
    sizes = counts.tolist()
    rows_c = keep.nonzero()[:, 1].contiguous().split(sizes)  # k-major, ascending within a step: step_rows' order
    tb["rows"] = [(s[rc] - (1 + k), rc) for k, rc in enumerate(rows_c)]
    tb["counted"] = counts.double()  # (K,)
    return [float(c) for c in sizes]


class TTTModel(nn.Module):
    """The training-time test of a drafter over one batch as a single forward (the module DDP/FSDP wrap).

    attn: "sdpa" (exact bool mask, any device), "flex" (BlockMask; compiled on CUDA), "causal" (approximate: each step
    attends causally to its own keys only, no cache; a cheaper baseline, not the EAGLE-3 objective). loss, loss_mix,
    lk_decay: the per-row objective (`loss_core`; "ce" = the soft cross-entropy). A deeper drafter (num_layers > 1)
    keeps one cache per layer over the TTT steps, every layer with the same TTT mask. If compiling flex_attention fails
    for a batch (`FlexCompileError`), the batch is recomputed with "sdpa", which is exact too, and so is every later
    one; `attn_fallback` then holds the reason (the trainer logs it)."""

    def __init__(self, drafter: Eagle3Drafter, ttt: int = 7, decay: float = 0.8, attn: str = "sdpa",
                 ce_chunk: int = 4096, compile: bool = False, loss: str = "ce", loss_mix: float = 0.5,
                 lk_decay: float = 3.0):
        super().__init__()
        if attn not in ("sdpa", "flex", "causal"):
            raise ValueError(f"attn: expected sdpa, flex or causal, got {attn!r}")
        self.drafter, self.ttt, self.decay, self.attn, self.ce_chunk = drafter, ttt, decay, attn, ce_chunk
        self._masks: dict = {}
        self.attn_fallback: str | None = None
        self.ce_core = loss_core(loss, loss_mix, lk_decay)  # the objective of `soft_ce` (compiled with compile=True)
        self.eval_core = self.ce_core  # the same objective for evaluation, never compiled (no grad: one pass anyway)
        if compile:
            for layer in drafter.decoder_layers():
                layer.pre = compile_region(layer.pre)  # norms + q/k/v + RoPE fused
                layer.post = compile_region(layer.post)  # o_proj + residual + norm + SwiGLU MLP + residual fused
            self.ce_core = compile_region(self.ce_core, dynamic=True)  # one pass over the (chunk, Vd) logits

    def _mask(self, T: int, k: int, device):
        if self.attn == "causal":
            return None
        key = (T, k, str(device))
        m = self._masks.get(key)
        if m is None:
            # batches of many different lengths: keep memory bounded (a BlockMask is small, a bool mask (T, (k+1)T))
            if len(self._masks) >= (4096 if self.attn == "flex" else 128):
                self._masks.clear()
            m = self._masks[key] = (ttt_block_mask if self.attn == "flex" else ttt_mask)(T, k, device=device)
        return m

    def forward(self, *args, **kw):
        """`_forward`'s result; on a flex_attention compile failure, recomputed from the start with SDPA (nothing of the
        failed pass is kept: its partial graph is dropped, and the forward has no randomness)."""
        try:
            return self._forward(*args, **kw)
        except FlexCompileError as e:
            if self.attn != "flex":
                raise
            self.attn, self.attn_fallback = "sdpa", str(e)
            self._masks.clear()  # BlockMasks: the bool masks of SDPA are built from now on
            return self._forward(*args, **kw)

    def _forward(self, input_ids: torch.Tensor, feats: torch.Tensor, tb: dict, denom: torch.Tensor | None = None,
                 scale: float = 1.0, evaluate: bool = False):
        """input_ids (B, T); feats (B, T, K, Ht) fc inputs; tb from `target_distribution`.

        Training: returns (loss, stats) with loss = scale * sum_k decay^k * sum(CE_k) / denom[k] (denom (K,) = counted
        positions of step k over the whole global batch, so that partial batches on several ranks or micro-steps add
        up to the global mean) and stats (K, 3) = [sum CE_k, correct_k, counted_k] of this batch (no grad).
        evaluate=True (no grad): returns (stats, sim (K+1,), runs (B, T)) where stats is as above, sim = [positions
        where every step is countable (loss_mask and length only), positions where steps 0..k are all correct, for each
        k] and runs[b, t] = how many leading steps are correct at t (0..K; a step that cannot be counted there ends the
        run); a step whose target argmax lies outside the draft vocabulary counts as wrong (it cannot be proposed)."""
        d = self.drafter
        B, T = input_ids.shape
        dev = input_ids.device
        hidden = d.project(feats)  # (B, T, H)
        cd = torch.get_autocast_dtype("cuda") if hidden.is_cuda and torch.is_autocast_enabled("cuda") else hidden.dtype
        cache = None if self.attn == "causal" else new_drafter_cache(d)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        stats = torch.zeros(self.ttt, 3, dtype=torch.float64, device=dev)  # (K, 3)
        countable = torch.ones(B * T, dtype=torch.bool, device=dev)  # (B*T,) evaluate: countable at every step
        prefix = []  # evaluate: (B*T,) bool per step, steps 0..k all correct
        for k in range(self.ttt):
            ids = F.pad(input_ids[:, 1 + k:], (0, 1 + k))  # (B, T): x[t+1+k], 0 past the end
            pos = (torch.arange(T, device=dev) + k).expand(B, T)  # (B, T): draft step k sits at t+k
            h = d(ids, hidden, pos, cache, self._mask(T, k, dev))  # (B, T, H)
            planned = not evaluate and "rows" in tb  # `plan_rows` ran (Feed): no host sync here
            rows_t, rows_c = tb["rows"][k] if planned else step_rows(tb, T, k, counted_only=not evaluate)
            x = d.head_input(h.reshape(B * T, -1).index_select(0, rows_t))  # (n, H)
            p, tgt = tb["p"].index_select(0, rows_c), tb["tgt"].index_select(0, rows_c)  # (n, Vd), (n,)
            if evaluate:
                ce, pred = soft_ce_rows(x, d.lm_head.weight, p, self.ce_chunk, cd, self.eval_core)  # (n,), (n,)
                inv = tb["inv"].index_select(0, rows_c)  # (n,)
                ok = (pred == tgt) & inv
                stats[k] = torch.stack([(ce * inv).sum().double(), ok.sum().double(), inv.sum().double()])
                here = torch.zeros(B * T, dtype=torch.bool, device=dev)  # (B*T,)
                countable &= here.index_fill(0, rows_t, True)
                right = here.index_put((rows_t,), ok)  # (B*T,)
                prefix.append(right if k == 0 else prefix[-1] & right)
            else:
                ce, pred = soft_ce(x, d.lm_head.weight, p, self.ce_chunk, cd, self.ce_core)
                loss = loss + (scale * self.decay ** k) * ce / denom[k].clamp_min(1)
                n_k = tb["counted"][k] if planned else torch.tensor(float(rows_c.numel()), dtype=torch.float64,
                                                                     device=dev)
                stats[k] = torch.stack([ce.detach().double(), (pred == tgt).sum().double(), n_k])
            hidden = h
        if not evaluate:
            return loss, stats
        sim = torch.stack([countable.sum()] + [(pk & countable).sum() for pk in prefix]).double()  # (K+1,)
        runs = torch.stack(prefix).sum(0).view(B, T)  # (B, T): leading correct steps
        return stats, sim, runs


def replay_chain(runs: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, max_k: int):
    """Greedy chain decoding replayed on teacher-forced runs -> (tokens (max_k,), rounds (max_k,)) for k = 1..max_k.

    Each answer (maximal span [P, E) of loss_mask = 1) is decoded as `speculative/drivers.py` would: x[P] comes from the
    prefill; a round at drafter position t (first t = P-1) accepts a = min(k, runs[t]) drafts plus one target token,
    producing x[t+2 .. t+2+a], and the next round starts at t + a + 1. On the target's own greedy outputs (`hstap
    generate`) this is what decoding does, round for round, so tokens / rounds predicts the measured tau; unlike the
    mean of prod acc_cond it keeps the fact that rounds start right after a rejection, where drafting is harder."""
    r, m = runs.cpu().numpy(), loss_mask.cpu().numpy().astype(bool)
    tokens, rounds = np.zeros(max_k, dtype=np.int64), np.zeros(max_k, dtype=np.int64)
    for b, n in enumerate(lengths.tolist()):
        mb = m[b, :n]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mb.astype(np.int8), [0]])))  # span starts, ends
        for P, E in zip(edges[::2], edges[1::2]):
            if P == 0:
                continue  # no prompt token before the answer: nothing to decode from
            for k in range(1, max_k + 1):
                t = P - 1
                while t + 2 < E:
                    a = min(k, int(r[b, t]))
                    tokens[k - 1] += min(a + 1, E - (t + 2))
                    rounds[k - 1] += 1
                    t += a + 1
    return tokens, rounds


def ttt_flops(cfg: DrafterConfig, lengths: torch.Tensor, counted: list[float], rows: float, ttt: int,
              exact_attn: bool = True) -> float:
    """Model FLOPs of one training batch (useful work only): lengths (B,) real tokens, counted[k] rows of TTT step k,
    rows = rows of the target head (`target_distribution` candidates). With N = sum(lengths):
    fc 4*N*K*Ht*H (forward + weight gradient; its input needs none) + 6*ttt*N*P_mid (q,k,v,o,gate,up,down weights)
    + 6*sum_k counted_k*H*Vd (the drafter lm_head runs on counted rows only) + 12*nh*hd*sum_k sum_t (t+1+k)
    (attention QK^T and PV: 4 FLOPs per query, key and dim forward, 8 backward; keys of the exact TTT mask, t+1 for
    the causal-only approximation) + 2*rows*H*V (target lm_head, forward only). A deeper drafter adds, per layer
    beyond the midlayer, its weights (q/k/v over H inputs) and its attention."""
    H, hd, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    L = lengths.double().cpu()
    N = float(L.sum())
    depth = getattr(cfg, "num_layers", 1)  # decoder layers of the drafter
    p_rest = nh * hd * H + 3 * H * cfg.intermediate_size  # o_proj + MLP
    p_mid = 2 * H * (nh + 2 * cfg.num_key_value_heads) * hd + p_rest
    p_mid += (depth - 1) * (H * (nh + 2 * cfg.num_key_value_heads) * hd + p_rest)
    f = 4 * N * cfg.num_aux * cfg.target_hidden_size * H + 6 * ttt * N * p_mid
    f += 6 * sum(counted) * H * cfg.draft_vocab_size + 2 * rows * H * cfg.vocab_size
    keys = float((L * (L + 1) / 2).sum())  # sum over tokens of (t+1)
    return f + 12 * nh * hd * depth * sum(keys + (k * N if exact_attn else 0.0) for k in range(ttt))
