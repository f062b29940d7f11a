"""The answers file of `hstap generate`: JSON lines appended one record at a time with fsync, recovered after a crash
(a cut-short last line dropped), and resumed only with the settings it was made with (its `<out>.config.json`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hstap.common import HstapError, read_record
from hstap.data.generate_config import GenerateConfig


def recover_output(path: str | Path) -> set[str]:
    """Ids already in an output file, read line by line. A last line cut short by a crash (no newline at the end) is
    dropped by truncating the file at the last newline, which is atomic and costs nothing however large the file is
    (rewriting a copy would double the disk use); a bad line anywhere else is an error (the file was edited, or is not
    ours)."""
    path = Path(path)
    if not path.exists():
        return set()
    ids: set[str] = set()
    good = 0  # bytes up to the end of the last complete line
    tail = b""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                tail = line
                break
            good += len(line)
            if not line.strip():
                continue
            try:
                sid = json.loads(line)["id"]
            except (ValueError, KeyError, TypeError):
                raise HstapError(f"{path}:{n}: not a generate output record; fix it or pass --new") from None
            if sid in ids:
                raise HstapError(f"{path}:{n}: id {sid!r} appears twice; fix it or pass --new")
            ids.add(sid)
    if tail:
        print(f"hstap generate: {path}: dropping a truncated last line ({len(tail)} bytes) left by an interrupted run",
              file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return ids


class Appender:
    """Appends one JSON line per record and fsyncs it, so a crash loses at most the record being written. The file is
    opened (and `on_open` run: the run config written) at the first record: a run that fails before it has one (a
    server that does not answer, a malformed first input) leaves nothing behind."""

    def __init__(self, path: Path, on_open: Callable[[], object] = lambda: None):
        self.path, self.on_open, self.f = path, on_open, None

    def write(self, sample_id: str, messages: list[dict]) -> None:
        if self.f is None:
            self.on_open()
            self.f = open(self.path, "ab")
        self.f.write((json.dumps({"id": sample_id, "conversations": messages}, ensure_ascii=False) + "\n").encode())
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def check_resume(cfg: GenerateConfig, keys: tuple[str, ...], out: Path, cfg_path: Path, new: bool = False,
                 data_fingerprint: str | None = None) -> None:
    """Before anything loads: an existing, non-empty `out` must be generate's own (its run record `<out>.config.json`
    says so: `hstap.artifacts.outputs`), else it is refused, --new or not (generate appends to, or with --new replaces, only
    its own answers, never a file of the user's, such as a copy of the input conversations). Without --new, refuse to
    resume it with other settings than the ones its record holds (the `keys` that change what is generated: a
    resume with any of them changed would mix two distributions, or two inputs, in one file); the input files
    ("data") by their `data_fingerprint` where the record has one (the same files moved elsewhere resume)."""
    if not out.exists() or out.stat().st_size == 0:
        return
    rec = read_record(cfg_path)
    if rec is None or rec.get("stage") != "generate":
        raise HstapError(f"{out}: exists and was not written by hstap generate (no run record {cfg_path.name} beside "
                         f"it): generate resumes or replaces only its own answers; choose another --out")
    if new:
        return
    old = rec.get("config") or {}
    moved = data_fingerprint is not None and rec.get("data_fingerprint") == data_fingerprint
    diff = [k for k in keys if k in old and old[k] != getattr(cfg, k) and not (k == "data" and moved)]
    if diff:
        was = ", ".join(f"--{k.replace('_', '-')} {old[k]!r}" for k in diff)
        raise HstapError(f"{out}: existing output was generated with {was}; use the same settings to resume, "
                         f"or pass --new to start over")
