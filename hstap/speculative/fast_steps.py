"""The fixed-shape steps of the fast decoder (hstap.speculative.fast): the target forward over the static cache, and the
bodies of the target-only, EAGLE draft / verify and n-gram verify steps.

A body is a function of no arguments over a dict of preallocated buffers `b` (0-d long scalars `start` = L-1, the
target cache length, and `root` = x[L-1], the newest token; per method its tree, pending pairs, noise and `out`, the
few integers the host reads). It reads and writes those buffers in place and nothing else, so the same body runs
eagerly (CPU, fallback) or as a replayed CUDA graph; bodies never read a tensor value on the host.
"""

from __future__ import annotations

import torch

from hstap.speculative.device_tree import (TreeShape, accept_greedy, accept_sampled_chain, draft, draft_chain, extend, gumbel,
                                    next_pending)
from hstap.speculative.static_kv import additive, block_mask, causal_rows, keep_path, seek


def run_target(target, cache, layers: list[int], ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
               rows: torch.Tensor | None = None):
    """ids (1, T) at positions pos (1, T), additive mask (1, 1, T, S), through the static cache -> logits (T, V) fp32
    (only of `rows` (R,) if given) and the drafter's fc input (T, K, H): the outputs of the decoder layers `layers`
    (the final-norm state if none).

    The model's own forward (embed, rotary, decoder layers, final norm) without its mask construction, which a 4-D
    mask skips anyway, and without hooks: the aux states are taken as the loop passes them."""
    base = target.base
    h = base.embed_tokens(ids)  # (1, T, H)
    pe = base.rotary_emb(h, pos)
    want = {layer: j for j, layer in enumerate(layers)}
    grabbed: list = [None] * len(layers)
    for i, layer in enumerate(base.layers):
        h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos, past_key_values=cache,
                  use_cache=True)
        h = h[0] if isinstance(h, tuple) else h  # (1, T, H)
        if i in want:
            grabbed[want[i]] = h
    final = base.norm(h)  # (1, T, H)
    aux = torch.stack(grabbed, dim=2) if layers else final.unsqueeze(2)  # (1, T, K, H)
    head_in = final[0] if rows is None else final[0].index_select(0, rows)  # (T or R, H)
    return target.logits(head_in).float(), aux[0]


def _scalar(dev) -> torch.Tensor:
    return torch.zeros((), dtype=torch.long, device=dev)


# --- prefill (bucketed: prompts padded to a power of two) -----------------------------------------------------------
def prefill_buffers(dev, L: int, vocab: int, n_aux: int, width: int, dtype) -> dict:
    return {"ids": torch.zeros(L, dtype=torch.long, device=dev), "n": _scalar(dev),
            "logit": torch.zeros(vocab, device=dev), "aux_last": torch.zeros(n_aux, width, dtype=dtype, device=dev)}


def prefill_body(b: dict, fwd, cache, col: torch.Tensor, dtype, drafter=None, dcache=None):
    """The n real tokens of b["ids"] (L,) through the target at slots 0..L-1 (padding rows come after the real ones,
    so causal attention keeps them out; their slots are rewritten later); keeps the newest token's logits and fc
    input. With a drafter, also its extend of the pairs (x[t+1], aux[t]), t < n-1, at drafter slots 0..L-2: all but
    the newest pair, which the first round extends."""
    L = b["ids"].shape[0]

    def body():
        pos = torch.arange(L, device=col.device)  # (L,)
        seek(cache, 0)
        last = (b["n"] - 1).view(1)
        logits, aux = fwd(b["ids"][None], pos[None], additive(causal_rows(col, pos), dtype), last)  # (1, V)
        b["logit"].copy_(logits[0])
        b["aux_last"].copy_(aux.index_select(0, last)[0])
        if drafter is not None and L > 1:
            dpos = pos[:L - 1]
            drafter(b["ids"][None, 1:], drafter.project(aux[None, :L - 1]), dpos[None], dcache.at(dpos),
                    causal_rows(col, dpos))

    return body


# --- target-only ------------------------------------------------------------------------------------------------------
def decode_buffers(dev, vocab: int) -> dict:
    return {"start": _scalar(dev), "root": _scalar(dev), "out": torch.zeros(1, dtype=torch.long, device=dev),
            "u": torch.zeros(vocab, device=dev)}


def decode_body(b: dict, fwd, cache, col: torch.Tensor, dtype, temperature: float):
    """One token: x[L-1] through the target at slot L-1; y = argmax, or a Gumbel-max sample of softmax(logits / T)
    with the uniforms b["u"] (V,) drawn outside."""
    def body():
        seek(cache, b["start"])
        pos = b["start"].view(1)  # (1,)
        logits, _ = fwd(b["root"].view(1, 1), pos[None], additive(causal_rows(col, pos), dtype))  # (1, V)
        z = logits[0] if temperature == 0 else logits[0] / temperature + gumbel(b["u"])
        y = z.argmax()
        b["root"].copy_(y)
        b["out"].copy_(y.view(1))
        b["start"].add_(1)
    return body


# --- EAGLE: draft + verify --------------------------------------------------------------------------------------------
def spec_buffers(dev, shape: TreeShape, n_aux: int, width: int, vocab: int, draft_vocab: int, aux_dtype,
                 sampling: bool) -> dict:
    N, P, D = shape.N, shape.P, shape.depth
    b = {"start": _scalar(dev), "root": _scalar(dev), "pend_n": _scalar(dev),
         "pend_ids": torch.zeros(P, dtype=torch.long, device=dev),  # (P,) right-aligned, the last pend_n real
         "pend_aux": torch.zeros(P, n_aux, width, dtype=aux_dtype, device=dev),  # (P, K, Ht)
         "tok": torch.zeros(N, dtype=torch.long, device=dev), "depth": torch.zeros(N, dtype=torch.long, device=dev),
         "parent": torch.zeros(N, dtype=torch.long, device=dev),
         "anc": torch.eye(N, dtype=torch.bool, device=dev),  # (N, N)
         "out": torch.zeros(P + 2, dtype=torch.long, device=dev)}  # [accepted, moved, new tokens right-aligned (P,)]
    if shape.chain:  # a chain's node arrays are constants (draft_chain writes the tokens only)
        ar = torch.arange(N, device=dev)
        b["depth"].copy_(ar)
        b["parent"].copy_((ar - 1).clamp_min(0))
        b["anc"].copy_(torch.ones(N, N, dtype=torch.bool, device=dev).tril())
    if sampling:
        b["q"] = torch.zeros(N - 1, draft_vocab, device=dev)  # (N-1, Vd)
        b["u"] = torch.zeros(D * draft_vocab + (N - 1) + vocab, device=dev)  # drafting, acceptance, final draw
    return b


def _noise(b: dict, shape: TreeShape, draft_vocab: int):
    u = b["u"]
    n = shape.depth * draft_vocab
    return u[:n].view(shape.depth, draft_vocab), u[n:n + shape.N - 1], u[n + shape.N - 1:]  # (D, Vd), (N-1,), (V,)


def spec_bodies(b: dict, drafter, dcache, hot: torch.Tensor, fwd, cache, col: torch.Tensor, dtype, shape: TreeShape,
                temperature: float, lean: bool = False):
    """(draft body, verify body) of one round; temperature > 0 only for chains (TreeShape.chain). lean: a greedy
    chain drafts with device_tree.draft_chain (argmax alone; the constant node arrays are not rewritten)."""
    N, P = shape.N, shape.P
    sampling = temperature > 0

    def chain_body():
        h_last = extend(drafter, dcache, b["pend_ids"], b["pend_aux"], b["pend_n"], b["start"], col)  # (1, H)
        b["tok"].copy_(draft_chain(drafter, dcache, h_last, b["root"], b["start"], col, shape.depth, hot))

    def draft_body():
        u_draft = _noise(b, shape, hot.shape[0])[0] if sampling else None
        h_last = extend(drafter, dcache, b["pend_ids"], b["pend_aux"], b["pend_n"], b["start"], col)  # (1, H)
        t = draft(drafter, dcache, h_last, b["root"], b["start"], col, shape, hot, temperature, u_draft)
        for name in ("tok", "depth", "parent", "anc") + (("q",) if sampling else ()):
            b[name].copy_(t[name])

    def verify_body():
        start, tok = b["start"], b["tok"]
        seek(cache, start)
        mask = additive(block_mask(col, start, b["anc"]), dtype)  # (1, 1, N, S)
        logits, aux = fwd(tok[None], (start + b["depth"])[None], mask)  # (N, V), (N, K, Ht)
        if sampling:
            _, u_acc, u_y = _noise(b, shape, hot.shape[0])
            q = torch.zeros(N - 1, logits.shape[-1], device=logits.device).index_copy_(1, hot, b["q"])  # (N-1, V)
            a, path, y = accept_sampled_chain(logits, tok, q, N - 1, temperature, u_acc, gumbel(u_y))
        else:
            a, path, y = accept_greedy(logits, tok, b["parent"], b["anc"], P)
        path = path[:P]
        moved = ((path != torch.arange(P, device=path.device)) & (torch.arange(P, device=path.device) <= a)).any()
        if not shape.chain:  # a chain's path is its prefix: nothing moves
            keep_path(cache, start, path)
        ids, paux = next_pending(tok, path, a, y, aux)
        b["out"].copy_(torch.cat([a.view(1), moved.long().view(1), ids]))
        b["pend_ids"].copy_(ids)
        b["pend_aux"].copy_(paux)
        b["pend_n"].copy_(a + 1)
        b["root"].copy_(y)
        start.add_(a + 1)

    return (chain_body if lean and shape.chain and not sampling else draft_body), verify_body


# --- n-gram -----------------------------------------------------------------------------------------------------------
def ngram_buffers(dev, k: int, vocab: int) -> dict:
    return {"start": _scalar(dev), "chain": torch.zeros(k + 2, dtype=torch.long, device=dev),  # [n, root, drafts]
            "out": torch.zeros(2, dtype=torch.long, device=dev),  # [accepted, y]
            "u": torch.zeros(k + vocab, device=dev)}


def ngram_body(b: dict, fwd, cache, col: torch.Tensor, dtype, k: int, temperature: float):
    """Verify the host's chain b["chain"][1:] (root + n_valid drafts, padded to k+1) in one (k+1)-token forward."""
    N = k + 1

    def body():
        start, n_valid, tok = b["start"], b["chain"][0], b["chain"][1:]
        ar = torch.arange(N, device=tok.device)  # (N,)
        seek(cache, start)
        logits, _ = fwd(tok[None], (start + ar)[None], additive(causal_rows(col, start + ar), dtype))  # (N, V)
        if temperature > 0:  # deterministic drafts: q is a point mass at each draft
            q = (torch.arange(logits.shape[-1], device=tok.device)[None] == tok[1:, None]).float()  # (k, V)
            a, _, y = accept_sampled_chain(logits, tok, q, n_valid, temperature, b["u"][:k], gumbel(b["u"][k:]))
        else:
            parent = (ar - 1).clamp_min(0)
            anc = torch.ones(N, N, dtype=torch.bool, device=tok.device).tril()  # (N, N)
            a, _, y = accept_greedy(logits, tok, parent, anc, N, valid=ar <= n_valid)
        b["out"].copy_(torch.stack([a, y]))
        start.add_(a + 1)

    return body
