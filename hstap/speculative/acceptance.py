"""The acceptance rule of speculative decoding: which nodes of a verified draft tree the target accepts, and the one
more token every round emits. Lossless at any temperature, for trees, chains and deterministic (n-gram) drafts.

Temperature 0: walk from the root while the target's argmax is a verified child; y = the argmax where the walk stops.
Lossless for any tree.

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
      the end goes to the best unexpanded nodes, which have no children (`hstap.speculative.draft_tree.draft_tree`).
So the set of children of any node we continue from, and which of them are verified, never depends on those children
themselves. Deterministic drafts (n-gram lookup) have q = a point mass: acceptance is min(1, p(d)/1) and the residual
is p without d. tests/speculative/test_drivers.py checks the output law with a chi-square test (chain, tree, n-gram).
"""

from __future__ import annotations

import torch

from hstap.speculative.draft_tree import Tree


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
