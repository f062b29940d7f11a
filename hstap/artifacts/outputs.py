"""What hstap may replace: its own outputs, never a user's files.

Every output directory hstap writes holds a run record that names the stage that wrote it, written before anything
else goes in: `config.json` with "stage" and "hstap_version" (`hstap.common.write_run_config`), `hstap_export.json` in
an export (its config.json is the engine's model config), `hstap_convert.json` in a converted model directory (its
config.json is the model's). A file output carries the same record beside or inside it: generate's
`<out>.config.json`, verify's JSON report its own "stage" key.

An existing output is replaced (`--overwrite`, or the demo's work directory) only when its record names the stage
that would replace it: a directory or a file of the user's, or another stage's output, is refused by name, with or
without --overwrite, and left as it was. An empty directory holds nothing to lose: it is used as it is. An output that
is, or holds, one of the run's own inputs is refused too (the replacement would remove what it reads). The stages
that write a new output only (data, prepare, convert) refuse any existing one (`check_new_out`).

Where an output goes is checked before any work (`check_writable`, which the command line runs on every stage's output
flags before the stage's module loads): an existing file output must be a regular file (a FIFO would block, a device
would swallow it), a directory output a directory, and the output, or the nearest directory above it that exists
(missing ones are made), must be writable. An OSError that still comes (a full disk) is one line naming its path
(`hstap.cli.main`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from hstap.common import HstapError, read_record

RECORDS = ("config.json", "hstap_export.json", "hstap_convert.json")
"""The files a stage's run record may live in (the first one found that is a run record counts)."""
RECORD_OF = {"export": "hstap_export.json", "convert": "hstap_convert.json"}
"""Stages whose run record is not config.json (there, config.json is the model's)."""


def written_by(d: Path) -> str | None:
    """The hstap stage whose run record the directory `d` holds (a drafter directory, RUN/best or a checkpoint, is
    train's: its drafter.json); None: not an hstap output."""
    for name in RECORDS:
        rec = read_record(d / name)
        if rec is not None:
            return rec["stage"]
    if (d / "drafter.json").is_file():
        from hstap.artifacts.drafter_dir import DRAFTER_FORMAT

        try:
            if json.loads((d / "drafter.json").read_text()).get("format") == DRAFTER_FORMAT:
                return "train"
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            pass
    return None


def check_new_out(out: str | os.PathLike, stage: str, flag: str = "--out") -> Path:
    """Before any work of a stage that never replaces an output (data, prepare, convert): `out` as a Path, or
    HstapError naming it and `flag` when anything is there."""
    out = Path(out)
    if out.exists():
        raise HstapError(f"{out}: already exists ({stage} never overwrites; remove it or choose another {flag})")
    return out


def check_out_dir(out: str | os.PathLike, stage: str, overwrite: bool | None, flag: str = "--out") -> bool:
    """Before any work: may `stage` write the directory `out`? True when it holds an earlier output of `stage` that the
    run replaces; False when it is new or empty. HstapError naming `out` and `flag` when it is a file, a non-empty
    directory `stage` did not write (whatever `overwrite` says), or an earlier output while `overwrite` is False
    (None: the stage replaces its own outputs without being asked, as the demo does)."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir():
        raise HstapError(f"{out}: {flag}: exists and is not a directory (hstap {stage} writes a directory there); "
                         f"choose another {flag}")
    if not any(out.iterdir()):
        return False
    owner = written_by(out)
    if owner != stage:
        what = "files hstap did not write" if owner is None else f"an output of hstap {owner}"
        raise HstapError(f"{out}: {flag}: holds {what} (no {RECORD_OF.get(stage, 'config.json')} of hstap {stage}); "
                         f"hstap {stage} writes only a new or empty directory or replaces its own earlier output, "
                         f"so nothing there was touched: choose another {flag}")
    if overwrite is False:
        raise HstapError(f"{out}: {flag}: holds an earlier hstap {stage} output; pass --overwrite to replace it, or "
                         f"choose another {flag}")
    return True


def check_not_input(out: str | os.PathLike, inputs: list[tuple[str, str | os.PathLike | None]],
                    flag: str = "--out") -> None:
    """Refuse an output that is one of the run's inputs ([(flag, path)]; None: not given) or a directory holding one:
    writing it would replace or remove what the run reads."""
    o = Path(out).resolve()
    for name, p in inputs:
        if p is None:
            continue
        src = Path(p).resolve()
        if src == o or o in src.parents:
            where = "is" if src == o else "holds"
            raise HstapError(f"{out}: {flag}: {where} the input {name} {p}; write the output somewhere else")


def check_writable(out: str | os.PathLike, flag: str, kind: str = "file") -> None:
    """Before any work: can an output of `kind` ("file" or "dir") be written at `out`? HstapError naming `out` and
    `flag` when an existing `out` is not a regular file (`kind` "file": a directory, a FIFO, a device) or not a
    directory ("dir"), or is not writable, or when the nearest existing directory above it is not a directory or not
    writable (a missing parent is made by the stage; the output's temporary files and sidecars go beside it)."""
    out = Path(out)
    try:
        st = out.stat() if out.exists() else None
    except OSError as e:
        raise HstapError(f"{out}: {flag}: cannot be read ({e.strerror})") from None
    if st is not None and kind == "dir" and not stat.S_ISDIR(st.st_mode):
        raise HstapError(f"{out}: {flag}: exists and is not a directory (a directory is written there); choose "
                         f"another {flag}")
    if st is not None and kind == "file":
        if stat.S_ISDIR(st.st_mode):
            raise HstapError(f"{out}: {flag}: is a directory; give a file path")
        if not stat.S_ISREG(st.st_mode):
            raise HstapError(f"{out}: {flag}: exists and is not a regular file (a FIFO, a socket or a device); give "
                             f"a file path")
    if st is not None and not os.access(out, os.W_OK | (os.X_OK if kind == "dir" else 0)):
        raise HstapError(f"{out}: {flag}: not writable (permission denied); choose another {flag}")
    if st is not None and kind == "dir":
        return  # written inside
    above = out.absolute().parent
    while not above.exists() and not above.is_symlink() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise HstapError(f"{out}: {flag}: {above} is not a directory; choose another {flag}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise HstapError(f"{out}: {flag}: cannot write in {above} (permission denied); choose another {flag}")


def check_out_file(out: str | os.PathLike, stage: str, overwrite: bool, flag: str) -> bool:
    """Before any work: may `stage` write the JSON file `out`? True when it is an earlier record of `stage` (its
    "stage" and "hstap_version" keys) that the run replaces, which needs `overwrite`; False when it is new. HstapError
    naming `out` and `flag` for a directory, and for any other file, whatever `overwrite` says: a file of the user's
    (or the store's own manifest.json) is never replaced."""
    out = Path(out)
    check_writable(out, flag, "file")
    if not out.exists():
        return False
    rec = read_record(out)
    if rec is None or rec["stage"] != stage:
        what = "a file hstap did not write" if rec is None else f"an output of hstap {rec['stage']}"
        raise HstapError(f"{out}: {flag}: exists and is {what} (not an earlier report of hstap {stage}); hstap "
                         f"{stage} replaces only its own earlier report, so nothing was touched: choose another {flag}")
    if not overwrite:
        raise HstapError(f"{out}: {flag}: holds an earlier hstap {stage} report; pass --overwrite to replace it, or "
                         f"choose another {flag}")
    return True
