"""MoE routing flips: which tokens a bf16 computation may send to other experts than an fp32 one, so that verify can
tell a routing flip from a wrong state.

Why: a DeepSeek-V3 / Kimi-K2 MoE layer sends each token to the top-k experts of its router's scores (sigmoid of the
router logits plus `e_score_correction_bias`, within the best `topk_group` groups). Where the k-th and (k+1)-th scores
of a token are closer than what bf16 rounding moves them by, the two precisions choose another expert set, that token's
output of the layer changes by a whole expert's contribution, and so do its states in every later layer: on the tiny
DeepSeek-V3 targets 0.5-2.5% of tokens, each far outside any rounding tolerance, while every other row stays within
it. Such a row is the served model's own state (a bf16 engine routes that way), not a wrong one.

The rule (`near_tie`): verify's recomputation runs the target twice on each compared sample, in its compute
dtype and in the other precision (bf16 <-> fp32; `hstap.verify.twin`), recording every router's logits and chosen experts (forward hooks on
the routers, `routers`). At each MoE layer l a token is *near a routing tie* when the two runs choose different expert
sets, or when its top-k margin (k-th minus (k+1)-th selection score, `margins`) is below TIE_FACTOR x tau_l, where
tau_l is the largest change of a margin between the two runs among the tokens routed alike up to l: the size of bf16's
effect on this layer's routing, measured on these very tokens rather than assumed. A stored state of layer L (or the
final state) may be excused as a routing flip only for a token near a tie at some MoE layer <= L; `stage._accumulate`
excludes such rows from the metrics only where they break the tolerance, counts them, and the verdict fails when they
exceed MAX_FLIP_SHARE of the tokens or when any other row breaks the tolerance. A rotation, a layer shift or another
model moves every row, near a tie or not: no flip allowance lets it pass.
"""

from __future__ import annotations

import contextlib

import torch

TIE_FACTOR = 2.0
"""Margin of safety over the measured bf16 effect: the engine's bf16 kernels (vLLM's fused MoE, its GEMMs) round in
another order than the recomputation's, so their routing perturbation is of the same size, not the same values."""

MAX_FLIP_SHARE = 0.05
"""Most tokens whose rows a verdict excuses as routing flips: twice the largest share measured on bf16 captures of the
tiny DeepSeek-V3 / Kimi-K2 targets (0.5-2.5%); more means more than routing differs."""


def routers(target) -> dict[int, torch.nn.Module]:
    """{decoder layer index: router} of a DeepSeek-V3-style MoE target (a `mlp.gate` with `top_k` and
    `e_score_correction_bias`, returning (logits, weights, expert ids)); empty for a dense target or another router."""
    out = {}
    for i, layer in enumerate(target.layers):
        g = getattr(getattr(layer, "mlp", None), "gate", None)
        if g is not None and hasattr(g, "top_k") and hasattr(g, "e_score_correction_bias"):
            out[i] = g
    return out


@contextlib.contextmanager
def recorded(gates: dict[int, torch.nn.Module]):
    """Yields {layer: (logits (T, E) fp32, expert ids (T, k))} filled by the next forward (one sample, batch 1)."""
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(i):
        def fn(module, inputs, output):
            got[i] = (output[0].detach().float().cpu(), output[2].detach().cpu())

        return fn

    handles = [g.register_forward_hook(hook(i)) for i, g in gates.items()]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def margins(gate: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """(T,) top-k margin of each token: its k-th minus its (k+1)-th selection score (sigmoid(logits) + bias) among the
    experts of its chosen groups, as the router selects (`DeepseekV3TopkRouter.forward`)."""
    s = logits.sigmoid() + gate.e_score_correction_bias.detach().float().cpu()  # (T, E)
    T, E = s.shape
    g, kg, k = int(gate.num_group), int(gate.topk_group), int(gate.top_k)
    if g > 1:
        group = s.view(T, g, E // g).topk(2, dim=-1)[0].sum(-1)  # (T, g)
        keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(kg, dim=-1)[1], True)  # (T, g)
        s = s.masked_fill(~keep[:, :, None].expand(T, g, E // g).reshape(T, E), float("-inf"))
    top = s.topk(min(k + 1, E), dim=-1)[0]  # (T, k+1)
    return (top[:, k - 1] - top[:, k]) if top.shape[1] > k else torch.full((T,), float("inf"))


@torch.no_grad()
def near_tie(gates: dict, got: dict, twin_gates: dict, twin_got: dict, layers: list[int]) -> torch.Tensor:
    """(T, len(layers)) bool: token t near a routing tie (module docstring) at some MoE layer <= layers[j]. `got` /
    `twin_got`: `recorded`'s dicts of the recomputation's forward and of its twin's in the other precision (the same
    tokens); `gates` / `twin_gates`: their routers (`routers`)."""
    T = next(iter(got.values()))[0].shape[0]
    near = torch.zeros(T, dtype=torch.bool)  # near a tie at some MoE layer so far
    moved = torch.zeros(T, dtype=torch.bool)  # routed otherwise at some MoE layer so far
    upto: dict[int, torch.Tensor] = {}
    for i in sorted(gates):
        (lh, eh), (ll, el) = got[i], twin_got[i]
        differ = (eh.sort(-1)[0] != el.sort(-1)[0]).any(-1)  # (T,)
        mh, ml = margins(gates[i], lh), margins(twin_gates[i], ll)  # (T,), (T,)
        alike = ~(moved | differ)
        tau = float((mh - ml).abs()[alike].max()) if bool(alike.any()) else 0.0  # bf16's effect on this layer's margins
        near |= differ | (mh < TIE_FACTOR * tau)
        moved |= differ
        upto[i] = near.clone()
    out = torch.zeros(T, len(layers), dtype=torch.bool)
    for j, L in enumerate(layers):
        below = [i for i in upto if i <= L]
        if below:
            out[:, j] = upto[max(below)]
    return out
