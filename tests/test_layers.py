"""Layer-id conventions: every conversion against real cases (Kimi-K2.5 / DeepSeek-V3 N=61, Llama N=32, the tiny N=8)."""

import pytest
import torch

from hstap import layers as L
from hstap.common import HstapError


def test_kimi_k25_vector():
    # DeepSeek-V3 architecture, N=61, H=7168: canonical outputs [2, 30, 58] = SGLang captures inputs of [3, 31, 59]
    # = vLLM ids [3, 31, 59].
    canon = [2, 30, 58]
    assert L.to_vllm(canon) == [3, 31, 59]
    assert L.from_vllm([3, 31, 59], 61) == canon
    cfg_ids = L.to_sglang(canon, "deepseek_v3")
    assert cfg_ids == [3, 31, 59]  # first id != 1: DeepSeek takes them as layer inputs, no +1
    assert L.sglang_capture_inputs(cfg_ids, "deepseek_v3") == [3, 31, 59]
    assert L.from_sglang(cfg_ids, "deepseek_v3") == canon
    # The same layers written in the "safe" form that starts at 1 resolve identically on both families.
    assert L.sglang_capture_inputs([1, 29, 57], "deepseek_v3") == [2, 30, 58]
    assert L.sglang_capture_inputs([1, 29, 57], "llama") == [2, 30, 58]


@pytest.mark.parametrize("n,expected", [(8, [1, 3, 4]), (32, [1, 15, 28]), (61, [1, 29, 57])])
def test_default_aux_layers(n, expected):
    assert L.default_aux_layers(n) == expected
    # SGLang's id-less default ([2, N//2, N-3] as layer inputs) is the same three layers.
    assert [i - 1 for i in L.sglang_default_capture_inputs(n)] == expected
    # Llama-family SGLang config ids are canonical ids; DeepSeek's +1 rule fires because the first id is 1.
    assert L.to_sglang(expected, "llama") == expected
    assert L.to_sglang(expected, "deepseek_v3") == expected
    assert L.from_sglang(expected, "llama") == expected == L.from_sglang(expected, "deepseek_v3")
    assert L.from_vllm(L.to_vllm(expected), n) == expected


def test_vllm_last_layer_is_pre_norm_output():
    # vLLM id N = the last layer's pre-norm output = canonical N-1, which HF does not expose (its index N is post-norm).
    assert L.from_vllm([32], 32) == [31]
    with pytest.raises(HstapError, match="after the final norm"):
        L.to_hf_index(31, 32)
    assert L.to_hf_index(30, 32) == 31 and L.from_hf_index(31, 32) == 30
    with pytest.raises(HstapError):
        L.from_vllm([33], 32)


def test_llama_sglang_shift_and_deepseek_edge():
    assert L.sglang_capture_inputs([2, 30, 58], "llama") == [3, 31, 59]
    # canonical 0 = input of layer 1, but an id list starting with 1 triggers DeepSeek's +1 rule.
    with pytest.raises(HstapError, match="cannot be expressed"):
        L.to_sglang([0, 3], "deepseek_v3")


def test_parse_and_check_layers():
    assert L.parse_layers("1,3,4", 8) == [1, 3, 4]
    assert L.parse_layers("", 8) == [1, 3, 4]
    for bad, msg in [("1,8", "out of range"), ("3,1", "strictly increasing"), ("a,b", "integers"), ("1,1", "strictly")]:
        with pytest.raises(HstapError, match=msg):
            L.parse_layers(bad, 8)


def test_hf_index_matches_hidden_states(tiny_llama):
    from transformers import AutoModelForCausalLM

    from hstap.target import Target

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    N = model.config.num_hidden_layers
    ids = torch.randint(6, 300, (1, 9))
    hs = model(ids, output_hidden_states=True).hidden_states
    aux, final, _ = Target(model).capture(ids, list(range(N)))
    for i in range(N - 1):
        torch.testing.assert_close(aux[:, :, i], hs[L.to_hf_index(i, N)], rtol=0, atol=0)
    # HF's last entry is the final-norm output, not layer N-1's raw output.
    torch.testing.assert_close(final, hs[N], rtol=0, atol=0)
    assert not torch.allclose(aux[:, :, N - 1], hs[N])
