"""The hstap drafter directory: what `hstap train` writes (RUN/best/, RUN/checkpoints/step_*/) and `hstap eval` and
`hstap export` read.

A directory of `drafter.safetensors` (every parameter and buffer of `Eagle3Drafter`, names as in the module) and
`drafter.json` ({"format": "hstap-drafter", "version": 1, "config": DrafterConfig, "vocab_map_sha256": sha256 of the
d2t/t2d the lm_head rows were trained with, "store": {...provenance of the training data: the store manifest header
(target fingerprint, layers, dtype, engine)...}}).

The embedding (`embed_tokens.weight`) is the target's, copied and frozen: a training checkpoint (RUN/checkpoints/*,
RUN/best) keeps it out, since it is the largest tensor of a drafter over a large vocabulary and the target holds it
(SmolLM2's, 49,152 x 576 in fp32: 113 MB of a 200 MB best/), and drafter.json records where it comes from:
"embedding": {"from": "target", "path": the target directory, "shape", "dtype", "sha256" of its bytes}. Loading puts
the target's back (`restore_embedding`: the target given, else the recorded path), checked against that sha256: a
drafter loaded with another target's embedding is refused by name. The engines' exports hold no embedding either
(SGLang and vLLM share the target's); `hstap export --to hf` writes it back in.

`validate_checkpoint` is every check an export makes before it writes anything (one-line HstapError): exact key set and
shapes, finite weights, the vocab map (hot ids = arange + d2t strictly increasing, inside the vocab, exactly where t2d is
true), the recorded `vocab_map_sha256` (a drafter whose d2t/t2d were swapped after its lm_head was trained would draft
wrong tokens silently), and the aux layers (drafter config == the provenance store's layers == `--store`'s layers).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hstap.common import HstapError, atomic_write_json, fsync_dir, read_json
from hstap.artifacts.vocab_map import check_vocab_map, vocab_map_sha256
from hstap.models.drafter import DrafterConfig, Eagle3Drafter

DRAFTER_FORMAT = "hstap-drafter"
DRAFTER_VERSION = 1


EMBEDDING = "embed_tokens.weight"
"""The drafter's input embedding: the target's, frozen (module docstring: a training checkpoint keeps it out)."""


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (its dtype, row-major)."""
    b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(b.numpy()).hexdigest()


def kept_out(meta: dict) -> dict | None:
    """drafter.json's record of an embedding left out of the weights (it is the target's), or None."""
    rec = meta.get("embedding") if isinstance(meta, dict) else None
    return rec if isinstance(rec, dict) and rec.get("from") == "target" else None


def check_embedding(d: Path, rec: dict, embed: torch.Tensor) -> torch.Tensor:
    """The target's embedding `embed` in the recorded dtype, once its shape and sha256 are the recorded ones (the
    embedding the drafter was trained with); HstapError naming drafter.json otherwise."""
    dtype = getattr(torch, str(rec.get("dtype", "float32")).replace("torch.", ""))
    e = embed.detach().to("cpu", dtype).contiguous()
    if list(e.shape) != list(rec.get("shape", [])) or tensor_sha256(e) != rec.get("sha256"):
        raise HstapError(f"{d / 'drafter.json'}: embedding: the target's embedding here ({tuple(e.shape)}, sha256 "
                         f"{tensor_sha256(e)[:12]}) is not the one the drafter was trained with "
                         f"({tuple(rec.get('shape', []))}, sha256 {str(rec.get('sha256'))[:12]}, from "
                         f"{rec.get('path')}): give the target it was trained on")
    return e


def restore_embedding(d: Path, meta: dict, state: dict, embed: torch.Tensor | None = None,
                      target: str | None = None) -> None:
    """Put the target's embedding into `state` when the checkpoint in `d` kept it out: `embed` (a loaded target's),
    else read from `target`, else from the recorded target directory; checked by `check_embedding`."""
    rec = kept_out(meta)
    if rec is None or EMBEDDING in state:
        return
    if embed is None:
        src = target or rec.get("path")
        if not src or not (Path(src) / "config.json").is_file():
            raise HstapError(f"{d / 'drafter.json'}: embedding: kept out of the checkpoint (the target's, frozen) and "
                             f"its target {src} is not here: pass the target it was trained on (--target)")
        from hstap.artifacts.model_dir import target_head
        embed = target_head(src)[0]
    state[EMBEDDING] = check_embedding(d, rec, embed)


def save_drafter(out_dir: str | Path, drafter: Eagle3Drafter, extra: dict | None = None) -> None:
    """Write drafter.safetensors + drafter.json into out_dir (created); each file is written atomically.

    drafter.json records `vocab_map_sha256`: the value in `extra` when the caller passes it (train records the map in
    effect when the lm_head rows started training), else the hash of the drafter's current d2t/t2d buffers. An
    `extra["embedding"]` of {"from": "target", "path": TARGET} (train's) leaves the embedding out and records its
    shape, dtype and sha256 (module docstring).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items() if not k.startswith("rotary.")}
    extra = dict(extra or {})
    if kept_out(extra) is not None:
        e = state.pop(EMBEDDING)
        extra["embedding"] = {**extra["embedding"], "shape": list(e.shape), "dtype": str(e.dtype).replace("torch.", ""),
                              "sha256": tensor_sha256(e)}
    tmp = out / ".drafter.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": DRAFTER_FORMAT})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(out / "drafter.safetensors")
    fsync_dir(out)
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


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32, embed: torch.Tensor | None = None,
                 target: str | None = None) -> tuple[Eagle3Drafter, dict]:
    """Load an hstap-format drafter (or a RUN's best/latest); returns (drafter in eval mode, drafter.json dict). A
    checkpoint without its embedding gets the target's (`restore_embedding`: `embed`, else `target`'s)."""
    d = resolve_drafter_dir(path)
    meta = read_json(d / "drafter.json")
    if meta.get("format") != DRAFTER_FORMAT:
        raise HstapError(f"{d / 'drafter.json'}: not an hstap drafter (format={meta.get('format')!r})")
    cfg = DrafterConfig.from_dict(meta["config"])
    model = Eagle3Drafter(cfg)
    state = load_file(str(d / "drafter.safetensors"))
    restore_embedding(d, meta, state, embed, target)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise HstapError(f"{d / 'drafter.safetensors'}: missing keys {missing}, unexpected keys {unexpected}")
    model.to(device=device, dtype=dtype)
    return model.eval(), meta


def expected_state(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, dtype or None for "any float") of every tensor in an hstap drafter checkpoint: the state dict of
    an `Eagle3Drafter(cfg)` built on the meta device (no memory), rotary buffers aside."""
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    return {k: (tuple(v.shape), None if v.dtype.is_floating_point else v.dtype)
            for k, v in model.state_dict().items() if not k.startswith("rotary.")}


# ---------------------------------------------------------------------------------------------------------------------
# validation


def read_checkpoint(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    jpath, wpath = d / "drafter.json", d / "drafter.safetensors"
    meta = read_json(jpath)
    if meta.get("format") != DRAFTER_FORMAT:
        raise HstapError(f"{jpath}: not an hstap drafter (format={meta.get('format')!r})")
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
    if kept_out(meta) is not None and EMBEDDING not in state:
        want.pop(EMBEDDING)  # the target's (module docstring)
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
                         "lm_head was trained with (save checkpoints with hstap.artifacts.drafter_dir.save_drafter)")
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
