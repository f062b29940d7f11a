"""Drafter checkpoints: hstap's own format (used by train/eval), and export to SGLang, vLLM/speculators, a portable copy.

hstap format (a directory): `drafter.safetensors` (every parameter and buffer of `Eagle3Drafter`, embedding included,
names as in the module) and `drafter.json` ({"format": "hstap-drafter", "version": 1, "config": DrafterConfig,
"vocab_map_sha256": sha256 of the d2t/t2d the lm_head rows were trained with, "store": {...provenance of the training
data: the store manifest header (target fingerprint, layers, dtype, engine)...}}).

`hstap export --run RUN --to sglang|vllm|hf --out DIR` writes one of:

- sglang: config.json for `LlamaForCausalLMEagle3` (llama fields + `eagle_config.eagle_aux_hidden_state_layer_ids` in
  SGLang's convention, `hstap.layers.to_sglang`) and model.safetensors with `fc.weight`, `midlayer.*`, `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d`; no embedding (SGLang shares the target's).
- vllm: a speculators `Eagle3Speculator` config.json (`transformer_layer_config`, `speculators_config` naming the
  verifier, ids in vLLM's convention, `hstap.layers.to_vllm`), so `vllm serve DIR` needs no other flag; the same
  model.safetensors (vLLM maps `midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, skips `t2d`). A deeper
  drafter (num_layers N > 1; SGLang loads one layer and is refused) is written in speculators' names: `layers.0.*` the
  midlayer, `layers.i.*` plain Llama layers on H, `num_hidden_layers` N (vLLM's llama_eagle3 builds layers 1.. with
  H-wide q/k/v and runs them as pre-norm Llama layers).
- hf: the hstap format, embedding included (`load_drafter(DIR)` reads it, for `hstap eval`), plus a config.json that
  describes the model (not loadable by transformers).

Every export also gets `hstap_export.json` (the export's run config and the drafter's provenance): `config.json` is the
engine's model config here, so the run config cannot live there.

Everything is checked before anything is written (one-line HstapError, nothing on disk): exact key set and shapes, finite
weights, the vocab map (hot ids = arange + d2t strictly increasing, inside the vocab, exactly where t2d is true), the
recorded `vocab_map_sha256` (a drafter whose d2t/t2d were swapped after its lm_head was trained would draft wrong
tokens silently), and the aux layers (drafter config == the provenance store's layers == `--store`'s layers). The
output is written to a temp sibling and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hstap.common import HstapError, atomic_write_json, fsync_dir, run_meta
from hstap.drafter import DrafterConfig, Eagle3Drafter, parse_rope
from hstap.layers import from_sglang, from_vllm, to_sglang, to_vllm
from hstap.vocab import check_vocab_map

DRAFTER_FORMAT = "hstap-drafter"
DRAFTER_VERSION = 1
# SGLang's LlamaForCausalLMEagle3 and vLLM's Eagle3LlamaForCausalLM read these names (no embedding: shared from target).
ENGINE_KEYS = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
               "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
               "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
               "norm.weight", "lm_head.weight", "d2t", "t2d")
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HF_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
VLLM_NUM_AUX = 3  # vLLM's Eagle3LlamaForCausalLM builds fc with target_hidden_size * 3 inputs (hard-coded)


# ---------------------------------------------------------------------------------------------------------------------
# hstap format


def vocab_map_sha256(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    """Identity of a draft vocabulary map: sha256 over d2t as little-endian int64 and t2d as uint8 bytes."""
    h = hashlib.sha256()
    h.update(d2t.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes())
    h.update(b"|")
    h.update(t2d.detach().to("cpu", torch.bool).contiguous().numpy().astype("u1").tobytes())
    return h.hexdigest()


def save_drafter(out_dir: str | Path, drafter: Eagle3Drafter, extra: dict | None = None) -> None:
    """Write drafter.safetensors + drafter.json into out_dir (created); each file is written atomically.

    drafter.json records `vocab_map_sha256`: the value in `extra` when the caller passes it (train records the map in
    effect when the lm_head rows started training), else the hash of the drafter's current d2t/t2d buffers.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items() if not k.startswith("rotary.")}
    tmp = out / ".drafter.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": DRAFTER_FORMAT})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(out / "drafter.safetensors")
    fsync_dir(out)
    extra = dict(extra or {})
    extra.setdefault("vocab_map_sha256", vocab_map_sha256(state["d2t"], state["t2d"]))
    atomic_write_json(out / "drafter.json", {"format": DRAFTER_FORMAT, "version": DRAFTER_VERSION,
                                             "config": drafter.config.to_dict(), **extra})


def resolve_drafter_dir(path: str | Path) -> Path:
    """A drafter dir, or a training RUN dir (its `best`, else its newest checkpoint)."""
    p = Path(path)
    if (p / "drafter.safetensors").exists():
        return p
    if (p / "best" / "drafter.safetensors").exists():
        return p / "best"
    ckpts = sorted((p / "checkpoints").glob("step_*")) if (p / "checkpoints").is_dir() else []
    ckpts = [c for c in ckpts if (c / "drafter.safetensors").exists()]
    if ckpts:
        return ckpts[-1]
    raise HstapError(f"{p}: no drafter found (expected drafter.safetensors, RUN/best/ or RUN/checkpoints/step_*/)")


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> tuple[Eagle3Drafter, dict]:
    """Load an hstap-format drafter (or a RUN's best/latest); returns (drafter in eval mode, drafter.json dict)."""
    d = resolve_drafter_dir(path)
    try:
        meta = json.loads((d / "drafter.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HstapError(f"{d / 'drafter.json'}: cannot read: {e}") from None
    if meta.get("format") != DRAFTER_FORMAT:
        raise HstapError(f"{d / 'drafter.json'}: not an hstap drafter (format={meta.get('format')!r})")
    cfg = DrafterConfig.from_dict(meta["config"])
    model = Eagle3Drafter(cfg)
    state = load_file(str(d / "drafter.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise HstapError(f"{d / 'drafter.safetensors'}: missing keys {missing}, unexpected keys {unexpected}")
    model.to(device=device, dtype=dtype)
    return model.eval(), meta


# ---------------------------------------------------------------------------------------------------------------------
# validation


def expected_state(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, dtype or None for "any float") of every tensor in an hstap drafter checkpoint: the state dict of
    an `Eagle3Drafter(cfg)` built on the meta device (no memory), rotary buffers aside."""
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    return {k: (tuple(v.shape), None if v.dtype.is_floating_point else v.dtype)
            for k, v in model.state_dict().items() if not k.startswith("rotary.")}


def engine_state(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The tensors of an engine export: ENGINE_KEYS for one layer; a deeper drafter in speculators' names, which vLLM's
    Eagle3LlamaForCausalLM loads as they are: `layers.0.*` = the midlayer, `layers.i.*` plain Llama layers (no embed)."""
    if num_layers == 1:
        return {k: state[k] for k in ENGINE_KEYS}
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()
            if k != "embed_tokens.weight"}


def _read_checkpoint(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    jpath, wpath = d / "drafter.json", d / "drafter.safetensors"
    try:
        meta = json.loads(jpath.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HstapError(f"{jpath}: cannot read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != DRAFTER_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise HstapError(f"{jpath}: not an hstap drafter (format={fmt!r})")
    if not isinstance(meta.get("config"), dict):
        raise HstapError(f"{jpath}: config: missing")
    try:
        state = load_file(str(wpath))
    except Exception as e:  # noqa: BLE001 -- a truncated/corrupt file can fail in many ways; one line for the user
        raise HstapError(f"{wpath}: cannot read: {type(e).__name__}: {e}") from None
    return meta, state


def _store_layers(meta: dict) -> list[int] | None:
    s = meta.get("store")
    layers = s.get("layers") if isinstance(s, dict) else None
    return [int(i) for i in layers] if isinstance(layers, list) else None


def validate_checkpoint(d: Path, meta: dict, state: dict[str, torch.Tensor], store: str | None = None) -> DrafterConfig:
    """Every export refusal (see the module docstring); returns the drafter config. Writes nothing."""
    wpath, jpath = d / "drafter.safetensors", d / "drafter.json"
    try:
        cfg = DrafterConfig.from_dict(meta["config"])
    except TypeError as e:
        raise HstapError(f"{jpath}: config: {e}") from None
    want = expected_state(cfg)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise HstapError(f"{wpath}: tensor names differ from an hstap drafter: missing {missing}, unexpected {extra}")
    for name, (shape, dt) in want.items():
        t = state[name]
        if tuple(t.shape) != shape:
            raise HstapError(f"{wpath}: {name}: shape {tuple(t.shape)} != {shape} expected from drafter.json's config")
        if dt is not None and t.dtype != dt:
            raise HstapError(f"{wpath}: {name}: dtype {t.dtype} != {dt}")
        if dt is None and not t.dtype.is_floating_point:
            raise HstapError(f"{wpath}: {name}: expected a float tensor, got {t.dtype}")
        if dt is None and not bool(torch.isfinite(t).all()):
            raise HstapError(f"{wpath}: {name}: non-finite values (NaN/Inf)")
    try:
        check_vocab_map(state["d2t"], state["t2d"], cfg.vocab_size)
    except HstapError as e:
        raise HstapError(f"{wpath}: {e}") from None
    recorded, actual = meta.get("vocab_map_sha256"), vocab_map_sha256(state["d2t"], state["t2d"])
    if recorded is None:
        raise HstapError(f"{jpath}: vocab_map_sha256: missing, so the d2t/t2d cannot be checked against the map the "
                         "lm_head was trained with (save checkpoints with hstap.export.save_drafter)")
    if recorded != actual:
        raise HstapError(f"{jpath}: vocab_map_sha256: the checkpoint's d2t/t2d (sha256 {actual[:12]}) differ from the "
                         f"vocab map its lm_head rows were trained with ({str(recorded)[:12]}); its drafts would map to "
                         "the wrong target tokens")
    layers = list(cfg.aux_layers)
    if len(layers) != cfg.num_aux and layers:
        raise HstapError(f"{jpath}: config: aux_layers {layers} has {len(layers)} ids but num_aux is {cfg.num_aux}")
    prov = _store_layers(meta)
    if prov is not None and prov != layers:
        raise HstapError(f"{jpath}: config.aux_layers {layers} != store.layers {prov} of the store it was trained on")
    if store is not None:
        from hstap.store.reader import open_store
        m = open_store(store).manifest
        stored = [int(i) for i in m["layers"]]
        # train may fuse a subset of the store's layers: it records them as store.layers, the store's as captured_layers
        captured = (meta.get("store") or {}).get("captured_layers")
        if captured is not None and [int(i) for i in captured] != stored:
            raise HstapError(f"{store}: layers {stored} != captured_layers {captured} of the store the drafter was "
                             f"trained on ({jpath})")
        if captured is None and stored != layers or not set(layers) <= set(stored):
            raise HstapError(f"{store}: layers {stored} != the drafter's aux layers {layers} ({jpath}: config.aux_layers)")
        if int(m["hidden_size"]) != cfg.target_hidden_size:
            raise HstapError(f"{store}: hidden_size {m['hidden_size']} != the drafter's target_hidden_size "
                             f"{cfg.target_hidden_size}")
        a = ((meta.get("store") or {}).get("target") or {}).get("config_sha256")
        b = (m.get("target") or {}).get("config_sha256")
        if a and b and a != b:
            raise HstapError(f"{store}: target.config_sha256 {b[:12]} != {a[:12]} of the store the drafter was trained on")
    return cfg


# ---------------------------------------------------------------------------------------------------------------------
# configs


@dataclass
class ExportConfig:
    run: str
    """A training RUN directory (its best/, else newest checkpoint) or a drafter directory in the hstap format."""
    to: str = field(metadata={"choices": ["sglang", "vllm", "hf"]})
    """Target format: sglang (LlamaForCausalLMEagle3), vllm (speculators Eagle3Speculator), hf (hstap format + config)."""
    out: str
    """Output directory (written to a temp sibling, then renamed; must not exist unless --overwrite)."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "bf16", "fp32"]})
    """Weight dtype: auto = bf16 for sglang/vllm, the checkpoint's own dtype for hf (so eval sees the same logits)."""
    store: str | None = None
    """Optional store path: refuse unless its layers (and hidden size, target) are the ones the drafter was trained on."""
    target: str | None = None
    """Optional target model directory: verifier name/architectures for vllm, and a check of vocab/hidden sizes."""
    speculative_tokens: int = 3
    """vllm only: speculative_tokens of the greedy proposal method (vLLM's default num_speculative_tokens)."""
    overwrite: bool = False
    """Replace an existing output directory (the old one is removed only after the new one is in place)."""

    def __post_init__(self):
        if self.to not in ("sglang", "vllm", "hf"):
            raise HstapError(f"export: to: expected sglang, vllm or hf, got {self.to!r}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise HstapError(f"export: dtype: expected auto, bf16 or fp32, got {self.dtype!r}")
        if self.speculative_tokens < 1:
            raise HstapError(f"export: speculative_tokens: must be >= 1, got {self.speculative_tokens}")


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
    ids = to_sglang(cfg.aux_layers, cfg.target_model_type)
    if from_sglang(ids, cfg.target_model_type) != list(cfg.aux_layers):  # the conversion must round-trip exactly
        raise HstapError(f"aux layers {cfg.aux_layers} cannot be expressed in SGLang's convention for "
                         f"{cfg.target_model_type}")
    return {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg, dtype),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def vllm_config(cfg: DrafterConfig, dtype: torch.dtype, verifier: str, verifier_arch: list[str], k: int) -> dict:
    layer = {"architectures": ["LlamaForCausalLM"], **llama_fields(cfg, dtype)}
    for key in ("draft_vocab_size", "target_hidden_size"):  # top-level speculators fields, copied over by vLLM
        layer.pop(key)
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "eagle_aux_hidden_state_layer_ids": to_vllm(cfg.aux_layers),
        # vLLM defaults norm_before_residual to True when the key is absent; hstap's residual is the un-normed fc output.
        "norm_before_residual": False, "norm_before_fc": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": verifier_arch},
        },
        "torch_dtype": HF_DTYPE[dtype], "dtype": HF_DTYPE[dtype],
    }


def _target_info(cfg: ExportConfig, dcfg: DrafterConfig, meta: dict) -> tuple[str | None, list[str]]:
    """(verifier path, architectures) from --target, else from the provenance store's target block."""
    path = cfg.target or ((meta.get("store") or {}).get("target") or {}).get("path")
    if path is None:
        return None, []
    cpath = Path(path) / "config.json"
    if not cpath.is_file():
        if cfg.target is not None:
            raise HstapError(f"{cfg.target}: target: no config.json")
        return str(path), []  # the provenance path may only exist on the serving machine
    try:
        tc = json.loads(cpath.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HstapError(f"{cpath}: cannot read: {e}") from None
    if cfg.target is not None:
        tc_text = tc.get("text_config", tc) if isinstance(tc.get("text_config"), dict) else tc
        for key, mine in (("vocab_size", dcfg.vocab_size), ("hidden_size", dcfg.target_hidden_size)):
            if key in tc_text and int(tc_text[key]) != mine:
                raise HstapError(f"{cpath}: {key} {tc_text[key]} != the drafter's {mine}: not the target it was "
                                 "trained for")
    return str(path), list(tc.get("architectures") or [])


# ---------------------------------------------------------------------------------------------------------------------
# export


def _write_safetensors(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    save_file(state, str(path), metadata=metadata)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished temp dir into place; an existing `out` (overwrite) is moved aside first, removed last."""
    fsync_dir(tmp)
    old = None
    if out.exists():
        if not overwrite:
            raise HstapError(f"{out}: exists (pass --overwrite to replace it)")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(cfg: ExportConfig) -> dict:
    """Validate the drafter, then write the chosen format to cfg.out (see the module docstring); returns a summary."""
    d = resolve_drafter_dir(cfg.run)
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise HstapError(f"{out}: exists (pass --overwrite to replace it)")
    meta, state = _read_checkpoint(d)
    dcfg = validate_checkpoint(d, meta, state, cfg.store)
    src_dtype = state["lm_head.weight"].dtype
    dtype = DTYPE_NAMES[cfg.dtype] if cfg.dtype != "auto" else (src_dtype if cfg.to == "hf" else torch.bfloat16)
    if cfg.to in ("sglang", "vllm") and not dcfg.aux_layers:
        raise HstapError(f"{d / 'drafter.json'}: this drafter reads only the target's final state (EAGLE-1 style, no aux "
                         f"layers); {cfg.to} serves EAGLE-3 drafters, which fuse captured layers: export --to hf instead")
    if cfg.to == "sglang" and dcfg.num_layers > 1:
        raise HstapError(f"{d / 'drafter.json'}: SGLang's LlamaForCausalLMEagle3 loads one decoder layer and this "
                         f"drafter has {dcfg.num_layers} (--draft-layers): export --to vllm or --to hf instead")
    if cfg.to == "vllm" and dcfg.num_aux != VLLM_NUM_AUX:
        raise HstapError(f"{d / 'drafter.json'}: vLLM's Eagle3LlamaForCausalLM fuses exactly {VLLM_NUM_AUX} aux layers; "
                         f"this drafter has {dcfg.num_aux} ({dcfg.aux_layers})")
    verifier, arch = _target_info(cfg, dcfg, meta)
    if cfg.to == "sglang":
        conf = sglang_config(dcfg, dtype)
    elif cfg.to == "vllm":
        if verifier is None:
            raise HstapError("export --to vllm: the verifier path is unknown (the drafter has no store provenance): "
                             "pass --target")
        conf = vllm_config(dcfg, dtype, verifier, arch, cfg.speculative_tokens)
    else:
        conf = {"architectures": ["HstapEagle3Drafter"], "format": DRAFTER_FORMAT, **llama_fields(dcfg, dtype),
                "aux_layers": list(dcfg.aux_layers), "target_model_type": dcfg.target_model_type}

    cast = {k: (v.to(dtype) if v.dtype.is_floating_point else v).contiguous() for k, v in state.items()}
    provenance = {k: v for k, v in meta.items() if k not in ("format", "version", "config")}
    info = {**run_meta("export", cfg), "source": str(d), "format": cfg.to, "aux_layers": list(dcfg.aux_layers),
            "target_model_type": dcfg.target_model_type, "drafter_config": dcfg.to_dict(), "provenance": provenance}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if cfg.to == "hf":
            _write_safetensors(tmp / "drafter.safetensors", cast, {"format": DRAFTER_FORMAT})
            atomic_write_json(tmp / "drafter.json", {**meta, "export": {"source": str(d)}})
            weights = "drafter.safetensors"
        else:
            _write_safetensors(tmp / "model.safetensors", engine_state(cast, dcfg.num_layers), {"format": "pt"})
            weights = "model.safetensors"
        atomic_write_json(tmp / "config.json", conf)
        atomic_write_json(tmp / "hstap_export.json", info)
        _publish(tmp, out, cfg.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = {"out": str(out), "format": cfg.to, "source": str(d), "dtype": HF_DTYPE[dtype], "weights": weights,
               "aux_layers": list(dcfg.aux_layers),
               "tensors": len(engine_state(cast, dcfg.num_layers)) if cfg.to != "hf" else len(cast)}
    if cfg.to == "sglang":
        summary["eagle_aux_hidden_state_layer_ids"] = conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    elif cfg.to == "vllm":
        summary["eagle_aux_hidden_state_layer_ids"] = conf["eagle_aux_hidden_state_layer_ids"]
    print(f"exported {d} -> {out} ({cfg.to}, {summary['dtype']}, aux layers {dcfg.aux_layers}"
          + (f" = {cfg.to} ids {summary['eagle_aux_hidden_state_layer_ids']}" if cfg.to != "hf" else "") + ")")
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# reading an export back (round trips; evaluating SGLang/vLLM-format drafters with hstap eval)


def load_exported(path: str | Path, embed_weight: torch.Tensor | None = None, device="cpu",
                  dtype=torch.float32) -> tuple[Eagle3Drafter, dict]:
    """Load an exported directory (sglang, vllm or hf) as an Eagle3Drafter; returns (drafter in eval mode, config.json).

    SGLang/vLLM files hold no embedding: pass the target's `embed_weight` (V, H). Aux layers come from
    hstap_export.json when present, else from the config's ids (SGLang: `from_sglang`; vLLM: `from_vllm`).
    """
    p = Path(path)
    if (p / "drafter.safetensors").is_file():
        return load_drafter(p, device=device, dtype=dtype)
    cpath, wpath = p / "config.json", p / "model.safetensors"
    try:
        conf = json.loads(cpath.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HstapError(f"{cpath}: cannot read: {e}") from None
    info = json.loads((p / "hstap_export.json").read_text()) if (p / "hstap_export.json").is_file() else {}
    if conf.get("speculators_model_type") == "eagle3":
        layer = dict(conf["transformer_layer_config"])
        layer.update(draft_vocab_size=conf["draft_vocab_size"], target_hidden_size=conf.get("target_hidden_size"))
        ids = conf.get("eagle_aux_hidden_state_layer_ids") or []
        mtype = info.get("target_model_type", "llama")
        aux = info["aux_layers"] if "aux_layers" in info else from_vllm(ids)
    elif "LlamaForCausalLMEagle3" in (conf.get("architectures") or []):
        layer = conf
        mtype = info.get("target_model_type", "llama")
        ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        aux = info.get("aux_layers", from_sglang(ids, mtype) if ids else [])
    else:
        raise HstapError(f"{cpath}: neither an SGLang (LlamaForCausalLMEagle3) nor a speculators eagle3 config")
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
        target_model_type=mtype, aux_layers=list(aux), num_layers=int(layer.get("num_hidden_layers") or 1))
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
