"""The one Llama-family layer forward (hstap.models.lean_target.LeanTarget.states) and its cache seam: over
transformers' own DynamicCache (Cache.update is the same protocol), over the fast decoder's static slots and over the
continuous engine's per-row slots it computes the model's states, prefill and decode alike; the rotary tables are
the model's own rotary module's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.speculate import load_tiny_target
from transformers import DynamicCache

from hstap.models.lean_target import LeanTarget, StaticSlots
from hstap.models.rotary import RotaryTables
from hstap.models.slots import SlotTarget
from hstap.speculative.static_kv import seek, target_cache


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tiny_tokenizer, tmp_path_factory):
    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp(f"lean-{request.param}")
    build_random_target(d, tiny_tokenizer[0], model_type=request.param, num_layers=3, hidden_size=64)
    return load_tiny_target(d)[0]


def _causal(pos: torch.Tensor, S: int) -> torch.Tensor:
    """pos (B, T) -> (B, 1, T, S) bool: token t sees slots 0..pos[t]."""
    return (torch.arange(S)[None, None, :] <= pos[:, :, None])[:, None]


def test_rotary_tables_are_the_models_own(target):
    tables = RotaryTables(target.base.rotary_emb, 32, torch.float32, "cpu")
    pos = torch.tensor([[0, 5, 31], [2, 2, 7]])
    cos, sin = target.base.rotary_emb(torch.zeros(1), pos)  # (B, T, hd)
    got_cos, got_sin = tables.at(pos)  # (B, 1, T, hd)
    assert torch.equal(got_cos[:, 0], cos) and torch.equal(got_sin[:, 0], sin)


@torch.no_grad()
def test_one_forward_over_three_caches_equals_the_model(target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, target.vocab_size, (1, 9), generator=g)  # a 7-token prompt, then two decode steps
    ref_aux, ref_final, _ = target.capture(ids, [1])  # (1, 9, 1, H), (1, 9, H)
    lt = LeanTarget(target, 16, product=F.linear)

    def run(cache, S: int | None = None):
        """Prefill 7 tokens, then decode 2 one at a time -> final states (1, 9, H), layer-1 states (1, 9, H)."""
        finals, taps = [], []
        for a, b in ((0, 7), (7, 8), (8, 9)):
            pos = torch.arange(a, b)[None]  # (1, T)
            final, (tap,) = lt.states(ids[:, a:b], pos, cache(a, b - a), _causal(pos, S or b), [1])
            finals.append(final)
            taps.append(tap)
        return torch.cat(finals, 1), torch.cat(taps, 1)

    dynamic = DynamicCache()  # transformers' own cache: keys grow by concatenation, attention over all of them
    static = target_cache(target, 16)

    def at_start(start, T):
        seek(static, start)
        return StaticSlots(static, T, "cpu")

    for cache, S in ((lambda a, T: dynamic, None), (at_start, 16)):
        final, tap = run(cache, S)
        torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tap, ref_aux[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static.layers[0].keys[:, :, :9], dynamic.layers[0].keys, atol=1e-6, rtol=1e-6)

    rows = SlotTarget(target, rows=2, max_len=15, layers=[1])  # the prompt in row 1, row 0 idle at the scratch slot
    pos = torch.stack([torch.full((7,), 15), torch.arange(7)])  # (2, 7)
    final = rows.forward(torch.cat([ids[:, :7], ids[:, :7]]), pos, None, 16)  # (2, 7, H)
    for t in (7, 8):
        step = rows.forward(ids[:, t:t + 1].expand(2, 1), torch.tensor([[15], [t]]), torch.tensor([0, 1]), 16)
        final = torch.cat([final, step], 1)
    torch.testing.assert_close(final[1:], ref_final, atol=1e-5, rtol=1e-5)
    aux, fin = rows.row_states(1, 9)  # (9, 1, H), (9, H): what the engine stored for capture
    torch.testing.assert_close(aux[:, 0], ref_aux[0, :, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(fin, final[1])
