"""The drafter model: alignment of tokens, aux states and positions; the decoding cache; its config derived from a
target's (RoPE fields, the MLA family's plain GQA layer, the fc slot count)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.drafter import V, tiny_setup
from transformers import LlamaConfig

from hstap.common import HstapError
from hstap.models.drafter import DrafterCache, DrafterConfig, parse_rope


def test_alignment_position_t_sees_next_token_and_own_aux():
    """Step 0 at t depends on x[t+1] and aux[t] (and earlier), never on later ones: perturb x[5] / aux[5]."""
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup()
    pos = torch.arange(10)[None].expand(2, 10)
    with torch.no_grad():
        ref = d(F.pad(ids[:, 1:], (0, 1)), d.project(aux), pos)  # (B, T, H)
        ids2 = ids.clone()
        ids2[:, 5] = (ids2[:, 5] + 1) % V
        out = d(F.pad(ids2[:, 1:], (0, 1)), d.project(aux), pos)
        assert torch.equal(out[:, :4], ref[:, :4]) and not torch.allclose(out[:, 4], ref[:, 4])  # x[5] enters at t=4
        aux2 = aux.clone()
        aux2[:, 5] += 1
        out = d(F.pad(ids[:, 1:], (0, 1)), d.project(aux2), pos)
        assert torch.equal(out[:, :5], ref[:, :5]) and not torch.allclose(out[:, 5], ref[:, 5])  # aux[5] enters at t=5


def test_decoding_cache_equals_full_forward():
    """Token-by-token decoding with DrafterCache (causal over cache + new) equals one causal pass; crop rolls back."""
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=4)
    ids, hid = ids[:1], d.project(aux[:1])
    pos = torch.arange(10)[None]
    with torch.no_grad():
        full = d(ids, hid, pos)
        cache = DrafterCache()
        first = d(ids[:, :6], hid[:, :6], pos[:, :6], cache)
        steps = [d(ids[:, t:t + 1], hid[:, t:t + 1], pos[:, t:t + 1], cache) for t in range(6, 10)]
        torch.testing.assert_close(torch.cat([first] + steps, 1), full, rtol=1e-5, atol=1e-5)
        cache.crop(8)
        assert len(cache) == 8
        torch.testing.assert_close(d(ids[:, 8:], hid[:, 8:], pos[:, 8:], cache), full[:, 8:], rtol=1e-5, atol=1e-5)


def test_parse_rope_reads_hf_objects_and_config_dicts():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    hf = LlamaConfig(rope_theta=5e5, rope_scaling=dict(llama3), max_position_embeddings=131072)  # rope_parameters
    assert parse_rope(hf) == (5e5, llama3)
    assert parse_rope({"rope_theta": 5e5, "rope_scaling": dict(llama3)}) == (5e5, llama3)  # legacy config.json
    assert parse_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)
    assert parse_rope(LlamaConfig()) == (10000.0, None)
    assert parse_rope({}) == (10000.0, None)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32"])
def test_mla_targets_get_a_plain_gqa_layer(model_type):
    hf = LlamaConfig(hidden_size=256, num_attention_heads=16, intermediate_size=512, vocab_size=100)
    hf.model_type = model_type
    c = DrafterConfig.from_target_config(hf, draft_vocab_size=50, num_aux=3)
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (128, 2, 1)
    assert c.target_model_type == model_type
    hf.model_type = "llama"
    assert DrafterConfig.from_target_config(hf, draft_vocab_size=50, num_aux=3).head_dim == 16


def test_num_aux_is_the_fc_slot_count():
    c = tiny_setup()[0].config
    with pytest.raises(HstapError, match="num_aux"):
        DrafterConfig.from_dict({**c.to_dict(), "num_aux": 0})


@pytest.mark.parametrize("num_layers,variant,attention", [(1, False, "sdpa"), (1, True, "math"), (3, False, "sdpa"),
                                                          (3, True, "math")])
def test_fused_kernels_run_the_drafters_forward(num_layers, variant, attention):
    """The drafter's one forward with FusedKernels (fused q/k/v and gate/up weights per layer, rotary tables, grouped
    attention) equals it with its modules' kernels, speculators' variants and deeper drafters included, over the same
    cache and mask; the forward reads the fused copies of every layer, and the drafter's own weights stay as they were."""
    import dataclasses

    from hstap.models.drafter import SPECULATORS_FLAGS, Eagle3Drafter, new_drafter_cache
    from hstap.models.lean_drafter import FusedKernels, LeanDrafter

    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=3, num_layers=num_layers)
    if variant:  # the same weights plus input_norm, every flag on
        cfg = dataclasses.replace(d.config, **{f: True for f in SPECULATORS_FLAGS})
        v = Eagle3Drafter(cfg)
        assert set(v.load_state_dict(d.state_dict(), strict=False).missing_keys) == {"input_norm.weight"}
        with torch.no_grad():
            v.input_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
        d = v
    lean = LeanDrafter(d, 16, attention)
    assert isinstance(lean.kernels, FusedKernels) and len(lean.kernels.layers) == num_layers
    ids, pos = ids[:1], torch.arange(10)[None]
    causal = torch.ones(10, 10, dtype=torch.bool).tril()  # (T, S)
    with torch.no_grad():
        hid, ref_hid = lean.project(aux[:1]), d.project(aux[:1])
        torch.testing.assert_close(hid, ref_hid, rtol=1e-5, atol=1e-5)
        got, want = [], []
        for run, out in ((lean, got), (d, want)):  # a prefix of 6, then 4 tokens over the cache
            cache = new_drafter_cache(d)
            out.append(run(ids[:, :6], ref_hid[:, :6], pos[:, :6], cache, causal[:6, :6]))
            out.append(run(ids[:, 6:], ref_hid[:, 6:], pos[:, 6:], cache, causal[6:]))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lean.compute_logits(g), d.compute_logits(w), rtol=1e-5, atol=1e-5)
        before = d(ids, ref_hid, pos, None, causal)
        for layer in lean.kernels.layers:  # each layer's fused copy is what its products read
            layer.wqkv[0].mul_(0.5)
            assert not torch.allclose(lean(ids, ref_hid, pos, None, causal), before, rtol=1e-3, atol=1e-3)
            layer.wqkv[0].mul_(2.0)
        assert torch.equal(d(ids, ref_hid, pos, None, causal), before)
