"""Training on the rows of drafts the target rejected (a store's side branches, `hstap.store.side`): each branch becomes
one more training sequence of its batch, the sequence the target saw in that verify step.

Why this objective. A verify step feeds the target the served drafter's own chain d1..dK after the accepted prefix; the
rows past the accepted prefix hold the target's states, and (through its lm_head) its distribution, at contexts the
drafter itself produced. EAGLE-3's training-time test (TTT, `hstap.train.ttt`) already feeds the drafter its own
hidden states, but always the accepted text's tokens (teacher forcing); on-policy distillation (DistillSpec; Draft-OPD)
trains on the drafter's own proposals scored by the target instead. A branch sequence is exactly that for one verify
step: the accepted prefix (the last `context` tokens of it) followed by the rejected drafts, with their kept target
states. TTT over it is then, at the step's anchor, the drafter's own rollout replayed (its tokens, its hidden states)
against the target's distribution at every rejected draft, and at the later anchors the same continuation teacher
forced. Only predictions whose target is a rejected row's distribution are counted (the accepted prefix is the
sample's own training), with the run's per-row objective (`--loss`, the same as on the accepted text: DistillSpec
found the data being on-policy mattering more than the divergence, and the greedy acceptance test rewards the argmax,
which the cross-entropy and hard terms train) and TTT's step decay as the discount along a draft chain.

What it is not: the drafter never gets to draft past a rejection when it serves greedily (the chain is cut there), so
rows past the first rejected draft teach contexts that serving itself discards; their value is the drafter's
robustness to its own mistakes (the exposure bias TTT addresses), not the acceptance at those positions. The
truncated context (`context` tokens before the branch) is an approximation: the drafter's attention sees that window,
not the whole prefix, in a branch sequence.
"""

from __future__ import annotations

import torch

from hstap.batching import collate


def branches(side: dict) -> list[list[int]]:
    """The chains of a sample's side rows: lists of row indices, each starting at a row whose parent is a position of
    the sample, in row order."""
    parent = side["parent"].tolist()
    child: dict[int, int] = {-1 - p: r for r, p in enumerate(parent) if p < 0}
    out = []
    for r, p in enumerate(parent):
        if p >= 0:
            chain = [r]
            while chain[-1] in child:
                chain.append(child[chain[-1]])
            out.append(chain)
    return out


def branch_samples(x: dict, max_branches: int, context: int) -> list[dict]:
    """Sample x's side branches as training sequences (at most `max_branches`, evenly spread over the sample): the
    `context` tokens of the accepted sequence before a branch, its rows, and one padding row (the last row's target is
    read at the position before it); loss_mask 1 on the positions after the branch's first row, so that exactly the
    rejected rows' distributions are targets. [] without side rows."""
    side = x.get("side")
    if side is None or max_branches <= 0 or side["input_ids"].numel() == 0:
        return []
    chains = branches(side)
    if len(chains) > max_branches:
        chains = [chains[round(i * (len(chains) - 1) / max(1, max_branches - 1))] for i in range(max_branches)]
    out = []
    for j, rows in enumerate(chains):
        r = torch.tensor(rows)  # (m,)
        s0 = int(side["pos"][rows[0]])
        a = max(0, s0 - context)
        aux, final = x["aux"], x["final"]  # (T, K, H), (T, H)
        ids = torch.cat([x["input_ids"][a:s0], side["input_ids"][r], torch.zeros(1, dtype=torch.long)])  # (n,)
        mask = torch.zeros_like(ids)
        mask[s0 - a + 1:] = 1  # targets: the distributions at the branch's rows
        out.append({"id": f"{x['id']}#side{j}", "input_ids": ids, "loss_mask": mask,
                    "aux": torch.cat([aux[a:s0], side["aux"][r].to(aux.dtype), aux.new_zeros(1, *aux.shape[1:])]),
                    "final": torch.cat([final[a:s0], side["final"][r].to(final.dtype),
                                        final.new_zeros(1, final.shape[1])])})
    return out


class SideCollate:
    """The training batches' collate: the samples, then their side branches as more rows of the batch (`branch_samples`);
    `max_branches` 0: plain `collate`. Picklable (DataLoader workers)."""

    def __init__(self, max_branches: int, context: int):
        self.max_branches, self.context = max_branches, context

    def __call__(self, samples: list[dict]) -> dict:
        extra = [b for x in samples for b in branch_samples(x, self.max_branches, self.context)]
        return collate(samples + extra)
