"""Draft trees: the verify mask is exact tree attention (real tiny model), EAGLE-2's choice of nodes and the drafter's
view of the tree (stub drafter whose output depends on the context it sees), chains."""

from __future__ import annotations

import pytest
import torch

from hstap.models.drafter import DrafterCache
from hstap.speculative.draft_tree import Tree, draft_tree, tree_mask
from hstap.speculative.drivers import drafter_extend, new_cache, target_forward
from helpers.speculate import StubDrafter, random_prompts


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tree_forward_equals_per_path_forwards(tiny, impl):
    tiny.model.set_attn_implementation(impl)
    assert tiny.config._attn_implementation == impl  # the kernel that receives our 4-D float mask
    try:
        prompt = random_prompts(tiny.vocab_size, 1, 9, seed=1)[0]
        parents = [-1, 0, 0, 1, 1, 2, 4, 3]  # branching at several depths; node 0 is the last committed token
        depths = [0, 1, 1, 2, 2, 2, 3, 3]
        toks = torch.randint(6, tiny.vocab_size, (len(parents),), generator=torch.Generator().manual_seed(2)).tolist()
        cache = new_cache()
        target_forward(tiny, torch.tensor([prompt]), [], cache)
        P = len(prompt)
        pos = torch.tensor([[P + d for d in depths]])
        logits, aux = target_forward(tiny, torch.tensor([toks]), [1, 3], cache, pos,
                                     tree_mask(parents, P, tiny.dtype, tiny.device))
        assert cache.get_seq_length() == P + len(toks)
        for i in range(len(toks)):
            path, j = [], i
            while j >= 0:
                path.insert(0, toks[j])
                j = parents[j]
            ref_logits, ref_aux = target_forward(tiny, torch.tensor([prompt + path]), [1, 3], new_cache())
            torch.testing.assert_close(logits[i], ref_logits[-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(aux[i], ref_aux[-1], atol=1e-4, rtol=1e-4)
    finally:
        tiny.model.set_attn_implementation("sdpa")


def test_eagle2_tree_keeps_the_best_nodes_ancestor_closed():
    V = 8

    def fn(ctx):  # first choice last + 1 (logit 5), second choice last + 2 (logit 4)
        x = torch.zeros(V)
        x[(ctx[-1] + 1) % V], x[(ctx[-1] + 2) % V] = 5.0, 4.0
        return x

    drafter, dcache = StubDrafter(fn, V), DrafterCache()
    ids = [3, 4, 5, 6]  # committed; the root 6 has not been through the target
    h_last = drafter_extend(drafter, dcache, ids[1:], torch.zeros(3, 1, V), 0)  # drafter positions 0..2
    tree = draft_tree(drafter, dcache, h_last, ids[-1], len(ids) - 1, topk=2, depth=3, tokens=7)
    # Cumulative log-probs keep A, B, AA, AB, BA, AAA (AB before BA on the tie, as drawn); AA and AB were expanded
    # (top-2 of level 2), so BB, AAB and AB's children are drawn but not verified (-1).
    assert tree.tokens == [6, 7, 0, 0, 1, 1, 1]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3] and tree.depths == [0, 1, 1, 2, 2, 2, 3]
    assert tree.children == [[(7, 1), (0, 2)], [(0, 3), (1, 4)], [(1, 5), (2, -1)], [(1, 6), (2, -1)],
                             [(2, -1), (3, -1)], [], []]
    assert tree.q == [None] * 7 and len(dcache) == 3  # greedy drafts; the drafter cache is back to its length


def test_chain():
    t = Tree.chain(9, [4, 5])
    assert t.tokens == [9, 4, 5] and t.parents == [-1, 0, 1] and t.depths == [0, 1, 2]
    assert t.children == [[(4, 1)], [(5, 2)], []] and t.q == [None] * 3
