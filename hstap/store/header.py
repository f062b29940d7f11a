"""A store's header (the manifest's keys besides its shards; spec: `hstap.store.format`): the checks a header passes
before a store is created with it, and the comparison a resume makes (`header_diff`: the fields that decide whether the
stored states are the ones this run would produce, then the work it continues)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hstap.common import HstapError
from hstap.store.format import DTYPES
from hstap.store.manifest import load_manifest

# Header fields that decide whether stored hidden states are the ones this run would produce.
CHECKED_FIELDS = ("target.config_sha256", "target.weights_fingerprint", "target.tokenizer_sha256",
                  "target.chat_template_sha256", "layers", "dtype", "hidden_size")
_RESERVED = ("format", "version", "created", "created_unix", "shards")


def work_of(header: dict) -> dict:
    """The store's `work` (kind, producer, data; the spec above), read the same way for stores that predate it."""
    w = header.get("work") if isinstance(header.get("work"), dict) else {}
    kind = w.get("kind") or (header.get("contents") or {}).get("kind") or "prepared"
    return {"kind": kind, "producer": w.get("producer"), "data": w.get("data")}


def _same_data(a, b) -> bool:
    if a is None or b is None:
        return True  # unknown on one side (a store older than `work`): not compared
    if isinstance(a, dict) and isinstance(b, dict) and a.get("sha256") and b.get("sha256"):
        return a["sha256"] == b["sha256"]  # a prepared set by its content: one moved elsewhere is the same work
    return a == b


def header_diff(old: dict, new: dict) -> tuple[str, object, object] | None:
    """The first of CHECKED_FIELDS, then of work.{kind, producer, data}, that differs: (dotted name, old value, new
    value)."""
    for name in CHECKED_FIELDS:
        a, b = old, new
        for k in name.split("."):
            a, b = (a.get(k) if isinstance(a, dict) else None), (b.get(k) if isinstance(b, dict) else None)
        if a != b:
            return name, a, b
    wa, wb = work_of(old), work_of(new)
    if wa["kind"] != wb["kind"]:
        return "work.kind", wa["kind"], wb["kind"]
    if wa["producer"] and wb["producer"] and wa["producer"] != wb["producer"]:
        return "work.producer", wa["producer"], wb["producer"]
    if not _same_data(wa["data"], wb["data"]):
        return "work.data", wa["data"], wb["data"]
    return None


def refuse_other_header(path: Path, manifest: dict, header: dict) -> None:
    """HstapError naming the first field (`header_diff`) in which the store at `path` (its manifest) differs from the
    header of a run that would extend it."""
    diff = header_diff(manifest, header)
    if diff:
        name, old, now = diff
        if name.startswith("work."):
            raise HstapError(f"{path / 'manifest.json'}:1: {name}: the store holds {_work_name(work_of(manifest))}; "
                             f"this run writes {_work_name(work_of(header))}: a store is resumed only by the same "
                             f"work; pass --new to replace it, or write to another directory")
        raise HstapError(f"{path / 'manifest.json'}:1: {name}: the store was made with {old!r}, this run has "
                         f"{now!r}; pass new=True (--new) to replace it, or write to another directory")


_PRODUCERS = {"prepared": "hstap capture", "generated": "hstap generate --capture", "served traffic": "a server's tap"}


def _work_name(w: dict) -> str:
    """'prepared samples (hstap capture, from /data/prepared)': a store's work in words."""
    data = w["data"].get("path") if isinstance(w["data"], dict) else None
    src = f", from {', '.join(map(str, data)) if isinstance(data, list) else data}" if data else ""
    return f"{w['kind']} samples ({w['producer'] or _PRODUCERS.get(w['kind'], 'an unknown producer')}{src})"


def check_resumable(path: str | os.PathLike, header: dict) -> None:
    """Before a run loads anything to extend the existing store at `path`: its header must be this run's (what
    `StoreWriter` refuses later, said before the run spends any time)."""
    p = Path(path)
    refuse_other_header(p, load_manifest(p), check_header(header))


def check_header(header: dict) -> dict:
    if not isinstance(header, dict):
        raise HstapError(f"store header: expected a dict, got {type(header).__name__}")
    for k in _RESERVED:
        if k in header:
            raise HstapError(f"store header: key {k!r} is reserved for the manifest")
    if header.get("dtype") not in DTYPES:
        raise HstapError(f"store header: dtype: expected one of {', '.join(DTYPES)}, got {header.get('dtype')!r}")
    layers = header.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise HstapError(f"store header: layers: expected a non-empty list of canonical layer ids, got {layers!r}")
    if not isinstance(header.get("hidden_size"), int) or header["hidden_size"] < 1:
        raise HstapError(f"store header: hidden_size: expected a positive int, got {header.get('hidden_size')!r}")
    try:  # the header goes into JSON: fail now, not at the first commit
        return json.loads(json.dumps(header))
    except (TypeError, ValueError) as e:
        raise HstapError(f"store header: not JSON-serialisable: {e}") from None

