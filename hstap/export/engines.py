"""Engine formats of a drafter: the SGLang and vLLM/speculators configs and tensor names, and reading an export back.

- sglang: config.json for `LlamaForCausalLMEagle3` (llama fields + `eagle_config.eagle_aux_hidden_state_layer_ids` in
  SGLang's convention, `hstap.layers.to_sglang`) and model.safetensors with `fc.weight`, `midlayer.*`, `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d`; no embedding (SGLang shares the target's). The same ids in vLLM's convention sit at
  the top level (`eagle_aux_hidden_state_layer_ids`, `hstap.layers.to_vllm`): vLLM reads that key first and SGLang
  reads `eagle_config` first, so each engine finds its own convention and neither reads the taps one layer off.
- vllm: a speculators `Eagle3Speculator` config.json (`transformer_layer_config`, `speculators_config` naming the
  verifier, ids in vLLM's convention), so `vllm serve DIR` needs no other flag, and model.safetensors in speculators'
  names (`SPECULATORS_KEYS`: `layers.0.*` the midlayer, `d2t`, `t2d`; no d2t/t2d for a whole-vocabulary draft), which
  speculators' `Eagle3DraftModel` and vLLM's Eagle3LlamaForCausalLM both load as they are (vLLM renames `d2t` ->
  `draft_id_to_target_id`, skips `t2d`). A deeper drafter (num_layers N > 1; SGLang loads one layer and is refused)
  adds `layers.i.*`, plain Llama layers on H, and `num_hidden_layers` N (vLLM's llama_eagle3 builds layers 1.. with
  H-wide q/k/v as pre-norm Llama layers).

Every export directory says which engine it is for: `hstap_export.json` (`engine`, `layer_convention`) and a README.md.
`vllm_aux_layers(dir)` is the check hstap makes before it hands a directory to vLLM: the layers vLLM will read from it
must be the ones the drafter was trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from hstap.common import HstapError, read_json
from hstap.artifacts.drafter_dir import expected_state, load_drafter
from hstap.layers import from_sglang, from_vllm, to_sglang, to_vllm, vllm_default_ids
from hstap.models.drafter import SPECULATORS_FLAGS, DrafterConfig, Eagle3Drafter, parse_rope

# SGLang's LlamaForCausalLMEagle3 and vLLM's Eagle3LlamaForCausalLM read these names (no embedding: shared from target).
ENGINE_KEYS = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
               "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
               "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
               "norm.weight", "lm_head.weight", "d2t", "t2d")
HF_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
VLLM_NUM_AUX = 3  # vLLM's Eagle3LlamaForCausalLM builds fc with target_hidden_size * 3 inputs (hard-coded)


SPECULATORS_KEYS = tuple(("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k for k in ENGINE_KEYS)
ENGINES = {"sglang": "SGLang (LlamaForCausalLMEagle3)", "vllm": "vLLM and speculators (Eagle3Speculator)",
           "hf": "hstap (hstap eval, hstap export)"}


def engine_state(state: dict[str, torch.Tensor], num_layers: int, names: str = "sglang") -> dict[str, torch.Tensor]:
    """The tensors of an engine export, no embedding: names "sglang" = ENGINE_KEYS (one layer); "speculators" =
    `layers.0.*` for the midlayer (SPECULATORS_KEYS for one layer) and `layers.i.*` plain Llama layers. Without d2t/t2d
    when the draft vocabulary is the whole vocabulary: vLLM then builds no mapping to load them into (and refuses to
    start), SGLang and speculators need none."""
    identity = state["d2t"].numel() == state["t2d"].numel() and not bool(state["d2t"].any())
    if names == "sglang":
        if num_layers != 1:
            raise HstapError(f"SGLang's names hold one decoder layer, this drafter has {num_layers}")
        return {k: state[k] for k in ENGINE_KEYS if not (identity and k in ("d2t", "t2d"))}
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()
            if k != "embed_tokens.weight" and not (identity and k in ("d2t", "t2d"))}


def _rope_fields(cfg: DrafterConfig) -> dict:
    params = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": float(cfg.rope_theta)}
    legacy = None if params["rope_type"] == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    # transformers >= 5 reads rope_parameters; older engines read rope_theta / rope_scaling. They say the same thing.
    return {"rope_theta": float(cfg.rope_theta), "rope_scaling": legacy, "rope_parameters": params}


def llama_fields(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """The LlamaConfig fields describing the drafter's decoder layers (shared by the sglang and vllm configs)."""
    return {
        "model_type": "llama", "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings, **_rope_fields(cfg), "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": HF_DTYPE[dtype], "dtype": HF_DTYPE[dtype],
    }


def sglang_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    flags = [f for f in SPECULATORS_FLAGS if getattr(cfg, f)]
    if flags:
        raise HstapError(f"SGLang's LlamaForCausalLMEagle3 has no {', '.join(flags)} (speculators' variants of this "
                         "drafter): export it with --to vllm")
    ids = to_sglang(cfg.aux_layers, cfg.target_model_type)
    if from_sglang(ids, cfg.target_model_type) != list(cfg.aux_layers):  # the conversion must round-trip exactly
        raise HstapError(f"aux layers {cfg.aux_layers} cannot be expressed in SGLang's convention for "
                         f"{cfg.target_model_type}")
    return {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg, dtype),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            # what vLLM reads (before eagle_config): the same layers in its own convention, so it never reads SGLang's
            "eagle_aux_hidden_state_layer_ids": to_vllm(cfg.aux_layers)}


def vllm_config(cfg: DrafterConfig, dtype: torch.dtype, verifier: str, verifier_arch: list[str], k: int) -> dict:
    layer = {"architectures": ["LlamaForCausalLM"], **llama_fields(cfg, dtype)}
    for key in ("draft_vocab_size", "target_hidden_size"):  # top-level speculators fields, copied over by vLLM
        layer.pop(key)
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "eagle_aux_hidden_state_layer_ids": to_vllm(cfg.aux_layers),
        # vLLM defaults norm_before_residual to True when the key is absent: every switch is written, hstap's layout off
        **{f: bool(getattr(cfg, f)) for f in SPECULATORS_FLAGS},
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": verifier_arch},
        },
        "torch_dtype": HF_DTYPE[dtype], "dtype": HF_DTYPE[dtype],
    }


def vllm_reads(conf: dict) -> list[int] | None:
    """The `eagle_aux_hidden_state_layer_ids` vLLM (0.32, gpu_model_runner) takes from a drafter config: the top-level
    key, else `eagle_config`'s; None = none (vLLM then taps its default (2, N//2, N-3))."""
    ids = conf.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(conf.get("eagle_config"), dict):
        ids = conf["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if isinstance(ids, list) and ids else None


def vllm_aux_layers(path: str | Path, num_layers: int) -> list[int]:
    """The canonical layers vLLM will tap for the drafter directory `path` (an export with a config.json), refused
    with one line when they are not the layers the drafter was trained on (its hstap_export.json), e.g. an SGLang-only
    config whose ids vLLM would read one layer early."""
    p = Path(path)
    conf = read_json(p / "config.json")
    info = read_json(p / "hstap_export.json") if (p / "hstap_export.json").is_file() else {}
    ids = vllm_reads(conf)
    read = from_vllm(ids or vllm_default_ids(num_layers), num_layers)
    trained = info.get("aux_layers")
    if trained is None and conf.get("speculators_model_type") == "eagle3":
        trained = read  # a speculators checkpoint made elsewhere: its ids are in vLLM's convention by definition
    if trained is None and ids is not None:
        sg = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        trained = from_sglang(sg, info.get("target_model_type", "llama")) if sg else None
    if trained is None or [int(i) for i in trained] != read:
        raise HstapError(f"{p / 'config.json'}: vLLM would tap layers {read} (eagle_aux_hidden_state_layer_ids {ids}, "
                         f"read in vLLM's convention), the drafter was trained on {trained}: export it for vLLM with "
                         "`hstap export --run RUN --to vllm`")
    return read


def export_readme(to: str, aux: list[int], conf: dict) -> str:
    """README.md of an export directory: which engine it is for and how to load it."""
    lines = [f"# EAGLE-3 drafter exported by hstap for {ENGINES[to]}", "",
             f"Trained on the target's layers {list(aux)} (hstap's canonical ids: output of decoder layer i)."]
    if to == "sglang":
        lines += [f"`eagle_config.eagle_aux_hidden_state_layer_ids` {conf['eagle_config']['eagle_aux_hidden_state_layer_ids']}"
                  " is SGLang's convention (SGLang reads it first); the top-level `eagle_aux_hidden_state_layer_ids` "
                  f"{conf['eagle_aux_hidden_state_layer_ids']} is vLLM's (vLLM reads it first).", "",
                  "SGLang: `--speculative-algorithm EAGLE3 --speculative-draft-model-path THIS_DIR`. For vLLM and "
                  "speculators, export with `hstap export --to vllm` (speculators' own format and tensor names)."]
    elif to == "vllm":
        lines += [f"`eagle_aux_hidden_state_layer_ids` {conf['eagle_aux_hidden_state_layer_ids']} is vLLM's "
                  "convention (input of layer j); tensors in speculators' names (`layers.0.*`).", "",
                  "vLLM: `vllm serve TARGET --speculative-config '{\"method\": \"eagle3\", \"model\": \"THIS_DIR\", "
                  "\"num_speculative_tokens\": 3}'` (or `vllm serve THIS_DIR`: the config names its verifier). "
                  "speculators: `Eagle3DraftModel.from_pretrained(THIS_DIR)`. For SGLang, export with "
                  "`hstap export --to sglang`."]
    else:
        lines += ["`hstap eval --drafter THIS_DIR`; `hstap export --run THIS_DIR --to sglang|vllm` for an engine."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# reading an export back (round trips; evaluating SGLang/vLLM-format drafters with hstap eval)


def read_export(path: str | Path) -> tuple[dict, dict, list[int], str, dict]:
    """(config.json, its Llama layer fields, the canonical aux layers, the target's model type, hstap_export.json or
    {}) of an SGLang or speculators export directory: what the engine reads, without its weights. The aux layers come
    from hstap_export.json when present, else from the config's ids (SGLang: `from_sglang`; vLLM: `from_vllm`)."""
    p = Path(path)
    cpath = p / "config.json"
    conf = read_json(cpath)
    info = read_json(p / "hstap_export.json") if (p / "hstap_export.json").is_file() else {}
    mtype = info.get("target_model_type", "llama")
    if conf.get("speculators_model_type") == "eagle3":
        layer = dict(conf["transformer_layer_config"])
        layer.update(draft_vocab_size=conf["draft_vocab_size"], target_hidden_size=conf.get("target_hidden_size"))
        ids = conf.get("eagle_aux_hidden_state_layer_ids") or []
        aux = info["aux_layers"] if "aux_layers" in info else from_vllm(ids)
    elif "LlamaForCausalLMEagle3" in (conf.get("architectures") or []):
        layer = conf
        ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        aux = info.get("aux_layers", from_sglang(ids, mtype) if ids else [])
    else:
        raise HstapError(f"{cpath}: neither an SGLang (LlamaForCausalLMEagle3) nor a speculators eagle3 config")
    return conf, layer, [int(i) for i in aux], mtype, info


def load_exported(path: str | Path, embed_weight: torch.Tensor | None = None, device="cpu",
                  dtype=torch.float32) -> tuple[Eagle3Drafter, dict]:
    """Load an exported directory (sglang, vllm or hf) as an Eagle3Drafter; returns (drafter in eval mode, config.json).

    SGLang/vLLM files hold no embedding: pass the target's `embed_weight` (V, H). Aux layers come from
    hstap_export.json when present, else from the config's ids (SGLang: `from_sglang`; vLLM: `from_vllm`). A
    speculators config's norm_before_fc / norm_before_residual / norm_output are read with vLLM's defaults (False /
    True / False when absent): a checkpoint of speculators' trainer computes here what it computes there.
    """
    p = Path(path)
    if (p / "drafter.safetensors").is_file():
        return load_drafter(p, device=device, dtype=dtype, embed=embed_weight)
    wpath = p / "model.safetensors"
    conf, layer, aux, mtype, _ = read_export(p)
    flags = {}
    if conf.get("speculators_model_type") == "eagle3":
        if conf.get("fc_norm"):
            raise HstapError(f"{p / 'config.json'}: fc_norm (speculators' per-slot norms before fc) is not a layout "
                             "hstap's drafter has")
        # as vLLM reads a speculators config (vllm/transformers_utils/configs/speculators/algos.py: update_eagle3)
        flags = {"norm_before_fc": bool(conf.get("norm_before_fc", False)),
                 "norm_before_residual": bool(conf.get("norm_before_residual", True)),
                 "norm_output": bool(conf.get("norm_output", False))}
    try:
        with safe_open(str(wpath), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 -- missing or corrupt file: one line for the user
        raise HstapError(f"{wpath}: cannot read: {type(e).__name__}: {e}") from None
    if "fc.weight" not in state:
        raise HstapError(f"{wpath}: no fc.weight")
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    ht = layer.get("target_hidden_size") or layer["hidden_size"]
    num_aux = state["fc.weight"].shape[1] // ht  # (H, K*Ht): the file decides K
    theta, scaling = parse_rope(layer)
    dcfg = DrafterConfig(
        hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
        draft_vocab_size=layer.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=ht, num_aux=num_aux,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=layer.get("max_position_embeddings", 2048), hidden_act=layer.get("hidden_act", "silu"),
        target_model_type=mtype, aux_layers=list(aux), num_layers=int(layer.get("num_hidden_layers") or 1), **flags)
    if "d2t" not in state and dcfg.draft_vocab_size == dcfg.vocab_size:  # the identity map (a vLLM export leaves it out)
        state["d2t"] = torch.zeros(dcfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(dcfg.vocab_size, dtype=torch.bool)
    if "embed_tokens.weight" not in state:
        if embed_weight is None:
            raise HstapError(f"{wpath}: no embed_tokens.weight (shared with the target): pass the target's embedding")
        state["embed_tokens.weight"] = embed_weight.detach().to("cpu")
    model = Eagle3Drafter(dcfg)
    want = set(expected_state(dcfg))
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise HstapError(f"{wpath}: missing {missing}, unexpected {extra}")
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in state.items()}, strict=False)
    model.to(device=device, dtype=dtype)
    return model.eval(), conf
