"""A store's JSON files and its directory (spec: `hstap.store.format`): manifest.json and the part files read and
written, their union (the committed shards, `union_entries`), `merge_manifest`, the committed ids, the end of writing
(`writing_state`) and the directory a writer may create a store in (`check_store_dir`)."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from hstap.common import HstapError, atomic_write_bytes, read_json, read_record
from hstap.store.format import FORMAT, PART_FORMAT, SHARD_RE, TEMP_RE, VERSION

TEMP_OF_RE = re.compile(r"^\..+\.[^.]+\.tmp$")
"""An atomic write's temporary file (`.NAME.RANDOM.tmp` beside NAME) left by a process killed before its rename."""
log = logging.getLogger("hstap.store")


STORE_FILES = ("manifest.json", "parts", "shards", "consumer.json", "vocab_map.safetensors")
"""What a store's directory holds of its own (besides run records and engine event directories, `check_store_dir`)."""


def check_store_dir(path: str | os.PathLike) -> bool:
    """Before a writer creates, resumes or replaces (--new) the store at `path`: whether there is a store to resume
    or replace (a manifest.json of the hstap-store format). HstapError naming the path when it is a file, holds a
    manifest.json of another format, or holds other files than a store's own (shards/ and parts/ of shard and part
    files, a following trainer's consumer.json, a run record, an engine's event directory: what an interrupted
    creation, or a trainer waiting for the store, leaves): a store is never written into, nor wiped from, a directory
    of the user's files."""
    p = Path(path)
    if not p.exists():
        return False
    if not p.is_dir():
        raise HstapError(f"{p}: exists and is not a directory (a store is a directory)")
    if (p / "manifest.json").is_file():
        load_manifest(p)  # one of another format is refused by name
        return True
    for f in sorted(p.iterdir()):
        if f.name == "shards" and f.is_dir() and all(SHARD_RE.match(x.name) or TEMP_RE.match(x.name)
                                                     for x in f.iterdir()):
            continue
        if f.name == "parts" and f.is_dir() and all(x.name.startswith(("rank", ".rank")) for x in f.iterdir()):
            continue
        if f.name in STORE_FILES and f.is_file() or f.is_dir() and f.name.endswith("-events"):
            continue  # e.g. a following trainer's consumer.json, written before the store is created
        if f.name == "config.json" and read_record(f) is not None:
            continue
        if f.is_file() and any(TEMP_OF_RE.match(f.name) and f.name[1:].startswith(n + ".")
                               for n in (*STORE_FILES, "config.json")):
            continue  # an atomic write of the store's own file, killed before its rename: the creation was cut short
        raise HstapError(f"{p}: holds {f.name!r} and no manifest.json: not an hstap store; a store is created only "
                         f"in a new or empty directory (nothing there was touched): choose another directory")
    return False



def write_json(path: Path, obj: dict) -> None:
    """Atomically write a manifest/part file: one key per line, one shard entry per line.

    Not `atomic_write_json`: its indented output goes through json's pure-Python encoder, and a part file is
    rewritten at every commit: O(shards^2) Python time per rank. This uses the C encoder and stays grep-able."""
    lines = []
    for k, v in obj.items():
        if k == "shards" and v:
            body = ",\n".join("  " + json.dumps(e, separators=(", ", ": ")) for e in v)
            lines.append(f' "shards": [\n{body}\n ]')
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    atomic_write_bytes(path, ("{\n" + ",\n".join(lines) + "\n}\n").encode())


def load_manifest(path: Path) -> dict:
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise HstapError(f"{path}: not an hstap store (no manifest.json)")
    m = read_json(mpath, "manifest")
    if m.get("format") != FORMAT:
        raise HstapError(f"{mpath}:1: format: expected {FORMAT!r}, got {m.get('format')!r}")
    if not isinstance(m.get("version"), int) or m["version"] > VERSION:
        raise HstapError(f"{mpath}:1: version: {m.get('version')!r} is not readable by this hstap (reads <= {VERSION})")
    if not isinstance(m.get("shards"), list):
        raise HstapError(f"{mpath}:1: shards: expected a list")
    return m


def load_parts(path: Path) -> list[tuple[Path, dict]]:
    out = []
    pdir = path / "parts"
    if pdir.is_dir():
        for p in sorted(pdir.glob("rank*.json")):
            part = read_json(p, "part file")
            if part.get("format") != PART_FORMAT or not isinstance(part.get("shards"), list):
                raise HstapError(f"{p}:1: not an hstap store part file (format {part.get('format')!r})")
            out.append((p, part))
    return out


def union_entries(manifest: dict, parts: list[tuple[Path, dict]]) -> tuple[list[dict], list[str], set[str]]:
    """Committed entries = manifest ∪ part files, keyed by file, ordered by (rank, seq), duplicate sample ids dropped.

    Returns (entries, problems, files named by any entry, dropped ones included)."""
    by_file: dict[str, dict] = {}
    problems: list[str] = []
    sources = [("manifest.json", manifest["shards"])] + [(f"parts/{p.name}", q["shards"]) for p, q in parts]
    for source, entries in sources:
        for e in entries:
            if not isinstance(e, dict) or not all(k in e for k in ("file", "rank", "seq", "sha256", "ids", "lengths")):
                problems.append(f"{source}: malformed shard entry {str(e)[:120]}")
                continue
            old = by_file.get(e["file"])
            if old is None:
                by_file[e["file"]] = e
            elif old != e:
                problems.append(f"{source}: entry for {e['file']} differs from an earlier one (kept the first)")
    files = set(by_file)
    out, owner = [], {}
    for e in sorted(by_file.values(), key=lambda e: (e["rank"], e["seq"])):
        clash = [i for i in e["ids"] if i in owner]
        if clash:
            problems.append(f"{e['file']}: {len(clash)} sample id(s) already committed by {owner[clash[0]]} "
                            f"(e.g. {clash[0]!r}); entry ignored")
            continue
        for i in e["ids"]:
            owner[i] = e["file"]
        out.append(e)
    return out, problems, files


def merge_manifest(path: str | os.PathLike) -> dict:
    """Fold every part file into manifest.json (atomic, idempotent). Returns {shards, samples, tokens, problems}."""
    path = Path(path)
    m = load_manifest(path)
    entries, problems, _ = union_entries(m, load_parts(path))
    merged = {k: v for k, v in m.items() if k != "shards"} | {"shards": entries}
    if merged != m:
        write_json(path / "manifest.json", merged)
    for p in problems:
        log.warning("%s: %s", path, p)
    return {"shards": len(entries), "samples": sum(len(e["ids"]) for e in entries),
            "tokens": sum(int(e["tokens"]) for e in entries), "problems": problems}


def writing_state(manifest: dict, parts: list[tuple[Path, dict]]) -> tuple[int, set[int]]:
    """(number of ranks, the finished ones) by the rules of "Writers and the end of writing" in the spec above; writing
    has ended when every rank is finished."""
    closed = {int(q.get("rank", -1)): bool(q.get("closed")) for _, q in parts}
    W = manifest.get("writers")
    if not isinstance(W, int) or W < 1:  # a store made before `writers` existed: the ranks that wrote a part file
        return max(closed, default=-1) + 1, {r for r, c in closed.items() if c}
    return max(W, max(closed, default=-1) + 1), {r for r, c in closed.items() if c or r >= W}


def committed_ids_of(path: str | os.PathLike) -> set[str]:
    """Every committed sample id of a store: manifest.json ∪ part files, consumed shards included (what a resumed
    capture must skip)."""
    entries, _, _ = union_entries(load_manifest(Path(path)), load_parts(Path(path)))
    return {i for e in entries for i in e["ids"]}

