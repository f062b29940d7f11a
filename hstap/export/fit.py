"""Whether a drafter fits a target, read from the drafter's JSON alone (no weight is loaded): its vocabulary, the hidden
size it fuses, the layers it taps, and the tokenizer of the target it was trained on.

A drafter is an hstap drafter directory or training RUN (drafter.json: `config`, and `store.target`, the fingerprint
block of the store it was trained on) or an SGLang / speculators export (config.json, and hstap_export.json's
`provenance.store.target` when hstap wrote it). `check_drafter_target` is what eval and export run before they load
anything: one line naming the drafter's file and field, instead of a size mismatch deep in a state dict or a decoder.

    from hstap.export.fit import check_drafter_target
    check_drafter_target("runs/run", target_fingerprint("models/target"))
"""

from __future__ import annotations

from pathlib import Path

from hstap.common import HstapError, read_json


def drafter_facts(path: str | Path) -> dict:
    """{"file": the JSON the facts come from, "vocab_size", "target_hidden_size", "aux_layers", "num_layers" (decoder
    layers), "target": the target block it was trained on (None: not recorded)} of a drafter directory, RUN, or
    SGLang / speculators export."""
    from hstap.artifacts.drafter_dir import resolve_drafter_dir
    from hstap.export.engines import read_export

    p = Path(path)
    if (p / "model.safetensors").is_file() and not (p / "drafter.safetensors").is_file():
        conf, layer, aux, _, info = read_export(p)
        return {"file": p / "config.json", "vocab_size": layer.get("vocab_size"),
                "target_hidden_size": layer.get("target_hidden_size") or layer.get("hidden_size"), "aux_layers": aux,
                "num_layers": int(layer.get("num_hidden_layers") or 1),
                "target": ((info.get("provenance") or {}).get("store") or {}).get("target")}
    d = resolve_drafter_dir(p)
    f = d / "drafter.json"
    meta = read_json(f)
    conf = meta.get("config")
    if not isinstance(conf, dict):
        raise HstapError(f"{f}: config: missing (not an hstap drafter?)")
    return {"file": f, "vocab_size": conf.get("vocab_size"), "target_hidden_size": conf.get("target_hidden_size"),
            "aux_layers": [int(i) for i in conf.get("aux_layers") or []], "num_layers": int(conf.get("num_layers", 1)),
            "target": (meta.get("store") or {}).get("target") if isinstance(meta.get("store"), dict) else None}


def check_drafter_target(path: str | Path, target: dict) -> dict:
    """Refuse a drafter made for another target. `target`: {path, vocab_size, hidden_size, num_layers} and optionally
    tokenizer_sha256 (`hstap.artifacts.model_dir.target_fingerprint`'s block has them all; a field that is None is not
    compared). The tokenizer is compared when both sides record it: a drafter whose ids are another tokenizer's drafts
    other tokens. Weights may differ (a drafter of a base model on its fine-tune): eval says so. Returns the drafter's
    facts (`drafter_facts`)."""
    f = drafter_facts(path)
    where, tdir = f["file"], target["path"]
    for key, theirs, what in (("vocab_size", "vocab_size", "token ids"),
                              ("target_hidden_size", "hidden_size", "as its hidden size")):
        mine, want = f[key], target.get(theirs)
        if mine is not None and want is not None and int(mine) != int(want):
            raise HstapError(f"{where}: {key}: the drafter was made for a target of {mine} {what}, {tdir} has "
                             f"{want}: a drafter of another target")
    N = target.get("num_layers")
    if N is not None and any(not 0 <= i < int(N) for i in f["aux_layers"]):
        raise HstapError(f"{where}: aux_layers {f['aux_layers']}: the drafter taps layers the {N}-layer target {tdir} "
                         f"does not have: a drafter of another target")
    a, b = (f["target"] or {}).get("tokenizer_sha256"), target.get("tokenizer_sha256")
    if a and b and a != b:
        raise HstapError(f"{where}: target.tokenizer_sha256: the drafter was trained on a target whose tokenizer "
                         f"({a[:12]}) is not {tdir}'s ({b[:12]}): its draft ids are another vocabulary's")
    return f
