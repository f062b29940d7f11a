"""The SGLang hook and plugin on SGLang's own DeepSeek-family model classes (real sglang 0.5.23 types, in process).

SGLang's CPU path cannot run an MLA forward (docs/engines.md), so as in tests/capture/test_sglang_hook.py the hidden
states come from the HF model, and everything SGLang decides comes from SGLang: its `DeepseekV3ForCausalLM` and
Kimi-K2.5's `KimiK25ForConditionalGeneration` are built from a tiny DeepSeek-V3 config (SGLang's own model registry,
config loader and parallel groups: gloo, one rank), hstap's plugin runs through SGLang's plugin loader and
`configure_aux_hidden_state_capture`, the ids it gives land in the model's `layers_to_capture` by SGLang's
`set_eagle3_layers_to_capture`, `register_forward_hooks` attaches hstap's hook from the `--forward-hooks` JSON to the
model's own LogitsProcessor, and batches go through it as `DeepseekV2ForCausalLM.forward` hands them over.

The one step taken from SGLang's source rather than run: a DeepSeek decoder layer i in `layers_to_capture` appends the
residual stream entering it (deepseek_v2.py:3176-3196 passes the packer to layer i, whose attention boundary captures
its input rows before the layer computes, layer_boundary/stage.py:461-482). The HF model's layer i sees the same
stream as its `hidden_states` input, taken here with a forward pre-hook."""

from __future__ import annotations

import copy
import importlib.util
import json
import uuid

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # installed but broken must fail, not skip: no importorskip
    pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23, see docs/engines.md)",
                allow_module_level=True)

from helpers.capture import prepare_records  # noqa: E402
from helpers.sglang import create_store, forward_batch, import_sglang, records  # noqa: E402

from hstap.capture.sglang.plugin import capture_inputs_of, set_capture_layers  # noqa: E402
from hstap.capture.sglang.protocol import ENV_LAYERS, hook_spec  # noqa: E402
from hstap.common import HstapError, free_port  # noqa: E402
from hstap.layers import default_aux_layers, to_hf_index  # noqa: E402
from hstap.store.reader import open_store  # noqa: E402

N = 8  # layers: EAGLE-3's default taps [1, N//2-1, N-4] = [1, 3, 4], the pattern of Kimi-K2.5's [1, 29, 57]
# What SGLang's CPU build of a DeepSeek model reads from config.json beyond HF's own fields: a yarn rope
# (srt/layers/rotary_embedding/factory.py:478) and moe_layer_freq (deepseek_v2.py:2791); real checkpoints carry both.
SGLANG_FIELDS = dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "rope_theta": 10000.0},
                     moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc")


@pytest.fixture(scope="module")
def deepseek(tiny_tokenizer, tmp_path_factory):
    """A tiny random DeepSeek-V3 (MLA + MoE) as SGLang loads one, and SGLang's runtime for it: the published server
    args, the parallel groups (gloo, world 1) and the layer runtime. Torn down at the end of the module."""
    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("ds-sglang")
    build_random_target(d, tiny_tokenizer[0], model_type="deepseek_v3", num_layers=N, hidden_size=64,
                        **SGLANG_FIELDS)
    import_sglang()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.bootstrap import init_layer_runtime
    from sglang.srt.distributed.parallel_state import (
        destroy_distributed_environment, destroy_model_parallel, init_distributed_environment,
        initialize_model_parallel)
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", str(d), "--device", "cpu", "--disable-prefill-cuda-graph"])
    sa.resolve_once()
    publish(sa, role="test", ranks=SpawnRanks(world_rank=0, gpu_id=0))  # as the scheduler of a --tp-size 1 server
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        initialize_model_parallel()
        initialize_dp_attention(server_args=sa)
        mc = ModelConfig.from_server_args(sa)
        init_layer_runtime(model_config=mc)
        yield {"dir": d, "hf_config": mc.hf_config}
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.fixture(scope="module")
def prepared(deepseek, tmp_path_factory):
    return prepare_records(deepseek["dir"], tmp_path_factory.mktemp("ds-prep") / "prepared", records(5, seed=7,
                                                                                                     hostile=False))


def sglang_model(hf_config, cls_name: str = None):
    """SGLang's model class for the config's architecture (its registry), or the class named, built as its loader
    builds it (weights uninitialised)."""
    from sglang.srt.models.registry import ModelRegistry

    if cls_name is None:
        cls, _ = ModelRegistry.resolve_model_cls(hf_config.architectures)
    else:
        cls = ModelRegistry.models[cls_name]
    with torch.device("cpu"):
        return cls(hf_config).eval()


def kimi_config(text_config):
    """Kimi-K2.5's layout as SGLang reads it (srt/configs/kimi_k25.py): the DeepSeek-V3 text model under text_config,
    beside a (here one-layer) MoonViT vision tower and projector."""
    from sglang.srt.configs.kimi_k25 import KimiK25Config

    vision = dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                  vt_hidden_size=32, vt_num_attention_heads=2, vt_num_hidden_layers=1, vt_intermediate_size=64,
                  text_hidden_size=text_config.hidden_size, mm_hidden_size=32)
    cfg = KimiK25Config(text_config=text_config.to_dict(), vision_config=vision,
                        architectures=["KimiK25ForConditionalGeneration"])
    cfg.encoder_only = False
    return cfg


def plugin_configures(model, layers: list[int], monkeypatch) -> None:
    """What a server started with HSTAP_CAPTURE_LAYERS does: SGLang's plugin loader runs hstap's entry point, which
    wraps `configure_aux_hidden_state_capture`; the model runner then calls it (no draft model)."""
    import importlib

    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    mod = importlib.import_module("sglang.srt.model_executor.model_runner_components.attention_backend_setup")
    original = mod.configure_aux_hidden_state_capture
    monkeypatch.setenv(ENV_LAYERS, ",".join(map(str, layers)))
    monkeypatch.setenv("SGLANG_PLUGINS", "hstap")
    try:
        plugins._plugins_loaded = False
        plugins.load_plugins()
        assert mod.configure_aux_hidden_state_capture is not original
        mod.configure_aux_hidden_state_capture(model=model, eagle_use_aux_hidden_state=False,
                                               eagle_aux_hidden_state_layer_ids=None, dflash_use_aux_hidden_state=False,
                                               dflash_target_layer_ids=None, is_dspark=False)
    finally:
        HookRegistry.reset()
        mod.configure_aux_hidden_state_capture = original
        plugins._plugins_loaded = False


def hf_states(hf, ids: torch.Tensor, inputs_of: list[int]):
    """(aux (T, K*H) as SGLang's rule takes it: the stream entering each layer of `inputs_of`, final (T, H), HF's
    output_hidden_states, logits) of one sequence."""
    taken: dict[int, torch.Tensor] = {}
    handles = [hf.model.layers[i].register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: taken.__setitem__(i, (kwargs.get("hidden_states", args[0] if args else None))),
        with_kwargs=True) for i in inputs_of]
    try:
        with torch.no_grad():
            out = hf(ids[None], output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([taken[i][0] for i in inputs_of], dim=-1)  # (T, K*H), the packer's layout
    return aux, out.hidden_states[-1][0], out.hidden_states, out.logits[0]


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"])
def test_default_layers_are_canonical_and_equal_hf(deepseek, prepared, tmp_path, monkeypatch, arch):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from transformers import AutoModelForCausalLM

    from hstap.data.prepare import load_prepared

    hf_config = deepseek["hf_config"]
    model = sglang_model(hf_config if arch == "DeepseekV3ForCausalLM" else kimi_config(hf_config))
    assert type(model).__name__ == arch
    lm = model if arch == "DeepseekV3ForCausalLM" else model.language_model  # Kimi's language model class
    assert type(lm).__name__ == "DeepseekV3ForCausalLM"
    layers = default_aux_layers(N)
    assert layers == [1, 3, 4]
    plugin_configures(model, layers, monkeypatch)
    # SGLang's DeepSeek rule (first id 1: val + 1) made the model capture the inputs of layers 2, 4, 5
    assert lm.capture_aux_hidden_states and lm.model.layers_to_capture == [2, 4, 5]
    assert capture_inputs_of(model) == [2, 4, 5]

    store = tmp_path / f"store-{uuid.uuid4().hex[:6]}"
    create_store(deepseek["dir"], prepared, store, layers)
    register_forward_hooks(model, json.loads(json.dumps([hook_spec(store, prepared, layers, flush_s=0.05)])))
    hooks = list(lm.logits_processor._forward_hooks.values())  # Kimi: on language_model.logits_processor
    assert len(hooks) == 1
    hook = hooks[0]

    hf = AutoModelForCausalLM.from_pretrained(deepseek["dir"], dtype=torch.float32).eval()
    lm.load_weights(hf.state_dict().items())  # SGLang's own loader: its lm_head then holds the target's
    ds = load_prepared(prepared)
    rows = [0, 1, 2]
    states = {r: hf_states(hf, torch.tensor(ds[r]["input_ids"]), lm.model.layers_to_capture) for r in rows}
    session = uuid.uuid4().hex[:8]
    from hstap.capture.session import encode_rid

    def rid(r):
        return encode_rid(session, r, ds[r]["id"])

    # one EXTEND of rows 0 whole and the first half of 1, then the rest of 1 with 2 whole: chunked, as a scheduler packs
    T = {r: len(ds[r]["input_ids"]) for r in rows}
    h = T[1] // 2
    for entries in ([(0, 0, T[0]), (1, 0, h)], [(1, h, T[1] - h), (2, 0, T[2])]):
        ids = torch.cat([torch.tensor(ds[r]["input_ids"][p:p + n]) for r, p, n in entries])  # (R,)
        aux = torch.cat([states[r][0][p:p + n] for r, p, n in entries])  # (R, K*H)
        fin = torch.cat([states[r][1][p:p + n] for r, p, n in entries])  # (R, H)
        fb = forward_batch("EXTEND", [rid(r) for r, _, _ in entries], [n for *_, n in entries],
                           [p for _, p, _ in entries], ids)
        out = lm.logits_processor(ids, fin, lm.lm_head, fb, aux)  # as DeepseekV2ForCausalLM.forward calls it
        want = torch.stack([states[r][3][p + n - 1] for r, p, n in entries])  # (B, V) HF's, each chunk's last row
        torch.testing.assert_close(out.next_token_logits, want, rtol=1e-4, atol=1e-4)
    hook.close()
    st = open_store(store)
    assert sorted(st.ids) == sorted(ds[r]["id"] for r in rows) and st.verify() == []
    for r in rows:
        s = st[st.index_of(ds[r]["id"])]
        _, final, hidden, logits = states[r]
        assert s["input_ids"].tolist() == ds[r]["input_ids"]
        for k, c in enumerate(layers):  # canonical c = output of layer c = HF hidden_states[c + 1]
            torch.testing.assert_close(s["aux"][:, k], hidden[to_hf_index(c, N)][0], rtol=0, atol=0)
        torch.testing.assert_close(s["final"], final, rtol=0, atol=0)
        torch.testing.assert_close(hf.lm_head(final), logits, rtol=1e-5, atol=1e-5)  # `final` is what lm_head reads


def test_other_ids_and_other_deepseek_family_classes(deepseek, tiny_llama, monkeypatch):
    """Ids that do not start at 1 take the DeepSeek rule's other branch; classes built on DeepseekV2ForCausalLM under
    a model type hstap's table does not name (GLM-MoE-DSA) are asked, not assumed; canonical 0 cannot be expressed."""
    from transformers import AutoConfig

    hf_config = deepseek["hf_config"]
    ds = sglang_model(hf_config)
    assert set_capture_layers(ds, [2, 4, 5]) == [3, 5, 6] and ds.model.layers_to_capture == [3, 5, 6]
    glm_config = copy.deepcopy(hf_config)
    glm_config.model_type = "glm_moe_dsa"  # the type a GLM-MoE-DSA checkpoint reports; not in hstap.layers' table
    glm = sglang_model(glm_config, "GlmMoeDsaForCausalLM")
    assert type(glm).__mro__[1].__name__ == "DeepseekV2ForCausalLM"
    assert set_capture_layers(glm, [2, 4, 5]) == [3, 5, 6] and glm.model.layers_to_capture == [3, 5, 6]
    assert set_capture_layers(glm, [1, 3, 4]) == [1, 3, 4] and glm.model.layers_to_capture == [2, 4, 5]
    with pytest.raises(HstapError, match=r"cannot capture canonical layers \[0, 2, 4\] \(the inputs of layers "
                                         r"\[1, 3, 5\]\): ids \[0, 2, 4\] capture the inputs of layers \[0, 2, 4\]; "
                                         r"ids \[1, 3, 5\] capture the inputs of layers \[2, 4, 6\]"):
        set_capture_layers(ds, [0, 2, 4])
    llama = sglang_model(AutoConfig.from_pretrained(tiny_llama))  # SGLang's LlamaForCausalLM: id + 1 always
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert set_capture_layers(llama, [0, 2, 4]) == [0, 2, 4] and llama.model.layers_to_capture == [1, 3, 5]
