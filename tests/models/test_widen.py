"""hstap.models.widen on a tiny random Llama, fp32, CPU: the widened target computes the same function (logits, greedy
tokens, the tapped states zero-padded), and the widened drafter drafts the same tokens with the same acceptance."""

from __future__ import annotations


import pytest
import torch

from hstap.common import HstapError
from hstap.models.target import Target
from hstap.models.widen import Shape, check_widening, layer_positions, widen_drafter, widen_target
from hstap.speculative.drivers import speculative_generate, target_generate
from tests._speculate_fixtures import load_tiny_target, random_drafter, random_prompts

WIDE = Shape(hidden=128, layers=10, heads=8, kv_heads=4, head_dim=32, intermediate=256)  # 2x width, 2x head_dim
AUX, WIDE_AUX = [1, 2, 3], [1, 4, 6]  # WIDE_AUX = [1, N'/2-1, N'-4]: EAGLE-3's default taps of a 10-layer target


@pytest.fixture(scope="module")
def pair(tiny_llama):
    from transformers import AutoModelForCausalLM

    target, _ = load_tiny_target(tiny_llama)
    state, fields = widen_target(target.model.state_dict(), target.config, WIDE, AUX, WIDE_AUX)
    cfg = target.config.__class__(**{**target.config.to_dict(), **fields})
    wide = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = wide.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return target, Target(wide)


def test_same_logits_greedy_tokens_and_states(pair):
    target, wide = pair
    assert wide.num_layers == 10 and wide.hidden_size == 128
    ids = torch.tensor(random_prompts(target.vocab_size, 2, 24, seed=1))  # (B, T)
    with torch.no_grad():
        a, b = target.model(ids, output_hidden_states=True), wide.model(ids, output_hidden_states=True)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-4)
    for i, j in zip(AUX, WIDE_AUX):  # output of original layer i == output of wide layer j, zero-padded
        x, y = a.hidden_states[i + 1], b.hidden_states[j + 1]  # (B, T, H), (B, T, H')
        torch.testing.assert_close(y[..., :64], x, rtol=1e-5, atol=1e-5)
        assert not y[..., 64:].any()
    for p in random_prompts(target.vocab_size, 3, 12, seed=2):
        assert target_generate(wide, p, 24)[0] == target_generate(target, p, 24)[0]


def test_widened_drafter_drafts_the_same(pair):
    from hstap.models.drafter import Eagle3Drafter

    target, wide = pair
    d = random_drafter(target, AUX, draft_vocab=300, seed=4)
    state, cfg = widen_drafter(d.state_dict(), d.config, WIDE, WIDE_AUX)
    dw = Eagle3Drafter(cfg).eval()
    missing, unexpected = dw.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("rotary.") for k in missing), (missing, unexpected)
    assert cfg.aux_layers == WIDE_AUX and cfg.target_hidden_size == 128
    for p in random_prompts(target.vocab_size, 3, 16, seed=5):
        (out_a, sa), (out_b, sb) = (speculative_generate(t, dr, p, 24, "chain", 3) for t, dr in ((target, d), (wide, dw)))
        assert out_b == out_a and sb["accept_counts"] == sa["accept_counts"]
        assert out_a == target_generate(target, p, 24)[0]  # lossless, both ways


def test_refusals_and_layer_positions():
    assert layer_positions(8, 32, [1, 3, 4], [1, 15, 28]) == [0, 1, 2, 15, 28, 29, 30, 31]
    src = Shape(384, 8, 6, 2, 64, 1024)
    check_widening(src, Shape(4096, 32, 32, 8, 128, 14336))
    with pytest.raises(HstapError, match="head_dim 96 is not a multiple of 64"):
        check_widening(src, Shape(4096, 32, 32, 8, 96, 14336))
    with pytest.raises(HstapError, match="query heads per kv head must not shrink"):
        check_widening(src, Shape(4096, 32, 16, 8, 128, 14336))
    with pytest.raises(HstapError, match="rope_type 'yarn'"):
        check_widening(src, Shape(4096, 32, 32, 8, 128, 14336), "yarn")
