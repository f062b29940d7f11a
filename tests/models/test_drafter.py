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
