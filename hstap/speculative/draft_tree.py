"""Draft trees for speculative decoding: the tree a round verifies, how an EAGLE-3 drafter grows it (EAGLE-2's dynamic
tree; a chain is the topk=1 case) and the attention mask that verifies all of it in one target forward.

Growing (step 2 of a round, see `hstap.speculative.drivers`): the tree is rooted at x[L-1], the newest committed token. Level-1
children come from h_last, the drafter's output at position L-2; a level-d node (sequence index L-1+d) is fed to the
drafter at position L-2+d with its parent's h_out as hidden, attending to the drafter cache plus its ancestors. The
drafter's rotary position grows with depth, as in SGLang/EAGLE decoding. A chain of k tokens is the tree with topk=1,
depth=k, tokens=k+1 (its masks are plain causal ones, so none is built). The drafter cache is cut back to its length on
entry right after drafting: its draft-step entries were made from its own h_out, not the target's.

Which nodes are kept. At T = 0 the tree is EAGLE-2's: expand the top-k nodes of each level by cumulative log-prob, then
keep the best `tokens`-1 nodes overall (ancestor-closed: a child never scores above its parent, ties go to the parent).
At T > 0 each expanded node's children are drawn from q = softmax(drafter / T) without replacement, by Gumbel-top-k
(the top-k of log q + Gumbel noise, in order, is exactly sequential sampling without replacement), and pruning follows
rule (b) of `hstap.speculative.acceptance`: a node is expanded only if it will be verified, decided before its children are drawn
(per level the best min(topk, budget left) nodes by cumulative log q; the budget left at the end goes to the best
unexpanded nodes, which have no children). Every drawn child is recorded, verified or not, for rule (a).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hstap.models.drafter import DrafterCache


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
    def chain(cls, root: int, draft: list[int]) -> Tree:
        """A chain of deterministic draft tokens (n-gram lookup): q is a point mass."""
        n = len(draft) + 1
        toks = [root] + list(draft)
        kids = [[(toks[i + 1], i + 1)] for i in range(n - 1)] + [[]]
        return cls(toks, list(range(-1, n - 1)), list(range(n)), kids, [None] * n)


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


def tree_mask(parents: list[int], past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The verify forward's additive mask (1, 1, N, past+N): every node sees the whole cache, itself and its ancestors;
    parents[i] < i. Float, not bool: the eager kernel would add a bool mask as 0/1."""
    N = len(parents)
    anc = torch.eye(N, dtype=torch.bool)  # (N, N)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    allowed = torch.cat([torch.ones(N, past, dtype=torch.bool, device=device), anc.to(device)], 1)  # (N, past+N)
    mask = torch.zeros(N, past + N, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
