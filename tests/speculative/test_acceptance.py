"""The acceptance rule on hand-built trees: the greedy walk, and rule (a) at T > 0 (an accepted child outside the
verified tree ends the round). The output law over whole generations is tested in tests/speculative/test_drivers.py."""

from __future__ import annotations

import torch

from hstap.speculative.acceptance import accept
from hstap.speculative.draft_tree import Tree

V = 8


def _rows(*best: int) -> torch.Tensor:
    """Logits (N, V) that put all the probability on one token per node."""
    x = torch.full((len(best), V), -torch.inf)
    x[torch.arange(len(best)), torch.tensor(best)] = 0.0
    return x


def test_greedy_walk_follows_verified_children_only():
    # root -> 5 (node 1), 6 (node 2); node 2 -> 7 (node 3) and 4 (drawn, not verified)
    tree = Tree(tokens=[1, 5, 6, 7], parents=[-1, 0, 0, 2], depths=[0, 1, 1, 2],
                children=[[(5, 1), (6, 2)], [], [(7, 3), (4, -1)], []], q=[None] * 4)
    assert accept(tree, _rows(6, 0, 4, 0)) == ([0, 2], 4, 1)  # y is the argmax where the walk stops
    assert accept(tree, _rows(6, 0, 7, 3)) == ([0, 2, 3], 3, 2)


def test_sampled_child_outside_the_tree_is_the_last_token():
    tree = Tree(tokens=[1], parents=[-1], depths=[0], children=[[(3, -1)]], q=[None])
    gen = torch.Generator().manual_seed(0)
    assert accept(tree, _rows(3), temperature=1.0, gen=gen) == ([0], 3, 1)  # p(3) = 1: accepted, emitted
    assert accept(tree, _rows(2), temperature=1.0, gen=gen) == ([0], 2, 0)  # p(3) = 0: rejected, y ~ p without 3
