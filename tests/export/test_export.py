"""hstap export: SGLang / vLLM / hf formats, validation refusals, round trips, and fidelity to SGLang's real loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hstap.common import HstapError
from hstap.artifacts.drafter_dir import load_drafter, save_drafter
from hstap.artifacts.vocab_map import vocab_map_sha256
from hstap.export.engines import ENGINE_KEYS, SPECULATORS_KEYS, load_exported, vllm_aux_layers
from hstap.export.config import ExportConfig
from hstap.export.stage import export
from hstap.layers import to_sglang, to_vllm
from hstap.models.drafter import DrafterConfig, Eagle3Drafter
from helpers.sglang_eagle3 import sglang_forward, sglang_load, sglang_source

AUX = [1, 3, 4]
VD = 48


def _target_embed(target_dir: Path) -> torch.Tensor:
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def _vocab_map(V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hot = torch.randperm(V, generator=g)[:VD].sort().values  # (Vd,) target ids of the draft vocab
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    return hot - torch.arange(VD), t2d


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """A drafter saved like train/stage.py does: RUN/best/ with store provenance and the vocab-map hash."""
    from transformers import AutoConfig

    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(tiny_llama), draft_vocab_size=VD, num_aux=3,
                                           aux_layers=AUX)
    torch.manual_seed(0)
    m = Eagle3Drafter(cfg)
    with torch.no_grad():  # non-unit norms and wide weights: a swapped or dropped tensor changes the logits visibly
        for p in m.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 1.0)
    m.init_from_target(_target_embed(tiny_llama))
    m.set_vocab_map(*_vocab_map(cfg.vocab_size, seed=1))
    m.eval()
    header = {"target": {"path": str(tiny_llama), "model_type": "llama", "num_layers": 6, "hidden_size": 64,
                         "config_sha256": "c" * 64, "weights_fingerprint": "w" * 64},
              "engine": {"name": "hf", "version": "test", "device": "cpu", "compute_dtype": "fp32"},
              "dtype": "fp32", "layers": AUX, "hidden_size": 64}
    run = tmp_path_factory.mktemp("run")
    # what train/stage.py records: the store's header, the fused layers, the store's own layers, the vocab map at init
    prov = {**header, "captured_layers": AUX, "path": "STORE"}
    save_drafter(run / "best", m, extra={"store": prov, "vocab_map_sha256": vocab_map_sha256(m.d2t, m.t2d),
                                         "vocab_map_source": "PREPARED/vocab_map.safetensors"})
    return run, m, header


def _store(path: Path, header: dict, layers: list[int]) -> Path:
    from hstap.store.writer import StoreWriter

    with StoreWriter(path, {**header, "layers": layers}) as w:
        T = 5
        w.add("s0", torch.arange(T), torch.ones(T, dtype=torch.long), torch.randn(T, len(layers), 64), torch.randn(T, 64))
    return path


def _inputs(V: int, T: int = 9, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, T), generator=g)  # (B, T)
    aux = torch.randn(2, T, 3 * 64, generator=g)  # (B, T, K*Ht)
    pos = torch.arange(T).expand(2, T)  # (B, T)
    return ids, aux, pos


@torch.no_grad()
def _logits(m: Eagle3Drafter, ids, aux, pos) -> torch.Tensor:
    return m.compute_logits(m(ids, m.project(aux), pos))  # (B, T, Vd)


# ---------------------------------------------------------------------------------------------------------------------
# formats


def test_sglang_config_and_weights(trained, tiny_llama, tmp_path):
    run, m, _ = trained
    out = tmp_path / "sg"
    summary = export(ExportConfig(run=str(run), to="sglang", out=str(out)))
    c = json.loads((out / "config.json").read_text())
    cfg = m.config
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False and c["torch_dtype"] == "bfloat16"
    for key, want in (("hidden_size", 64), ("intermediate_size", cfg.intermediate_size), ("num_attention_heads", 4),
                      ("num_key_value_heads", 2), ("head_dim", 16), ("vocab_size", cfg.vocab_size),
                      ("draft_vocab_size", VD), ("target_hidden_size", 64), ("rms_norm_eps", cfg.rms_norm_eps),
                      ("max_position_embeddings", cfg.max_position_embeddings), ("hidden_act", "silu"),
                      ("rope_theta", cfg.rope_theta)):
        assert c[key] == want, key
    assert c["rope_scaling"] is None and c["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": to_sglang(AUX, "llama"), "use_aux_hidden_state": True}
    assert summary["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # Llama: SGLang ids are "output of layer j"
    assert c["eagle_aux_hidden_state_layer_ids"] == to_vllm(AUX) == [2, 4, 5]  # vLLM reads this key first
    info = json.loads((out / "hstap_export.json").read_text())
    assert info["engine"].startswith("SGLang") and "SGLang" in (out / "README.md").read_text()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(ENGINE_KEYS)  # exactly these: no embedding, no rotary buffers
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16" and f.get_slice("d2t").get_dtype() == "I64"
        assert f.get_slice("fc.weight").get_shape() == [64, 3 * 64]
        assert torch.equal(f.get_tensor("d2t"), m.d2t)
    prov = json.loads((out / "hstap_export.json").read_text())
    assert prov["aux_layers"] == AUX and prov["provenance"]["store"]["layers"] == AUX
    # transformers (which SGLang uses to read the draft config) accepts it, with the EAGLE fields as attributes
    from transformers import AutoConfig
    ac = AutoConfig.from_pretrained(out)
    assert ac.model_type == "llama" and ac.draft_vocab_size == VD and ac.eagle_config["eagle_aux_hidden_state_layer_ids"]


def test_sglang_ids_follow_the_deepseek_rule(trained, tmp_path):
    """A DeepSeek target whose first aux layer is not 1 gets raw layer-input ids (SGLang's +1 rule is off)."""
    run, _, _ = trained
    src = tmp_path / "ds"
    shutil.copytree(run / "best", src)
    meta = json.loads((src / "drafter.json").read_text())
    meta["config"].update(target_model_type="deepseek_v3", aux_layers=[2, 3, 4])
    meta["store"]["layers"] = [2, 3, 4]
    (src / "drafter.json").write_text(json.dumps(meta))
    export(ExportConfig(run=str(src), to="sglang", out=str(tmp_path / "out")))
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5] == to_sglang([2, 3, 4], "deepseek_v3")
    shutil.rmtree(tmp_path / "out")
    meta["config"]["aux_layers"] = meta["store"]["layers"] = [1, 3, 4]  # first id 1: SGLang's +1 rule applies as-is
    (src / "drafter.json").write_text(json.dumps(meta))
    export(ExportConfig(run=str(src), to="sglang", out=str(tmp_path / "out")))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_vllm_speculators_config(trained, tiny_llama, tmp_path):
    run, m, _ = trained
    out = tmp_path / "vl"
    export(ExportConfig(run=str(run), to="vllm", out=str(out), target=str(tiny_llama)))
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3Speculator"]
    assert c["eagle_aux_hidden_state_layer_ids"] == to_vllm(AUX) == [2, 4, 5]
    assert c["draft_vocab_size"] == VD and c["target_hidden_size"] == 64 and c["norm_before_residual"] is False
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"] == {"name_or_path": str(tiny_llama), "architectures": ["LlamaForCausalLM"]}
    layer = c["transformer_layer_config"]
    for key, want in (("hidden_size", 64), ("num_attention_heads", 4), ("num_key_value_heads", 2), ("head_dim", 16),
                      ("intermediate_size", m.config.intermediate_size), ("vocab_size", m.config.vocab_size),
                      ("num_hidden_layers", 1), ("rms_norm_eps", m.config.rms_norm_eps), ("rope_theta", m.config.rope_theta),
                      ("max_position_embeddings", m.config.max_position_embeddings)):
        assert layer[key] == want, key
    # What vLLM's SpeculatorsConfig does with it (transformers_utils/configs/speculators/{base,algos}.py): start from
    # transformer_layer_config, copy the eagle3 fields over, build a LlamaConfig. The result must describe our drafter.
    from transformers import LlamaConfig
    pre = dict(layer, draft_vocab_size=c["draft_vocab_size"], target_hidden_size=c["target_hidden_size"],
               norm_before_residual=c.get("norm_before_residual", True),
               eagle_aux_hidden_state_layer_ids=c["eagle_aux_hidden_state_layer_ids"],
               num_lookahead_tokens=sc["proposal_methods"][0]["speculative_tokens"])
    lc = LlamaConfig(**pre)
    assert lc.head_dim == 16 and lc.num_key_value_heads == 2 and lc.norm_before_residual is False
    assert lc.target_hidden_size * 3 == load_file(str(out / "model.safetensors"))["fc.weight"].shape[1]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(SPECULATORS_KEYS)  # speculators' names: layers.0.* is the midlayer
    assert json.loads((out / "hstap_export.json").read_text())["engine"].startswith("vLLM")


def test_vllm_weight_names_map_onto_eagle3_llama(trained, tiny_llama, tmp_path):
    """Every exported tensor lands on a parameter of vLLM's Eagle3LlamaForCausalLM, and every parameter but the
    (target-shared) embedding is filled.

    This replays the name handling of vllm-project/vllm vllm/model_executor/models/llama_eagle3.py at 00bd1493 (read
    from the source index; the live vLLM engine loads the export in tests/speculative/test_vllm_eval.py):
    Eagle3LlamaForCausalLM.load_weights
    skips t2d, renames d2t -> draft_id_to_target_id, prefixes "model." to everything but lm_head, and skips
    embed_tokens when absent; LlamaModel.load_weights renames "midlayer." -> "layers.0.", fuses q/k/v -> qkv_proj and
    gate/up -> gate_up_proj, and indexes params_dict[name] (a KeyError for any other name). SpeculatorsConfig
    (transformers_utils/configs/speculators/base.py) requires the keys checked first.
    """
    run, _, _ = trained
    out = tmp_path / "vl"
    export(ExportConfig(run=str(run), to="vllm", out=str(out), target=str(tiny_llama)))
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
    assert c["speculators_config"]["verifier"]["name_or_path"] and isinstance(c["transformer_layer_config"], dict)
    params = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
              "draft_id_to_target_id"} | {f"model.layers.0.{n}.weight" for n in (
                  "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm",
                  "post_attention_layernorm", "hidden_norm")}
    stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
               (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
    filled = set()
    for name in load_file(str(out / "model.safetensors")):
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        if name.startswith("model."):
            inner = name[len("model."):].replace("midlayer.", "layers.0.")
            for param, weight, _ in stacked:
                if weight in inner:
                    inner = inner.replace(weight, param)
                    break
            name = "model." + inner
        assert name in params, name
        filled.add(name)
    assert filled == params - {"model.embed_tokens.weight"}


def test_every_export_gives_vllm_its_own_layers(trained, tiny_llama, tmp_path):
    """vLLM reads the trained layers from both engine exports; a config that only has SGLang's ids (what hstap wrote
    before, or another trainer's SGLang checkpoint), which vLLM would read one layer early, is refused naming the export
    to use."""
    run, _, _ = trained
    for to in ("sglang", "vllm"):
        export(ExportConfig(run=str(run), to=to, out=str(tmp_path / to), target=str(tiny_llama)))
        assert vllm_aux_layers(tmp_path / to, 6) == AUX, to
    old = tmp_path / "sglang-only"
    shutil.copytree(tmp_path / "sglang", old)
    c = json.loads((old / "config.json").read_text())
    del c["eagle_aux_hidden_state_layer_ids"]
    (old / "config.json").write_text(json.dumps(c))
    with pytest.raises(HstapError, match=r"vLLM would tap layers \[0, 2, 3\].*trained on \[1, 3, 4\].*--to vllm"):
        vllm_aux_layers(old, 6)


def test_sglang_reads_its_ids_from_eagle_config_first():
    """The SGLang export keeps vLLM's ids at the top level: safe only while SGLang resolves an EAGLE-3 drafter's ids
    from `eagle_config` and never from the top-level key (read from the installed sglang's resolver, by its AST: the
    module needs a GPU-side stack to import)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    f = (Path(list(spec.submodule_search_locations)[0]) / "srt" / "model_executor" / "model_runner_components" /
         "spec_aux_hidden_state.py")
    fn = next(n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)
              and n.name == "_resolve_eagle_aux_hidden_state")
    reads = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, (ast.Subscript, ast.Call))
             and "eagle_aux_hidden_state_layer_ids" in ast.unparse(n)]
    assert any(r.startswith("eagle_config[") for r in reads), reads
    assert not any("hf_config, 'eagle_aux_hidden_state_layer_ids'" in r for r in reads), reads


def test_speculators_loads_the_vllm_export_bit_exactly(trained, tiny_llama, tmp_path):
    """speculators 0.9's Eagle3DraftModel.from_pretrained on `--to vllm`: every tensor of the export is in the model
    with its exact values (nothing left at its initialisation), and the aux ids are vLLM's."""
    speculators = pytest.importorskip("speculators.models.eagle3")
    run, m, _ = trained
    out = tmp_path / "vl"
    export(ExportConfig(run=str(run), to="vllm", out=str(out), target=str(tiny_llama), dtype="fp32"))
    model = speculators.Eagle3DraftModel.from_pretrained(str(out))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    written = load_file(str(out / "model.safetensors"))
    missing = sorted(set(written) - set(state))
    assert not missing, missing
    for k, v in written.items():
        assert torch.equal(state[k].to(v.dtype), v), k
    assert torch.equal(state["layers.0.self_attn.q_proj.weight"], m.state_dict()["midlayer.self_attn.q_proj.weight"])
    assert list(model.config.eagle_aux_hidden_state_layer_ids) == to_vllm(AUX)


# ---------------------------------------------------------------------------------------------------------------------
# round trips


def test_round_trip_identical_logits(trained, tiny_llama, tmp_path):
    run, m, _ = trained
    ids, aux, pos = _inputs(m.config.vocab_size)
    ref = _logits(m, ids, aux, pos)
    export(ExportConfig(run=str(run), to="hf", out=str(tmp_path / "hf")))
    back, meta = load_drafter(tmp_path / "hf")
    assert meta["config"]["aux_layers"] == AUX
    assert torch.equal(_logits(back, ids, aux, pos), ref)
    embed = _target_embed(tiny_llama)
    for to in ("sglang", "vllm"):
        export(ExportConfig(run=str(run), to=to, out=str(tmp_path / to), dtype="fp32", target=str(tiny_llama)))
        back, _ = load_exported(tmp_path / to, embed_weight=embed)
        assert back.config.aux_layers == AUX and torch.equal(back.d2t, m.d2t)
        assert torch.equal(_logits(back, ids, aux, pos), ref), to
    # bf16 export: exactly the fp32 drafter with its weights rounded to bf16
    export(ExportConfig(run=str(run), to="sglang", out=str(tmp_path / "bf")))
    back, _ = load_exported(tmp_path / "bf", embed_weight=embed)
    rounded = Eagle3Drafter(m.config).eval()
    rounded.load_state_dict({k: (v.to(torch.bfloat16).float() if v.is_floating_point() and k != "embed_tokens.weight"
                                 else v) for k, v in m.state_dict().items()})
    assert torch.equal(_logits(back, ids, aux, pos), _logits(rounded, ids, aux, pos))
    assert not torch.equal(_logits(back, ids, aux, pos), ref)


def _deep_run(tiny_llama, root: Path, header: dict, num_layers: int = 2) -> tuple[Path, Eagle3Drafter]:
    """A trained-looking drafter with num_layers decoder layers, saved as train/stage.py saves it."""
    from transformers import AutoConfig

    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(tiny_llama), draft_vocab_size=VD, num_aux=3,
                                           aux_layers=AUX, num_layers=num_layers)
    torch.manual_seed(1)
    m = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 1.0)
    m.init_from_target(_target_embed(tiny_llama))
    m.set_vocab_map(*_vocab_map(cfg.vocab_size, seed=1))
    save_drafter(root / "best", m.eval(), extra={"store": {**header, "captured_layers": AUX, "path": "STORE"},
                                                 "vocab_map_sha256": vocab_map_sha256(m.d2t, m.t2d)})
    return root, m


def test_deeper_drafter_exports_to_vllm_and_reads_back(trained, tiny_llama, tmp_path):
    """N = 2: speculators' names (layers.0 = the midlayer, layers.1 a plain Llama layer with H-wide q/k/v), every tensor
    landing on a parameter of vLLM's Eagle3 model (layers 1.. have an unused hidden_norm there, left unfilled, as
    speculators' own N-layer checkpoints leave it), num_hidden_layers 2, and identical logits read back; one-layer
    drafter.json files keep their old keys."""
    run, m = _deep_run(tiny_llama, tmp_path / "run", trained[2])
    assert "num_layers" in json.loads((run / "best" / "drafter.json").read_text())["config"]
    assert "num_layers" not in json.loads((trained[0] / "best" / "drafter.json").read_text())["config"]
    out = tmp_path / "vl"
    summary = export(ExportConfig(run=str(run), to="vllm", out=str(out), dtype="fp32", target=str(tiny_llama)))
    c = json.loads((out / "config.json").read_text())
    assert c["transformer_layer_config"]["num_hidden_layers"] == 2
    state = load_file(str(out / "model.safetensors"))
    assert summary["tensors"] == len(state) and not any(k.startswith("midlayer.") or "embed" in k for k in state)
    H, nq = m.config.hidden_size, m.config.num_attention_heads * m.config.head_dim
    assert state["layers.0.self_attn.q_proj.weight"].shape == (nq, 2 * H)
    assert state["layers.1.self_attn.q_proj.weight"].shape == (nq, H) and "layers.1.hidden_norm.weight" not in state
    layer_params = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm",
                    "post_attention_layernorm", "hidden_norm")
    params = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"} | {
        f"model.layers.{i}.{n}.weight" for i in range(2) for n in layer_params}
    fuse = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
            ".up_proj": ".gate_up_proj"}
    filled = set()
    for name in state:  # vLLM's load_weights name handling, as in test_vllm_weight_names_map_onto_eagle3_llama
        if name == "t2d":
            continue
        name = "draft_id_to_target_id" if name == "d2t" else (name if "lm_head" in name else "model." + name)
        for w, fused in fuse.items():
            name = name.replace(w, fused) if w + "." in name else name
        assert name in params, name
        filled.add(name)
    assert params - filled == {"model.layers.1.hidden_norm.weight"}
    back, _ = load_exported(out, embed_weight=_target_embed(tiny_llama))
    assert back.config.num_layers == 2
    ids, aux, pos = _inputs(m.config.vocab_size)
    assert torch.equal(_logits(back, ids, aux, pos), _logits(m, ids, aux, pos))
    export(ExportConfig(run=str(run), to="hf", out=str(tmp_path / "hf")))
    assert torch.equal(_logits(load_drafter(tmp_path / "hf")[0], ids, aux, pos), _logits(m, ids, aux, pos))


def test_deeper_drafter_refused_by_sglang(trained, tiny_llama, tmp_path):
    run, _ = _deep_run(tiny_llama, tmp_path / "run", trained[2], num_layers=3)
    with pytest.raises(HstapError, match="loads one decoder layer and this drafter has 3") as e:
        export(ExportConfig(run=str(run), to="sglang", out=str(tmp_path / "sg")))
    assert "\n" not in str(e.value) and not (tmp_path / "sg").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".sg")]


def _speculators_step_logits(model, ids, aux, K: int) -> list[torch.Tensor]:
    """speculators' Eagle3DraftModel over one sequence (ids (T+1,), aux (T, K*H) = fc inputs of positions 0..T-1):
    the lm_head output of each of K teacher-forced TTT steps, (1, T, Vd) each."""
    got = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: got.append(o.detach()))
    T = aux.shape[0]
    with torch.no_grad():
        model(hidden_states=aux[None], input_ids=ids[None, 1:], document_ids=torch.zeros(1, T, dtype=torch.long),
              position_ids=torch.arange(1, T + 1)[None], ttt_steps=K)  # shift_batch's layout: positions from 1
    hook.remove()
    return got


def _hstap_step_logits(d: Eagle3Drafter, ids, aux, K: int) -> list[torch.Tensor]:
    """The same through hstap's drafter: its exact TTT mask, speculators' teacher forcing and positions."""
    from hstap.models.drafter import new_drafter_cache
    from hstap.train.ttt import ttt_mask

    T, out = aux.shape[0], []
    with torch.no_grad():
        hidden, cache = d.project(aux[None]), new_drafter_cache(d)
        for k in range(K):
            step = torch.nn.functional.pad(ids[None, 1 + k:], (0, k))  # (1, T): x[t+1+k]
            hidden = d(step, hidden, torch.arange(1 + k, T + 1 + k)[None], cache, ttt_mask(T, k))
            out.append(d.compute_logits(hidden))
    return out


def test_speculators_layout_switches_read_as_speculators_computes_them(trained, tiny_llama, tmp_path):
    """speculators' eagle3 layout switches, its trainer's defaults (norm_before_fc, norm_before_residual, norm_output):
    a checkpoint saved by speculators' own Eagle3DraftModel is read by load_exported into a drafter with speculators'
    logits at every TTT step; a config without norm_before_residual means True (vLLM's reading); fc_norm is refused;
    an hstap drafter with the switches exports them to vLLM, reads back identically, and SGLang refuses it."""
    spec = pytest.importorskip("speculators.models.eagle3")
    from speculators.train.cli import create_transformer_layer_config

    layer = create_transformer_layer_config(str(tiny_llama), num_layers=1, draft_arch="llama", hidden_act=None,
                                            sliding_window=2048, full_attention_indices=[0])
    d2t, t2d = _vocab_map(layer.vocab_size, seed=1)
    model = spec.Eagle3DraftModel.from_training_args(
        layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(tiny_llama), draft_vocab_size=VD, ttt_steps=3,
        norm_before_fc=True, norm_before_residual=True, norm_output=True, target_layer_ids=to_vllm(AUX),
        draft_attn_impl="sdpa").eval()
    torch.manual_seed(3)
    with torch.no_grad():  # away from the init: a norm applied or left out changes the logits visibly
        for name, p in model.named_parameters():
            if not name.startswith("verifier_"):
                p.normal_(1.0, 0.3) if p.dim() == 1 else p.normal_(0.0, 0.3)
    model.save_pretrained(str(tmp_path / "spec"))
    d, _ = load_exported(tmp_path / "spec")
    assert (d.config.norm_before_fc, d.config.norm_before_residual, d.config.norm_output) == (True, True, True)
    assert d.config.aux_layers == AUX
    g = torch.Generator().manual_seed(4)
    ids, aux = torch.randint(0, layer.vocab_size, (13,), generator=g), torch.randn(12, 3 * 64, generator=g)
    theirs, ours = _speculators_step_logits(model, ids, aux, 3), _hstap_step_logits(d, ids, aux, 3)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert theirs[0].abs().max() > 1.0
    conf = json.loads((tmp_path / "spec" / "config.json").read_text())
    del conf["norm_before_residual"]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(conf))
    assert load_exported(tmp_path / "spec")[0].config.norm_before_residual is True
    (tmp_path / "spec" / "config.json").write_text(json.dumps({**conf, "fc_norm": True}))
    with pytest.raises(HstapError, match="fc_norm"):
        load_exported(tmp_path / "spec")
    run = tmp_path / "run"
    save_drafter(run / "best", d, extra={"store": {**trained[2], "captured_layers": AUX, "path": "STORE"}})
    export(ExportConfig(run=str(run), to="vllm", out=str(tmp_path / "vl"), dtype="fp32", target=str(tiny_llama)))
    c = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert (c["norm_before_fc"], c["norm_before_residual"], c["norm_output"]) == (True, True, True)
    back, _ = load_exported(tmp_path / "vl", embed_weight=d.embed_tokens.weight)
    assert all(torch.equal(a, b) for a, b in zip(_hstap_step_logits(back, ids, aux, 3), ours))
    with pytest.raises(HstapError, match="SGLang's LlamaForCausalLMEagle3 has no norm_before_fc"):
        export(ExportConfig(run=str(run), to="sglang", out=str(tmp_path / "sg")))
    assert not (tmp_path / "sg").exists()


# ---------------------------------------------------------------------------------------------------------------------
# SGLang fidelity


def test_sglang_loader_fidelity(trained, tiny_llama, tmp_path):
    src = sglang_source()
    run, m, _ = trained
    out = tmp_path / "sg"
    export(ExportConfig(run=str(run), to="sglang", out=str(out), dtype="fp32"))
    params, rep, hot = sglang_load(out, src)
    assert rep["dropped"] == []  # every exported tensor lands in an SGLang parameter
    assert {pn for pn, _ in rep["loaded"]} == set(params) - {"model.embed_tokens.weight"}  # and every one is filled
    assert {s for pn, s in rep["loaded"] if "qkv" in pn} == {"q", "k", "v"}
    assert {s for pn, s in rep["loaded"] if "gate_up" in pn} == {0, 1}
    params["model.embed_tokens.weight"] = _target_embed(tiny_llama).float()  # shared from the target at serve time
    assert torch.equal(hot, m.draft_to_target(torch.arange(VD)))
    ids, aux, pos = _inputs(m.config.vocab_size)
    with torch.no_grad():
        h_out = m(ids, m.project(aux), pos)  # (B, T, H)
        ours = m.compute_logits(h_out)  # (B, T, Vd)
    for b in range(ids.shape[0]):
        logits, to_aux = sglang_forward(params, rep["config"], ids[b], aux[b], pos[b])
        torch.testing.assert_close(logits, ours[b], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(to_aux, h_out[b], rtol=1e-5, atol=1e-4)
        assert torch.equal(hot[logits.argmax(-1)], m.draft_to_target(ours[b].argmax(-1)))
    assert ours.abs().max() > 1.0  # non-trivial logits (the comparison would be vacuous near zero)


# ---------------------------------------------------------------------------------------------------------------------
# refusals


def _mutate(src: Path, dst: Path, state_fn=None, meta_fn=None) -> Path:
    shutil.copytree(src, dst)
    if state_fn is not None:
        state = load_file(str(dst / "drafter.safetensors"))
        state_fn(state)
        save_file(state, str(dst / "drafter.safetensors"))
    if meta_fn is not None:
        meta = json.loads((dst / "drafter.json").read_text())
        meta_fn(meta)
        (dst / "drafter.json").write_text(json.dumps(meta))
    return dst


def _swap_d2t(s):
    s["d2t"][[3, 4]] = s["d2t"][[4, 3]] + torch.tensor([1, -1])  # hot ids 3 and 4 exchanged: no longer increasing


def _other_map(s):
    s["d2t"], s["t2d"] = _vocab_map(s["t2d"].shape[0], seed=7)  # a valid map, but not the one lm_head was trained with


def _two_aux(s):
    s["fc.weight"] = s["fc.weight"][:, :128].contiguous()


def _eagle1(meta):
    meta["config"].update(aux_layers=[], num_aux=1)
    meta.pop("store")


REFUSALS = {
    "missing key": (dict(state_fn=lambda s: s.pop("midlayer.hidden_norm.weight")), {}, "missing ['midlayer.hidden_norm"),
    "extra key": (dict(state_fn=lambda s: s.update({"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(8)})), {},
                  "unexpected ['midlayer.self_attn.rotary_emb.inv_freq']"),
    "wrong shape": (dict(state_fn=lambda s: s.update({"lm_head.weight": s["lm_head.weight"][:-1]})), {},
                    "lm_head.weight: shape (47, 64) != (48, 64)"),
    "non-finite": (dict(state_fn=lambda s: s["norm.weight"].__setitem__(0, float("nan"))), {}, "norm.weight: non-finite"),
    "d2t not increasing": (dict(state_fn=_swap_d2t), {}, "hot ids (arange + d2t) are not strictly increasing"),
    "d2t outside vocab": (dict(state_fn=lambda s: s["d2t"].__setitem__(VD - 1, 10_000)), {}, "leave the vocabulary"),
    "t2d disagrees": (dict(state_fn=lambda s: s["t2d"].__setitem__(int((~s["t2d"]).nonzero()[0]), True)), {},
                      "t2d is not true exactly at the hot ids"),
    "vocab-map hash": (dict(state_fn=_other_map), {}, "differ from the vocab map its lm_head rows were trained with"),
    "no vocab-map hash": (dict(meta_fn=lambda m: m.pop("vocab_map_sha256")), {}, "vocab_map_sha256: missing"),
    "layers vs provenance": (dict(meta_fn=lambda m: m["store"].update(layers=[1, 2, 4])), {},
                             "config.aux_layers [1, 3, 4] != store.layers [1, 2, 4]"),
    "layers vs --store": ({}, {"store": [1, 2, 4]}, "layers [1, 2, 4] != captured_layers [1, 3, 4] of the store"),
    "layers vs --store, no record": (dict(meta_fn=lambda m: m["store"].pop("captured_layers")), {"store": [1, 2, 4]},
                                     "layers [1, 2, 4] != the drafter's aux layers [1, 3, 4]"),
    "eagle-1 for sglang": (dict(state_fn=lambda s: s.update({"fc.weight": s["fc.weight"][:, :64].contiguous()}),
                                meta_fn=_eagle1), {}, "EAGLE-1 style"),
    "vllm needs 3 aux": (dict(state_fn=_two_aux, meta_fn=lambda m: (m["config"].update(aux_layers=[1, 3], num_aux=2),
                                                                     m["store"].update(layers=[1, 3]))),
                         {"to": "vllm"}, "exactly 3 aux layers"),
    "wrong --target": ({}, {"target": "other"}, "vocab_size: the drafter was made for a target of 400 token ids"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_write_nothing(case, trained, tmp_path):
    run, _, header = trained
    mut, opts, msg = REFUSALS[case]
    src = _mutate(run / "best", tmp_path / "src", **mut)
    kw = {"to": opts.get("to", "sglang")}
    if "store" in opts:
        kw["store"] = str(_store(tmp_path / "store", header, opts["store"]))
    if "target" in opts:
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text(json.dumps({"vocab_size": 100, "hidden_size": 64}))
        kw["target"] = str(tmp_path / "other")
    dest = tmp_path / "exports"
    dest.mkdir()
    with pytest.raises(HstapError, match=None) as e:
        export(ExportConfig(run=str(src), out=str(dest / "out"), **kw))
    assert msg in str(e.value) and "\n" not in str(e.value)
    assert list(dest.iterdir()) == []  # nothing written, no temp leftovers


def test_matching_store_and_overwrite(trained, tmp_path):
    run, _, header = trained
    store = _store(tmp_path / "store", header, AUX)
    out = tmp_path / "out"
    export(ExportConfig(run=str(run), to="sglang", out=str(out), store=str(store)))
    with pytest.raises(HstapError, match="holds an earlier hstap export output; pass --overwrite"):
        export(ExportConfig(run=str(run), to="vllm", out=str(out)))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    export(ExportConfig(run=str(run), to="vllm", out=str(out), overwrite=True))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Eagle3Speculator"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "store"]  # old copy and temp dir are gone


def test_drafter_on_a_subset_of_the_store_layers(trained, tmp_path):
    """train may fuse 2 of a store's 3 layers: SGLang takes any count (num_aux from the ids); --store accepts it."""
    run, _, header = trained
    src = _mutate(run / "best", tmp_path / "src", state_fn=_two_aux,
                  meta_fn=lambda m: (m["config"].update(aux_layers=[1, 3], num_aux=2), m["store"].update(layers=[1, 3])))
    store = _store(tmp_path / "store", header, AUX)
    export(ExportConfig(run=str(src), to="sglang", out=str(tmp_path / "out"), store=str(store)))
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert load_file(str(tmp_path / "out" / "model.safetensors"))["fc.weight"].shape == (64, 128)


def test_save_drafter_records_the_vocab_map(trained, tmp_path):
    run, m, _ = trained
    save_drafter(tmp_path / "plain", m)  # no record given: the hash of the drafter's own buffers
    assert json.loads((tmp_path / "plain" / "drafter.json").read_text())["vocab_map_sha256"] == vocab_map_sha256(m.d2t, m.t2d)
    assert vocab_map_sha256(m.d2t, m.t2d) != vocab_map_sha256(*_vocab_map(m.config.vocab_size, seed=7))
    save_drafter(tmp_path / "d", m, extra={"vocab_map_sha256": "f" * 64})  # train's record wins over the buffers
    assert json.loads((tmp_path / "d" / "drafter.json").read_text())["vocab_map_sha256"] == "f" * 64


def test_cli_flags_and_docs():
    from hstap.cli import field_docs, make_config
    cfg = make_config("export", ExportConfig, ["--run", "R", "--to", "vllm", "--out", "O", "--dtype", "fp32",
                                               "--speculative-tokens", "5"])
    assert (cfg.to, cfg.dtype, cfg.speculative_tokens) == ("vllm", "fp32", 5)
    import dataclasses
    assert set(field_docs(ExportConfig)) == {f.name for f in dataclasses.fields(ExportConfig)}
    with pytest.raises(SystemExit):
        make_config("export", ExportConfig, ["--run", "R", "--to", "trt", "--out", "O"])
