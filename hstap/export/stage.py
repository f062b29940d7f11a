"""`hstap export`: a trained drafter -> SGLang, vLLM/speculators, or a portable hstap-format copy, validated.

    hstap export --run RUN --to sglang|vllm|hf --out DIR [--store STORE] [--target TARGET]

- sglang / vllm: the engine's config.json and model.safetensors (`hstap/export/engines.py` says what each holds);
- hf: the hstap format (`hstap/artifacts/drafter_dir.py`), embedding included (`load_drafter(DIR)` reads it, for `hstap
  eval`; a training checkpoint keeps the target's embedding out, and the export reads it back from --target, else the
  target directory the checkpoint records, checked against its sha256), plus a config.json that describes the model
  (not loadable by transformers).

Every export also gets `hstap_export.json` (the export's run config and the drafter's provenance): `config.json` is the
engine's model config here, so the run config cannot live there.

Everything is checked before anything is written (`drafter_dir.validate_checkpoint`: one-line HstapError, nothing on
disk). The output is written to a temp sibling and renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hstap.common import HstapError, atomic_write_bytes, atomic_write_json, publishing_dir, read_json, run_meta
from hstap.artifacts.drafter_dir import (DRAFTER_FORMAT, read_checkpoint, resolve_drafter_dir, restore_embedding,
                               validate_checkpoint)
from hstap.export.config import ExportConfig
from hstap.export.engines import (ENGINES, HF_DTYPE, VLLM_NUM_AUX, engine_state, export_readme, llama_fields,
                                  sglang_config, vllm_config)
from hstap.export.fit import check_drafter_target
from hstap.models.drafter import DrafterConfig
from hstap.artifacts.outputs import check_not_input, check_out_dir

DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
    tc = read_json(cpath)
    if cfg.target is not None:
        tc_text = tc.get("text_config", tc) if isinstance(tc.get("text_config"), dict) else tc
        check_drafter_target(resolve_drafter_dir(cfg.run), {"path": str(path), "vocab_size": tc_text.get("vocab_size"),
                                                            "hidden_size": tc_text.get("hidden_size"),
                                                            "num_layers": tc_text.get("num_hidden_layers")})
    return str(path), list(tc.get("architectures") or [])


# ---------------------------------------------------------------------------------------------------------------------
# export


def _write_safetensors(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    save_file(state, str(path), metadata=metadata)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def export(cfg: ExportConfig) -> dict:
    """Validate the drafter, then write the chosen format to cfg.out (see the module docstring); returns a summary."""
    d = resolve_drafter_dir(cfg.run)
    out = Path(cfg.out)
    check_not_input(out, [("--run", d), ("--store", cfg.store), ("--target", cfg.target)])
    check_out_dir(out, "export", cfg.overwrite)
    meta, state = read_checkpoint(d)
    if cfg.to == "hf":  # the portable format holds the embedding a training checkpoint keeps out (the target's)
        restore_embedding(d, meta, state, target=cfg.target)
        meta = {k: v for k, v in meta.items() if k != "embedding"}
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
    tensors = cast if cfg.to == "hf" else engine_state(cast, dcfg.num_layers, "sglang" if cfg.to == "sglang"
                                                       else "speculators")
    provenance = {k: v for k, v in meta.items() if k not in ("format", "version", "config")}
    info = {**run_meta("export", cfg), "source": str(d), "format": cfg.to, "engine": ENGINES[cfg.to],
            "layer_convention": {"sglang": "sglang (eagle_config), vllm (top level)", "vllm": "vllm",
                                 "hf": "hstap canonical"}[cfg.to], "aux_layers": list(dcfg.aux_layers),
            "target_model_type": dcfg.target_model_type, "drafter_config": dcfg.to_dict(), "provenance": provenance}

    # An --out that passed check_out_dir (empty, or an earlier export with --overwrite) is moved aside, the new one
    # renamed into place, the old one removed; one that appeared since is refused
    existing = "aside" if out.exists() else "refuse"
    with publishing_dir(out, existing, "appeared while exporting; the export is not moved there") as tmp:
        if cfg.to == "hf":
            _write_safetensors(tmp / "drafter.safetensors", cast, {"format": DRAFTER_FORMAT})
            atomic_write_json(tmp / "drafter.json", {**meta, "export": {"source": str(d)}})
            weights = "drafter.safetensors"
        else:
            _write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
            weights = "model.safetensors"
        atomic_write_json(tmp / "config.json", conf)
        atomic_write_json(tmp / "hstap_export.json", info)
        atomic_write_bytes(tmp / "README.md", export_readme(cfg.to, dcfg.aux_layers, conf).encode())
    summary = {"out": str(out), "format": cfg.to, "source": str(d), "dtype": HF_DTYPE[dtype], "weights": weights,
               "aux_layers": list(dcfg.aux_layers),
               "engine": ENGINES[cfg.to], "tensors": len(tensors)}
    if cfg.to == "sglang":
        summary["eagle_aux_hidden_state_layer_ids"] = conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    elif cfg.to == "vllm":
        summary["eagle_aux_hidden_state_layer_ids"] = conf["eagle_aux_hidden_state_layer_ids"]
    print(f"exported {d} -> {out} ({cfg.to}, {summary['dtype']}, aux layers {dcfg.aux_layers}"
          + (f" = {cfg.to} ids {summary['eagle_aux_hidden_state_layer_ids']}" if cfg.to != "hf" else "") + ")")
    return summary
