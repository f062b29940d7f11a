"""Speculative decoding with an EAGLE-3 drafter (chain or EAGLE-2 dynamic tree), the target-only baseline and n-gram
prompt lookup: plain functions and one driver each (gpt-fast style). Batch size 1; every driver returns
`(output_ids, stats)` with the generated ids only.

Bookkeeping between rounds (L = committed tokens, prompt + generated; the newest one, x[L-1], came out of the last
verify and has not been through the target yet):

    target cache   L-1 entries (positions 0..L-2), an HF `DynamicCache`
    drafter cache  L-1 entries: drafter position t holds (embed(x[t+1]), fc(aux[t])), SGLang's draft-extend alignment
                   (the pairs of the tokens accepted last round are added at the start of the next one)

One round (`spec_step`):
 1. extend the drafter with the pairs of the tokens accepted last round (their aux states come from the verify
    forward); its output at position L-2, h_last, has the logits that propose x[L];
 2. draft a tree rooted at x[L-1]: level-1 children come from h_last; a level-d node (sequence index L-1+d) is fed to
    the drafter at position L-2+d with its parent's h_out as hidden, attending to the drafter cache plus its ancestors.
    The drafter's rotary position grows with depth, as in SGLang/EAGLE decoding. A chain of k tokens is the tree with
    topk=1, depth=k, tokens=k+1 (its masks are plain causal ones, so none is built);
 3. verify: ONE target forward over [root, nodes...] at positions L-1+depth with a 4-D additive float mask over
    [cache + tree] (transformers passes a 4-D mask to the attention kernel as is; a float mask is right for both the
    sdpa and eager kernels, a bool one would be added as 0/1 by eager);
 4. accept: a path of verified nodes plus one more token y (the target's bonus, or a residual sample);
 5. roll back: the accepted path's KV entries are gathered into place (slots L-1.. <- L-1+path) and the cache cut to
    L+a. The path's slots increase, so this is one index_select per layer, no recomputation and exact. The drafter cache
    was cut back to L-1 right after drafting (its draft-step entries were made from its own h_out, not the target's).

Acceptance. Temperature 0: walk from the root while the target's argmax is a verified child; y = the argmax where the
walk stops. Lossless for any tree.

Temperature T > 0 (p = softmax(target / T); q = softmax(drafter / T) spread over target ids through d2t, zero outside
the hot ids). At each node its drafted children are tried in the order they were drawn: child c is accepted with
probability min(1, p(c)/q(c)); on rejection p <- norm(max(0, p - q)) and q <- q without c, renormalised; if every child
is rejected, y ~ p. This is exact when the children were drawn from q WITHOUT replacement: child i is then distributed
as the current (renormalised) q given everything before it, each trial is standard speculative sampling of the current
p, and by induction over the siblings the emitted token is distributed as p. Draws use Gumbel-top-k (the top-k of
log q + Gumbel noise, in order, is exactly sequential sampling without replacement). Pruning the tree to the `tokens`
budget must not bias the draws we rely on, hence two rules:
  (a) every drawn child is tried, verified or not; an accepted child that is not in the verified tree is emitted as
      the round's last token (a valid sample of p) instead of a bonus token;
  (b) at T > 0 a node is expanded (fed to the drafter, children drawn) only if it will be verified, decided before
      its children are drawn: per level the best min(topk, budget left) nodes by cumulative log q; the budget left at
      the end goes to the best unexpanded nodes, which have no children.
So the set of children of any node we continue from, and which of them are verified, never depends on those children
themselves. tests/test_speculate.py checks the output law with a chi-square test (chain, tree, n-gram).
At T = 0 the tree is EAGLE-2's: expand the top-k nodes of each level by cumulative log-prob, then keep the best
`tokens`-1 nodes overall (ancestor-closed: a child never scores above its parent, ties go to the parent).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hstap.common import HstapError
from hstap.drafter import DrafterCache


# --- small pieces ---------------------------------------------------------------------------------------------------
def _now(device: torch.device) -> float:
    if device.type == "cuda":  # kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _choose(logits: torch.Tensor, temperature: float, gen) -> int:
    """One token from a (V,) logit row: argmax at T=0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen))


def new_cache():
    """An HF DynamicCache of plain full-attention layers (so `keep_slots` can gather and cut every layer)."""
    from transformers import DynamicCache

    return DynamicCache()


def keep_slots(cache, start: int, slots: list[int]) -> bool:
    """Keep cache[:start] followed by cache[start + slots] in every layer and drop the rest; slots must increase.

    Returns True when entries had to move (a non-contiguous tree path)."""
    moved = slots != list(range(len(slots)))
    n = start + len(slots)
    idx: dict = {}  # device -> index tensor, built once (layers may sit on several devices)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not isinstance(getattr(layer, "keys", None), torch.Tensor):
            raise HstapError(f"speculate.py: cache layer {type(layer).__name__} cannot be rolled back "
                             "(need full-attention DynamicLayer layers)")
        if moved:  # index_select copies first, so the overlapping write is safe
            dev = layer.keys.device
            if dev not in idx:
                idx[dev] = torch.tensor(slots, device=dev) + start
            i = idx[dev]
            layer.keys[:, :, start:n] = layer.keys.index_select(2, i)  # (B, h, a+1, d)
            layer.values[:, :, start:n] = layer.values.index_select(2, i)
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
    return moved


def target_forward(target, ids: torch.Tensor, layers: list[int], cache, positions=None, mask=None):
    """ids (1, T) appended to `cache` -> logits (T, V) float32 and the drafter's fc input (T, K, H).

    With no aux layers (an EAGLE-1-style drafter) the fc input is the target's final-norm state (K=1)."""
    aux, final, _ = target.capture(ids, layers, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                   use_cache=True)  # (1, T, K, H), (1, T, H)
    if not layers:
        aux = final.unsqueeze(2)  # (1, T, 1, H)
    return target.logits(final[0]).float(), aux[0]  # (T, V), (T, K, H)


def tree_mask(parents: list[int], past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask (1, 1, N, past+N): every node sees the whole cache, itself and its ancestors; parents[i] < i."""
    N = len(parents)
    anc = torch.eye(N, dtype=torch.bool)  # (N, N)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    allowed = torch.cat([torch.ones(N, past, dtype=torch.bool, device=device), anc.to(device)], 1)  # (N, past+N)
    mask = torch.zeros(N, past + N, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@dataclass
class Tree:
    """Draft tree in topological order; node 0 is the root (the newest committed token)."""

    tokens: list[int]
    """Target ids of the nodes."""
    parents: list[int]
    """Parent index per node (-1 for the root); parents[i] < i."""
    depths: list[int]
    """Depth per node (root 0)."""
    children: list[list[tuple[int, int]]]
    """Per node, every drafted child in draw order as (target id, node index or -1 when not verified)."""
    q: list[torch.Tensor | None]
    """Per node, the draft-vocab distribution its children were drawn from (T > 0); None = deterministic drafts."""
    hot: torch.Tensor | None = None
    """Draft id -> target id (Vd,), to spread `q` over the target vocabulary."""

    @classmethod
    def chain(cls, root: int, draft: list[int]) -> "Tree":
        """A chain of deterministic draft tokens (n-gram lookup): q is a point mass."""
        n = len(draft) + 1
        toks = [root] + list(draft)
        kids = [[(toks[i + 1], i + 1)] for i in range(n - 1)] + [[]]
        return cls(toks, list(range(-1, n - 1)), list(range(n)), kids, [None] * n)


# --- drafting -------------------------------------------------------------------------------------------------------
def drafter_extend(drafter, dcache: DrafterCache, ids: list[int], aux: torch.Tensor, start: int) -> torch.Tensor:
    """Append pairs (embed(ids[j]), fc(aux[j])) at drafter positions start..start+T-1; returns the last h_out (1, 1, H).

    aux (T, K, H) are the target states of the positions before ids: SGLang's draft-extend."""
    dev = drafter.d2t.device
    hidden = drafter.project(aux.unsqueeze(0).to(dev))  # (1, T, H)
    pos = torch.arange(start, start + len(ids), device=dev)[None]  # (1, T)
    h = drafter(torch.tensor([ids], device=dev), hidden, pos, dcache)  # (1, T, H)
    return h[:, -1:]


@torch.no_grad()
def draft_tree(drafter, dcache: DrafterCache, h_last: torch.Tensor, root: int, root_pos: int, topk: int, depth: int,
               tokens: int, temperature: float = 0.0, gen=None) -> Tree:
    """Grow a draft tree of at most `depth` levels and `tokens` nodes (root included) from h_last (1, 1, H).

    `root_pos` is the root's sequence index (L-1). The drafter cache is returned to its length on entry."""
    dev = h_last.device
    committed = len(dcache)
    hot = torch.arange(drafter.d2t.shape[0], device=dev) + drafter.d2t  # (Vd,) draft id -> target id
    tok, par, dep, score = [], [], [], []  # candidates; parent -1 = the root
    drawn: dict[int, list[int]] = {-1: []}
    qd: dict[int, torch.Tensor] = {}
    rows: dict[int, torch.Tensor] = {-1: h_last[0, 0]}  # fed node -> its h_out (H,)
    fed: list[int] = []  # fed nodes in drafter-cache slot order
    sampling = temperature > 0

    def expand(parents: list[int], h: torch.Tensor) -> None:  # h (f, H): draw topk children of each parent
        logits = drafter.compute_logits(h).float()  # (f, Vd)
        if sampling:
            q = torch.softmax(logits / temperature, -1)  # (f, Vd)
            logq = q.log()
            u = torch.rand(q.shape, generator=gen, device=dev).clamp_min_(1e-20)
            vals, idx = (logq - (-u.log()).log()).topk(min(topk, q.shape[-1]), -1)  # Gumbel-top-k: (f, k)
            lq = logq.gather(-1, idx)
            ok = torch.isfinite(vals)  # q == 0: the draw without replacement has run out of support
        else:
            lq, idx = torch.log_softmax(logits, -1).topk(min(topk, logits.shape[-1]), -1)  # (f, k)
            ok = torch.ones_like(lq, dtype=torch.bool)
        for r, (p, ids, lps, oks) in enumerate(zip(parents, hot[idx].tolist(), lq.tolist(), ok.tolist())):
            if sampling:
                qd[p] = q[r]
            base = score[p] if p >= 0 else 0.0
            for t, lp, good in zip(ids, lps, oks):
                if good:
                    drawn[p].append(len(tok))
                    drawn[len(tok)] = []
                    dep.append(dep[p] + 1 if p >= 0 else 1)
                    tok.append(t)
                    par.append(p)
                    score.append(base + lp)

    def ancestors(c: int) -> set[int]:
        out = set()
        while c >= 0:
            out.add(c)
            c = par[c]
        return out

    expand([-1], h_last[0])
    level, slots = list(drawn[-1]), tokens - 1  # slots: budget left for expanded nodes (T > 0 rule)
    expanded: list[int] = []
    for d in range(1, depth):
        order = sorted(level, key=lambda c: (-score[c], c))
        f = min(topk, len(order), slots) if sampling else min(topk, len(order))
        if f == 0:
            break
        slots -= f if sampling else 0
        front = order[:f]
        ids = torch.tensor([[tok[c] for c in front]], device=dev)  # (1, f)
        hid = torch.stack([rows[par[c]] for c in front])[None]  # (1, f, H)
        pos = torch.full((1, f), root_pos - 1 + d, device=dev)
        mask = None  # a chain (topk=1) is causal over cache + fed nodes
        if topk > 1:
            mask = torch.zeros(f, committed + len(fed) + f, dtype=torch.bool)  # (f, S) True = may attend
            mask[:, :committed] = True
            for i, c in enumerate(front):
                anc = ancestors(c)
                mask[i, committed:committed + len(fed)] = torch.tensor([s in anc for s in fed], dtype=torch.bool)
                mask[i, committed + len(fed) + i] = True
            mask = mask.to(dev)
        h = drafter(ids, hid, pos, dcache, mask)  # (1, f, H)
        for i, c in enumerate(front):
            rows[c] = h[0, i]
        fed += front
        expanded += front
        expand(front, h[0])
        level = [ch for c in front for ch in drawn[c]]
    dcache.crop(committed)

    by_score = sorted(range(len(tok)), key=lambda c: (-score[c], c))  # parents first on ties: ancestor-closed
    if sampling:
        ex = set(expanded)
        keep = sorted(ex | set([c for c in by_score if c not in ex][:slots]))
    else:
        keep = sorted(by_score[:tokens - 1])
    index = {-1: 0, **{c: i + 1 for i, c in enumerate(keep)}}
    nodes = [-1] + keep
    return Tree(tokens=[root] + [tok[c] for c in keep], parents=[-1] + [index[par[c]] for c in keep],
                depths=[0] + [dep[c] for c in keep],
                children=[[(tok[ch], index.get(ch, -1)) for ch in drawn[c]] for c in nodes],
                q=[qd.get(c) for c in nodes], hot=hot)


# --- acceptance -----------------------------------------------------------------------------------------------------
def accept(tree: Tree, logits: torch.Tensor, temperature: float = 0.0, gen=None) -> tuple[list[int], int, int]:
    """logits (N, V) of the tree nodes -> (accepted path of node indices from the root, final token y, accepted drafts).

    The accepted draft count includes an accepted child outside the verified tree (then y is that child)."""
    if temperature == 0:
        am = logits.argmax(-1).tolist()
        path = [0]
        while True:
            node = path[-1]
            nxt = next((i for t, i in tree.children[node] if t == am[node] and i >= 0), None)
            if nxt is None:
                return path, am[node], len(path) - 1
            path.append(nxt)
    dev, path = logits.device, [0]
    while True:
        node = path[-1]
        p = torch.softmax(logits[node] / temperature, -1)  # (V,)
        q = None
        if tree.q[node] is not None:  # spread the draft distribution over the target vocabulary
            q = torch.zeros_like(p).index_copy_(0, tree.hot, tree.q[node].to(p.dtype))  # (V,)
        for t, i in tree.children[node]:
            qc = 1.0 if q is None else float(q[t])
            if qc <= 0:
                continue  # cannot happen for a real draw; skip rather than divide by zero
            if float(torch.rand((), generator=gen, device=dev)) * qc < float(p[t]):  # accept w.p. min(1, p/q)
                if i < 0:
                    return path, t, len(path)  # a valid sample of p that the verify forward did not cover
                path.append(i)
                break
            if q is None:  # point mass: max(0, p - q) is p without t
                r = p.clone()
                r[t] = 0
            else:
                r = (p - q).clamp_min_(0)
                q = q.clone()
                q[t] = 0
                q /= q.sum().clamp_min(1e-30)
            s = r.sum()
            p = r / s if s > 0 else p  # s == 0 only through rounding (p == q would have accepted)
        else:
            return path, int(torch.multinomial(p, 1, generator=gen)), len(path) - 1


# --- speculative decoding -------------------------------------------------------------------------------------------
@dataclass
class SpecState:
    """Decoding state between rounds (see the module docstring for the cache invariants)."""

    ids: list[int]
    """Committed tokens (prompt + generated); ids[-1] has not been through the target yet."""
    cache: object
    """Target KV cache with len(ids) - 1 entries."""
    dcache: DrafterCache
    """Drafter KV cache; len(ids) - 1 entries once `pending` is applied."""
    pending: tuple
    """(token ids, fc inputs (T, K, H), start position) still to extend the drafter with."""


def _check(target, drafter, mode: str, k: int, topk: int, depth: int, tokens: int, temperature: float, max_new: int,
           length: int):
    where = "speculate.py"
    if mode not in ("chain", "tree"):
        raise HstapError(f"{where}: mode: expected 'chain' or 'tree', got {mode!r}")
    for name, v, lo in (("k", k, 1), ("topk", topk, 1), ("depth", depth, 1), ("tokens", tokens, 2),
                        ("max_new_tokens", max_new, 1)):
        if v < lo:
            raise HstapError(f"{where}: {name}: must be >= {lo}, got {v}")
    if temperature < 0:
        raise HstapError(f"{where}: temperature: must be >= 0, got {temperature}")
    c = drafter.config
    if c.vocab_size != target.vocab_size:
        raise HstapError(f"{where}: drafter vocab_size {c.vocab_size} != target vocab_size {target.vocab_size}")
    fc = getattr(drafter, "fc", None)
    if fc is not None and fc.in_features != max(1, len(c.aux_layers)) * target.hidden_size:
        raise HstapError(f"{where}: drafter fc takes {fc.in_features} inputs, but aux_layers {list(c.aux_layers)} of a "
                         f"{target.hidden_size}-wide target give {max(1, len(c.aux_layers)) * target.hidden_size}")
    if c.aux_layers and max(c.aux_layers) >= target.num_layers:
        raise HstapError(f"{where}: drafter aux_layers {list(c.aux_layers)} out of range for a "
                         f"{target.num_layers}-layer target")
    if mode == "tree":
        impl = getattr(target.config, "_attn_implementation", None) or "sdpa"
        if impl not in ("sdpa", "eager"):
            raise HstapError(f"{where}: tree verification needs a 4-D mask: load the target with attn_implementation "
                             f"'sdpa' or 'eager' (got {impl!r})")
        window = getattr(target.config, "sliding_window", None)
        if window and length > window:  # the custom mask would not apply the window
            raise HstapError(f"{where}: tree mode: prompt + new tokens ({length}) exceed the sliding window ({window})")


def prefill(target, drafter, prompt: list[int], temperature: float = 0.0, gen=None) -> SpecState:
    """Run the prompt through the target and pick the first new token; the drafter extend is left pending."""
    layers = list(drafter.config.aux_layers)
    cache = new_cache()
    logits, aux = target_forward(target, torch.tensor([prompt], device=target.device), layers, cache)
    x = _choose(logits[-1], temperature, gen)
    return SpecState(ids=list(prompt) + [x], cache=cache, dcache=DrafterCache(), pending=(prompt[1:] + [x], aux, 0))


@torch.no_grad()
def spec_step(target, drafter, st: SpecState, topk: int, depth: int, tokens: int, temperature: float = 0.0,
              gen=None, clock: dict | None = None) -> dict:
    """One draft + verify round; appends the new tokens to st.ids and returns {"new", "accepted", "nodes", "moved"}."""
    dev = target.device
    t0 = _now(dev)
    h_last = drafter_extend(drafter, st.dcache, *st.pending)  # (1, 1, H) at position L-2
    L = len(st.ids)
    tree = draft_tree(drafter, st.dcache, h_last, st.ids[-1], L - 1, topk, depth, tokens, temperature, gen)
    t1 = _now(dev)
    chain = all(p == i - 1 for i, p in enumerate(tree.parents))
    pos = torch.tensor([[L - 1 + d for d in tree.depths]], device=dev)  # (1, N)
    mask = None if chain else tree_mask(tree.parents, L - 1, target.dtype, dev)  # (1, 1, N, L-1+N)
    logits, aux = target_forward(target, torch.tensor([tree.tokens], device=dev), list(drafter.config.aux_layers),
                                 st.cache, pos, mask)  # (N, V), (N, K, H)
    path, y, acc = accept(tree, logits, temperature, gen)
    moved = keep_slots(st.cache, L - 1, path)
    new = [tree.tokens[i] for i in path[1:]] + [y]
    st.pending = (new, aux[path], L - 1)  # pairs (x[t+1], aux[t]) for t = L-1 .. L-1+a
    st.ids += new
    t2 = _now(dev)
    if clock is not None:
        clock["draft_s"] = clock.get("draft_s", 0.0) + t1 - t0
        clock["verify_s"] = clock.get("verify_s", 0.0) + t2 - t1
    return {"new": new, "accepted": acc, "nodes": len(tree.tokens), "moved": moved}


def _finish(out: list[int], new: list[int], max_new: int, eos: set[int]) -> bool:
    """Append new tokens up to max_new and the first eos; True when generation is over."""
    for t in new:
        out.append(t)
        if t in eos or len(out) >= max_new:
            return True
    return False


def _acceptance(counts: list[int], steps: int) -> list[float]:
    return [c / steps if steps else 0.0 for c in counts]


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids, max_new_tokens: int = 256, mode: str = "chain", k: int = 5,
                         topk: int = 8, depth: int = 6, tokens: int = 60, temperature: float = 0.0, eos_ids=(),
                         generator=None) -> tuple[list[int], dict]:
    """Generate with draft + verify rounds. Chain: k draft tokens per round; tree: EAGLE-2 dynamic tree of `depth`
    levels, `topk` children per expanded node, `tokens` verified nodes including the root (SGLang's num-draft-tokens).

    stats: tau = tokens produced by verify forwards / verify forwards (the prefill's token is in neither; SGLang's
    accept length counts it in the numerator); per_position_acceptance[i] = fraction of rounds whose accepted draft
    reached depth i+1; draft_s (drafter extend + drafting) vs verify_s (target forward + acceptance + KV rollback)."""
    prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
    if not prompt:
        raise HstapError("speculate.py: prompt_ids: empty prompt")
    _check(target, drafter, mode, k, topk, depth, tokens, temperature, max_new_tokens,
           len(prompt) + max_new_tokens + tokens)
    if mode == "chain":
        topk, depth, tokens = 1, k, k + 1
    dev, eos = target.device, {int(e) for e in eos_ids}
    clock: dict = {"draft_s": 0.0, "verify_s": 0.0}
    t0 = _now(dev)
    st = prefill(target, drafter, prompt, temperature, generator)
    clock["prefill_s"] = _now(dev) - t0
    out: list[int] = []
    done = _finish(out, st.ids[-1:], max_new_tokens, eos)
    steps, nodes, moved, counts = 0, 0, 0, [0] * depth
    while not done:
        r = spec_step(target, drafter, st, topk, depth, tokens, temperature, generator, clock)
        steps, nodes, moved = steps + 1, nodes + r["nodes"], moved + r["moved"]
        for d in range(r["accepted"]):
            counts[d] += 1
        done = _finish(out, r["new"], max_new_tokens, eos)
    total = _now(dev) - t0
    stats = {"method": f"eagle-{mode}", "mode": mode, "k": k if mode == "chain" else None, "topk": topk, "depth": depth,
             "tokens": tokens, "temperature": temperature, "prompt_tokens": len(prompt), "new_tokens": len(out),
             "verify_forwards": steps, "verify_tokens": len(out) - 1, "tau": (len(out) - 1) / steps if steps else 0.0,
             "accept_counts": counts, "per_position_acceptance": _acceptance(counts, steps),
             "mean_tree_nodes": nodes / steps if steps else 0.0, "kv_moves": moved, **clock, "total_s": total,
             "tokens_per_s": len(out) / total if total > 0 else 0.0}
    return out, stats


# --- baselines ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def target_generate(target, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, eos_ids=(),
                    generator=None) -> tuple[list[int], dict]:
    """Plain autoregressive decoding with a KV cache (the baseline every speedup is measured against)."""
    prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
    if not prompt:
        raise HstapError("speculate.py: prompt_ids: empty prompt")
    dev, eos, cache = target.device, {int(e) for e in eos_ids}, new_cache()
    t0 = _now(dev)
    logits, _ = target_forward(target, torch.tensor([prompt], device=dev), [], cache)
    out: list[int] = []
    done = _finish(out, [_choose(logits[-1], temperature, generator)], max_new_tokens, eos)
    t1 = _now(dev)
    steps = 0
    while not done:
        logits, _ = target_forward(target, torch.tensor([[out[-1]]], device=dev), [], cache)
        steps += 1
        done = _finish(out, [_choose(logits[-1], temperature, generator)], max_new_tokens, eos)
    t2 = _now(dev)
    return out, {"method": "target", "temperature": temperature, "prompt_tokens": len(prompt), "new_tokens": len(out),
                 "verify_forwards": steps, "verify_tokens": len(out) - 1, "tau": 1.0 if steps else 0.0,
                 "prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0,
                 "tokens_per_s": len(out) / (t2 - t0) if t2 > t0 else 0.0}


def ngram_propose(ids: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: the k tokens after the latest earlier occurrence of the last n tokens (n = max_ngram..1)."""
    arr = np.asarray(ids, dtype=np.int64)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        win = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # (len-n, n): windows that have a next token
        hits = np.flatnonzero((win == arr[-n:]).all(1))
        if hits.size:
            i = int(hits[-1]) + n
            return arr[i:i + k].tolist()
    return []


@torch.no_grad()
def ngram_generate(target, prompt_ids, max_new_tokens: int = 256, k: int = 5, max_ngram: int = 3,
                   temperature: float = 0.0, eos_ids=(), generator=None) -> tuple[list[int], dict]:
    """Prompt-lookup decoding: propose the continuation of the last matching n-gram, verify in one forward.

    Drafts are deterministic (q = a point mass), so acceptance at T > 0 is min(1, p(d)/1) and the residual is p
    without d: lossless."""
    prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
    if not prompt:
        raise HstapError("speculate.py: prompt_ids: empty prompt")
    if k < 1 or max_ngram < 1:
        raise HstapError(f"speculate.py: k and max_ngram must be >= 1 (got {k}, {max_ngram})")
    dev, eos, cache = target.device, {int(e) for e in eos_ids}, new_cache()
    clock = {"draft_s": 0.0, "verify_s": 0.0}
    t0 = _now(dev)
    logits, _ = target_forward(target, torch.tensor([prompt], device=dev), [], cache)
    ids = prompt + [_choose(logits[-1], temperature, generator)]
    clock["prefill_s"] = _now(dev) - t0
    out: list[int] = []
    done = _finish(out, ids[-1:], max_new_tokens, eos)
    steps, counts = 0, [0] * k
    while not done:
        ta = time.perf_counter()  # host-only drafting; the device was synchronised at the end of the last round
        tree = Tree.chain(ids[-1], ngram_propose(ids, k, max_ngram))
        tb = time.perf_counter()
        L = len(ids)
        logits, _ = target_forward(target, torch.tensor([tree.tokens], device=dev), [], cache)
        path, y, acc = accept(tree, logits, temperature, generator)
        keep_slots(cache, L - 1, path)
        new = [tree.tokens[i] for i in path[1:]] + [y]
        ids += new
        clock["draft_s"] += tb - ta
        clock["verify_s"] += _now(dev) - tb
        steps += 1
        for d in range(acc):
            counts[d] += 1
        done = _finish(out, new, max_new_tokens, eos)
    total = _now(dev) - t0
    return out, {"method": "ngram", "k": k, "temperature": temperature, "prompt_tokens": len(prompt),
                 "new_tokens": len(out), "verify_forwards": steps, "verify_tokens": len(out) - 1,
                 "tau": (len(out) - 1) / steps if steps else 0.0, "accept_counts": counts,
                 "per_position_acceptance": _acceptance(counts, steps), **clock, "total_s": total,
                 "tokens_per_s": len(out) / total if total > 0 else 0.0}
