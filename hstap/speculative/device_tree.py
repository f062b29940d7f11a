"""EAGLE-2 drafting and lossless acceptance as fixed-shape tensor code: what `hstap.speculative.drivers` does with Python lists,
done on the device so a whole round can be captured in CUDA graphs and needs one host read at most.

Shapes (`TreeShape`): k = topk, D = depth levels, C = k + (D-1) k^2 candidates (level 1 has k, every later level the
k children of each of the k nodes expanded there), N = min(tokens, C+1) verified nodes (root included), F = (D-1) k
drafter slots written while drafting, P = min(D, N-1) + 1 the longest accepted path (root included). A chain of k
drafts is topk=1, depth=k, tokens=k+1, as in speculative/drivers.py.

The tree is speculate.draft_tree's at T = 0, candidate for candidate: candidates are numbered in creation order
(level by level, and within a level by the rank of the parent, then the child's rank); each level expands its best k
by cumulative log-prob with ties to the lower number (a stable descending sort, Python's sort by (-score, index));
the kept nodes are the best N-1 overall, ties again to the lower number, so a parent (never below its child's score,
and numbered first) is kept before its child: ancestor-closed. At T > 0 only the chain is built here (children are
Gumbel-top-1 draws from q, as speculative/drivers.py draws them); trees at T > 0 stay with the eager decoder.

No sort or torch.topk kernel runs at T = 0: the children are `top_k` of the logits (their log-probs: minus the
logsumexp, log_softmax's values up to rounding), the level fronts and kept nodes come from `ranks` (pairwise
comparisons), the accepted path from a cumulative sum. On the H200 torch.topk took ~30-44 us a call for the one or two
rows of a draft level, `top_k` 7-12 us (benchmarks/RESULTS.md, "Few-row products and top-k").

Acceptance at T = 0: node i is good when its token is the target's argmax at its parent; the accepted nodes are those
whose ancestors (itself included) are all good. Siblings carry distinct tokens (top-k of one distribution, mapped to
distinct target ids), so at most one child of a node is good, and the accepted nodes are one path from the root:
speculate.accept's walk. At T > 0 (chain): child i+1 is accepted with probability min(1, p(t)/q(t)); at the first
rejection y ~ norm(max(0, p - q)), after the last draft y ~ p (speculate.accept with one child per node). Random
numbers come in through `noise` (uniforms drawn outside the graph), so the graph holds no generator state.

Pending drafter pairs are kept right-aligned in P rows: the real ones are the last n rows (slots start-n..start-1),
the padding rows write to slot `start` (scratch: rewritten before it is read), so the extend's last row is always the
newest pair at a fixed index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hstap.speculative.static_kv import block_mask, causal_rows


@dataclass(frozen=True)
class TreeShape:
    topk: int
    depth: int
    tokens: int

    @property
    def C(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def N(self) -> int:
        return min(self.tokens, self.C + 1)

    @property
    def F(self) -> int:
        return max(1, (self.depth - 1) * self.topk)

    @property
    def P(self) -> int:
        return min(self.depth, self.N - 1) + 1

    @property
    def chain(self) -> bool:
        return self.topk == 1

    @property
    def margin(self) -> int:
        """Slots a round may write past the committed length."""
        return max(self.N, self.F, self.P) + 1


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Uniforms -> Gumbel(0, 1) noise (speculative/drivers.py's transform, with its clamp)."""
    return -(-u.clamp_min(1e-20).log()).log()


def _one_pass_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (f, V) -> (values, ids) (f, k): k max-with-index passes, each over x with the ids taken so far masked."""
    ar = torch.arange(x.shape[-1], device=x.device)  # (V,)
    vals, ids = [], []
    masked = x
    for j in range(k):
        v, i = masked.max(-1, keepdim=True)  # (f, 1): the first id of the largest value
        vals.append(v)
        ids.append(i)
        if j + 1 < k:
            masked = masked.masked_fill(ar == i, float("-inf"))  # (f, V)
    return torch.cat(vals, -1), torch.cat(ids, -1)


TOPK_CHUNK = 128  # ids per first-stage block of top_k


def top_k(x: torch.Tensor, k: int, chunk: int = TOPK_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (f, V), finite -> its k largest values per row and their ids (f, k), descending, ties to the lower id.

    Two stages over blocks of `chunk` ids (0: one stage): the top k of every block, then the top k of those (the k
    largest of a row are among its blocks' top k). Under torch.compile a stage is a few small reductions over many
    blocks in parallel, where one pass over a whole row runs in one thread block per row; torch.topk's radix select
    took 32-44 us a call on the H200 for the one or two rows of a draft level (benchmarks/bench_rows.py).
    Candidates stay in block order, so ties still go to the lower id."""
    f, V = x.shape
    c = chunk
    if not c or V % c or V < 4 * c or k > c:
        return _one_pass_top_k(x, k)
    B = V // c
    v, i = _one_pass_top_k(x.reshape(f * B, c), k)  # (f*B, k) each block's best, ids within the block
    i = i + (torch.arange(f * B, device=x.device) % B * c)[:, None]  # (f*B, k) ids in the row
    v, j = _one_pass_top_k(v.reshape(f, B * k), k)  # (f, k)
    return v, i.reshape(f, B * k).gather(-1, j)


def ranks(s: torch.Tensor) -> torch.Tensor:
    """s (m,), finite -> each element's place in a stable descending sort (m,): a permutation of 0..m-1, ties to the
    lower index. One small fused reduction over the m x m comparisons instead of a sort kernel."""
    ar = torch.arange(s.shape[0], device=s.device)  # (m,)
    ahead = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (ar[None, :] < ar[:, None]))  # (m, m): j before i
    return ahead.sum(-1)


def first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the first n True entries of mask (m,) bool, in order (n,); 0 where it has fewer."""
    ar = torch.arange(mask.shape[0], device=mask.device)  # (m,)
    at = mask.long().cumsum(0) - 1  # (m,) place of a True entry among the True ones
    return ((at[None, :] == torch.arange(n, device=mask.device)[:, None]) & mask[None, :]).long().mul(ar).sum(-1)


def best(s: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest of s (m,), finite, in descending order, ties to the lower index (a stable descending
    sort's first n)."""
    ar = torch.arange(s.shape[0], device=s.device)  # (m,)
    return ((ranks(s)[None, :] == torch.arange(n, device=s.device)[:, None]) * ar).sum(-1)  # (n,)


def _children(drafter, h: torch.Tensor, k: int, temperature: float, u: torch.Tensor | None):
    """h (f, H) -> top-k children per row: log-probs (f, k), draft ids (f, k), the distribution drawn from or None."""
    logits = drafter.compute_logits(h).float()  # (f, Vd)
    if temperature == 0:
        top, idx = top_k(logits, k)  # (f, k): the order of log_softmax(logits), computed on the logits
        return top - torch.logsumexp(logits, -1, keepdim=True), idx, None  # log-probs (f, k)
    q = torch.softmax(logits / temperature, -1)  # (f, Vd)
    logq = q.log()
    idx = (logq + gumbel(u)).topk(k, -1).indices  # Gumbel-top-k: draws without replacement, in order
    return logq.gather(-1, idx), idx, q


def extend(drafter, dcache, ids: torch.Tensor, aux: torch.Tensor, n: torch.Tensor, start: torch.Tensor,
           col: torch.Tensor) -> torch.Tensor:
    """Pending pairs (embed(ids[j]), fc(aux[j])), the last n of P rows real, at drafter slots start-n..start-1.

    ids (P,), aux (P, K, Ht); returns h_out of the newest pair (1, H), whose logits propose the next token."""
    P = ids.shape[0]
    j = torch.arange(P, device=ids.device)  # (P,)
    pos = (start - P + j).clamp_min(0)  # (P,) real rows: start-n .. start-1
    slots = torch.where(j >= P - n, pos, start)  # padding rows write the scratch slot `start`
    hidden = drafter.project(aux[None])  # (1, P, H)
    h = drafter(ids[None], hidden, pos[None], dcache.at(slots), causal_rows(col, pos))  # (1, P, H)
    return h[0, P - 1:]  # (1, H)


@torch.no_grad()
def draft(drafter, dcache, h_last: torch.Tensor, root: torch.Tensor, start: torch.Tensor, col: torch.Tensor,
          shape: TreeShape, hot: torch.Tensor, temperature: float = 0.0, u: torch.Tensor | None = None) -> dict:
    """Grow the tree from h_last (1, H) rooted at token `root` (0-d) at sequence index `start`.

    Returns {"tok" (N,), "depth" (N,), "parent" (N,) (the root is its own parent), "anc" (N, N) bool (row i: node i
    and its ancestors), "q" (N-1, Vd) the draft distribution each node's children were drawn from (T > 0) or None}.
    u (D, Vd): uniforms for the Gumbel draws at T > 0 (row d for level d+1)."""
    k, D, Fs = shape.topk, shape.depth, shape.F
    dev = h_last.device
    rk, fslot = torch.arange(k, device=dev), torch.arange(Fs, device=dev)  # (k,), (F,)
    lp, idx, q = _children(drafter, h_last, k, temperature, None if u is None else u[:1])  # (1, k)
    toks, scores, pars, deps, qs = [hot[idx[0]]], [lp[0]], [torch.full((k,), -1, device=dev)], \
        [torch.ones(k, dtype=torch.long, device=dev)], [q]
    hid = h_last.expand(k, -1)  # (k, H): the root's h_out feeds every level-1 node
    anc = h = None
    base = 0
    for d in range(1, D):
        sc = scores[-1]  # (m,) this level's candidates, numbered base..base+m-1
        order = rk if shape.chain else best(sc, k)  # (k,) best k, ties to the lower number (a chain level: 1 node)
        own = fslot[None, :] == ((d - 1) * k + rk)[:, None]  # (k, F) each front node's own drafter slot
        if d == 1:
            anc = own
        else:
            prank = order // k  # (k,) rank of each front node's parent in the previous front
            hid, anc = h.index_select(0, prank), anc.index_select(0, prank) | own  # (k, H), (k, F)
        pos = (start - 1 + d).expand(k)  # (k,) the drafter's rotary position grows with depth
        slots = start + (d - 1) * k + rk  # (k,)
        h = drafter(toks[-1].index_select(0, order)[None], hid[None], pos[None], dcache.at(slots),
                    block_mask(col, start, anc))[0]  # (k, H)
        lp, idx, q = _children(drafter, h, k, temperature, None if u is None else u[d:d + 1])  # (k, k)
        toks.append(hot[idx].flatten())
        scores.append((sc.index_select(0, order)[:, None] + lp).flatten())  # (k*k,) cumulative log-probs
        pars.append((base + order)[:, None].expand(k, k).reshape(-1))  # (k*k,) (no repeat_interleave: it may sync)
        deps.append(torch.full((k * k,), d + 1, dtype=torch.long, device=dev))
        qs.append(q)
        base += sc.shape[0]
    return _select(shape, root, torch.cat(toks), torch.cat(scores), torch.cat(pars), torch.cat(deps),
                   torch.cat(qs) if temperature > 0 else None)


@torch.no_grad()
def draft_chain(drafter, dcache, h_last: torch.Tensor, root: torch.Tensor, start: torch.Tensor, col: torch.Tensor,
                depth: int, hot: torch.Tensor) -> torch.Tensor:
    """A greedy chain (T = 0) of `depth` drafts from h_last (1, H): draft()'s chain with argmax alone (no scores, no
    log-softmax, no top-k: a chain keeps every draft) and its mask as a plain causal row. Returns tok (depth+1,),
    the root first; the chain's depth/parent/ancestor arrays are constants (spec_buffers).

    Level d+1 (d = 0..depth-2) writes drafter slot start+d at rotary position start+d and sees the committed slots
    and the chain's own slots start..start+d, as draft() does with one node per level."""
    toks = []
    h = h_last  # (1, H)
    for d in range(depth):
        t = hot.index_select(0, drafter.compute_logits(h).argmax(-1))  # (1,) target id of the level-(d+1) draft
        toks.append(t)
        if d + 1 < depth:
            slot = (start + d).view(1)  # (1,)
            h = drafter(t[None], h[None], slot[None], dcache.at(slot), causal_rows(col, slot))[0]  # (1, H)
    return torch.cat([root.view(1)] + toks)  # (depth+1,)


def _select(shape: TreeShape, root, tok, score, par, dep, q) -> dict:
    """Keep the best N-1 candidates (C,) by score, in number order, and build the node arrays and ancestor matrix."""
    N, dev = shape.N, tok.device
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    if shape.chain:  # every candidate is kept, each the child of the one before
        ar = torch.arange(N, device=dev)
        return {"tok": torch.cat([root.view(1), tok]), "parent": (ar - 1).clamp_min(0), "q": q,
                "anc": torch.ones(N, N, dtype=torch.bool, device=dev).tril(), "depth": ar}
    kept = ranks(score) < N - 1  # (C,) the best N-1, ties to the lower number
    keep = first_true(kept, N - 1)  # (N-1,) their numbers, in number order
    node = kept.long().cumsum(0)  # (C,) node index of a kept candidate: the kept ones up to it (the root is node 0)
    inv = torch.cat([zero, torch.where(kept, node, 0)])  # (C+1,) candidate number + 1 -> node index (root's -1 -> 0)
    parent = torch.cat([zero, inv.index_select(0, par.index_select(0, keep) + 1)])  # (N,)
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    anc = eye
    for _ in range(shape.depth):  # row i |= row of its parent, depth times: every ancestor is reached
        anc = eye | anc.index_select(0, parent)  # (N, N)
    return {"tok": torch.cat([root.view(1), tok.index_select(0, keep)]), "parent": parent, "anc": anc,
            "depth": torch.cat([zero, dep.index_select(0, keep)]), "q": q}


# --- acceptance -------------------------------------------------------------------------------------------------------
def accept_greedy(logits: torch.Tensor, tok: torch.Tensor, parent: torch.Tensor, anc: torch.Tensor, P: int,
                  valid: torch.Tensor | None = None):
    """logits (N, V) -> (accepted drafts a (), path (P,) node indices from the root (valid up to a), final token y ()).

    valid (N,) bool, optional: nodes that may be accepted (n-gram chains shorter than the buffer)."""
    N = tok.shape[0]
    ar = torch.arange(N, device=tok.device)  # (N,)
    am = logits.argmax(-1)  # (N,)
    good = (tok == am.index_select(0, parent)) | (ar == 0)  # (N,)
    if valid is not None:
        good = good & valid
    onpath = ~(anc & ~good[None]).any(-1)  # (N,) every ancestor good
    a = onpath.sum() - 1
    path = first_true(onpath, P)  # (P,) nodes are numbered parents first: number order is depth order; then roots
    y = am.index_select(0, path.index_select(0, a.view(1)))[0]
    return a, path, y


def accept_sampled_chain(logits: torch.Tensor, tok: torch.Tensor, q: torch.Tensor, n_valid: torch.Tensor,
                         temperature: float, u: torch.Tensor, g: torch.Tensor):
    """Chain rejection sampling. logits (N, V); tok (N,) (tok[i+1] was drawn at node i); q (N-1, V) the target-vocab
    distributions the drafts were drawn from; n_valid () drafts present; u (N-1,) uniforms, g (V,) Gumbel noise.

    Returns (a (), path = arange (N,), y ())."""
    N = tok.shape[0]
    ar = torch.arange(N, device=tok.device)  # (N,)
    p = torch.softmax(logits / temperature, -1)  # (N, V)
    t = tok[1:, None]  # (N-1, 1)
    pt, qt = p[:-1].gather(1, t)[:, 0], q.gather(1, t)[:, 0]  # (N-1,)
    ok = (u * qt < pt) & (qt > 0) & (ar[:-1] < n_valid)  # accept w.p. min(1, p/q)
    a = ok.long().cumprod(0).sum()  # leading accepts
    pa = p.index_select(0, a.view(1))[0]  # (V,)
    qa = torch.cat([q, torch.zeros_like(q[:1])]).index_select(0, a.view(1))[0]  # (V,) zero past the last draft
    r = (pa - qa).clamp_min(0)  # residual after a rejection
    qta = torch.cat([qt, qt.new_zeros(1)]).index_select(0, a.view(1))[0]
    use_r = (a < n_valid) & (qta > 0) & (r.sum() > 0)  # q(t) == 0 or rounding: speculative/drivers.py samples p itself
    dist = torch.where(use_r, r, pa)  # (V,)
    y = (dist.log() + g).argmax()  # Gumbel-max: a sample of dist / sum(dist)
    return a, ar, y


def next_pending(tok: torch.Tensor, path: torch.Tensor, a: torch.Tensor, y: torch.Tensor, aux: torch.Tensor):
    """The next round's right-aligned pending pairs: rows P-1-a..P-1 hold (x[t+1], aux[t]) for the accepted path.

    Returns ids (P,) and aux (P, K, H); ids[P-1-a:] are the new tokens (accepted drafts, then y)."""
    P = path.shape[0]
    m = (torch.arange(P, device=tok.device) - (P - 1) + a).clamp_min(0)  # (P,) offset along the path
    nxt = tok.index_select(0, path.index_select(0, (m + 1).clamp_max(P - 1)))  # (P,)
    ids = torch.where(m < a, nxt, y)
    return ids, aux.index_select(0, path.index_select(0, m))  # (P,), (P, K, H)
