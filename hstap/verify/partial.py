"""Checking a target too large to load: only the layers the check needs.

A recomputation of a stored aux state of layer L needs the embedding and decoder layers 0..L, nothing above; the final
state needs every layer. For a target whose weights do not fit the memory budget (Kimi-K2.5: ~1T parameters), verify
loads the embedding and the longest prefix of layers that fits and holds a stored aux layer, and checks the aux slots
inside it; the slots above it and the final state are skipped, and the report says which and why
(`Plan.skipped`). Nothing else changes: the same recomputation, tolerances and verdicts.

How only those tensors are read: `view` writes a directory beside nothing of the target's own, whose config.json says
the prefix's layer count and whose safetensors index lists only the tensors outside the decoder layers (embedding,
final norm, lm_head) and those of layers 0..D, the shard files linked from the target. transformers opens only the
files that index names, and takes from them only the model's own tensors; a shard file holding no needed tensor is
never opened (tests/test_verify_partial.py proves it on a target whose other shards are cut short after their header:
opened as safetensors, they would fail).

The budget: `VerifyConfig.load_gb`, default half the memory the device has free now. A layer's cost is its tensors'
elements in the recomputation's dtype (INT4 packed words count 8 elements each: transformers unpacks them at load),
times the copies the check holds (the twin of `hstap.verify.twin` adds one in the other precision).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hstap.common import HstapError

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name belongs to, or None (embedding, final norm, lm_head, a vision tower)."""
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


def tensor_elements(target_dir: str | os.PathLike) -> dict[str, int]:
    """Tensor name -> the elements it holds once loaded (an INT4 `weight_packed` int32 word holds 8), from the
    safetensors headers only (the 8-byte length and the JSON after it: no file is opened as tensors)."""
    from hstap.artifacts.model_dir import tensor_files

    _, files = tensor_files(Path(target_dir))
    out: dict[str, int] = {}
    for f in sorted({Path(f) for f in files.values()}):
        with open(f, "rb") as fh:
            try:
                head = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            except (ValueError, MemoryError, OverflowError) as e:
                raise HstapError(f"{f}: not a safetensors file (its header: {type(e).__name__})") from None
        for k, v in head.items():
            if k != "__metadata__" and files.get(k) is not None and Path(files[k]) == f:
                n = 1
                for d in v["shape"]:
                    n *= int(d)
                out[k] = n * (8 if k.endswith("weight_packed") else 1)
    return out


def free_bytes(device: torch.device) -> int:
    """Memory the device has free now (CUDA: mem_get_info; CPU: MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as fh:
        return next(int(x.split()[1]) * 1024 for x in fh if x.startswith("MemAvailable:"))


@dataclass(frozen=True)
class Plan:
    """What a recomputation loads."""

    layers: int
    """Decoder layers loaded (0..layers-1); the target's count when it is loaded whole."""
    total: int
    """The target's decoder layers."""
    need_gb: float
    """Memory the whole target would take for the check (all copies)."""
    budget_gb: float
    """The memory budget the plan fits."""
    skipped: list[str] = field(default_factory=list)
    """Slots not checked ("layer 57", "final")."""
    twin: bool = True
    """The twin (hstap.verify.twin) fits beside the loaded layers; False: left out so that a stored layer fits at all
    (no noise floor, no routing-flip count: the static tolerances alone)."""

    @property
    def whole(self) -> bool:
        return self.layers == self.total

    def note(self) -> str:
        return (f"only the embedding and layers 0-{self.layers - 1} of {self.total} were loaded: the whole target needs "
                f"{self.need_gb:.1f} GB for this check, over the {self.budget_gb:.1f} GB budget (--load-gb); not "
                f"checked: {', '.join(self.skipped)} (they need the layers above)"
                + ("" if self.twin else "; no twin in the other precision fits beside them: no noise floor and no "
                   "routing-flip count, the static tolerances alone"))


def plan(target_dir: str, num_layers: int, stored: list[int], elem_bytes: float, budget: float) -> Plan:
    """The longest prefix of decoder layers, holding at least the lowest stored layer, whose tensors (plus every tensor
    outside the layers) fit `budget` bytes at `elem_bytes` per element; the whole target when it fits."""
    sizes = tensor_elements(target_dir)
    per_layer = [0] * num_layers
    rest = 0
    for k, n in sizes.items():
        i = layer_of(k)
        if i is None:
            rest += n
        elif i < num_layers:  # a DeepSeek MTP layer (id N) is never loaded
            per_layer[i] += n
    need = (rest + sum(per_layer)) * elem_bytes
    gb = 1e9
    if need <= budget:
        return Plan(num_layers, num_layers, need / gb, budget / gb)
    used, fits = rest * elem_bytes, 0
    for i in range(num_layers):
        used += per_layer[i] * elem_bytes
        if used > budget:
            break
        fits = i + 1
    upto = max((L for L in stored if L < fits), default=None)
    if upto is None:
        low = min(stored)
        cost = (rest + sum(per_layer[: low + 1])) * elem_bytes
        raise HstapError(f"{target_dir}: even its stored layer {low} cannot be checked within the {budget / gb:.1f} GB "
                         f"budget: the embedding and layers 0-{low} need {cost / gb:.1f} GB (--load-gb, or "
                         "--skip-verify to train unchecked)")
    skipped = [f"layer {L}" for L in stored if L > upto] + ["final"]
    return Plan(upto + 1, num_layers, need / gb, budget / gb, skipped)


def view(target_dir: str, layers: int, out: Path) -> Path:
    """A directory at `out` that transformers loads as `target_dir`'s first `layers` decoder layers (module
    docstring); its files are links to the target's, but config.json and the index."""
    from hstap.artifacts.model_dir import tensor_files

    src = Path(target_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    conf = json.loads((src / "config.json").read_text())
    (conf.get("text_config") or conf)["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    _, files = tensor_files(src)
    keep = {k: Path(f).name for k, f in files.items() if layer_of(k) is None or layer_of(k) < layers}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}, indent=1))
    for name in set(keep.values()):
        os.symlink(src / name, out / name)
    for f in src.iterdir():  # tokenizer, chat template, generation config, a model's own code
        if f.is_file() and not f.name.endswith(".safetensors") and not (out / f.name).exists() \
                and f.name != "model.safetensors.index.json":
            os.symlink(f, out / f.name)
    return out


def load_for_check(target_dir: str, stored: list[int], device: str, compute_dtype: str, store_compute: str | None,
                   load_gb: float | None):
    """(Target, tokenizer or None, Plan): `target_dir` loaded whole when the check's copies of it fit the budget
    (`load_gb` GB, default half the device's free memory), else its first `Plan.layers` layers through `view`."""
    import tempfile

    from hstap.artifacts.model_dir import load_config, load_target
    from hstap.device import auto_dtype, resolve_device
    from hstap.verify.parity import compute_class

    dev = resolve_device(device)
    dt = auto_dtype(compute_dtype, dev)
    elem = 4 if dt == "fp32" else 2
    twin = compute_class(store_compute, dt) == "bf16"  # the twin: a copy in the other precision
    budget = load_gb * 1e9 if load_gb else free_bytes(dev) / 2
    N = int(load_config(target_dir).num_hidden_layers)
    layers = [L for L in stored if 0 <= L < N] or [0]
    try:
        p = plan(target_dir, N, layers, elem + ((2 if dt == "fp32" else 4) if twin else 0), budget)
    except HstapError:
        if not twin:
            raise
        p = plan(target_dir, N, layers, elem, budget)  # without the twin, the lowest stored layer may fit
        p = Plan(p.layers, p.total, p.need_gb, p.budget_gb, p.skipped, twin=False)
    if p.whole:
        target, tok = load_target(target_dir, device=device, dtype=compute_dtype)
        return target, tok, p
    with tempfile.TemporaryDirectory(prefix="hstap-verify-view-") as tmp:
        target, _ = load_target(view(target_dir, p.layers, Path(tmp) / "target"), device=device, dtype=compute_dtype)
    return target, None, p
