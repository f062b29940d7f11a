"""Small shared utilities: user-facing errors, atomic writes, hashing, run metadata.

Every artifact hstap writes goes through `atomic_write_*` (temp file in the same directory, fsync, rename, fsync of the
directory) so a crash leaves either the old file or the new one, never a torn one; a directory is built beside its
destination and published whole (`publishing_dir`, `publish_dir`). `write_run_config` puts the stage config as
parsed, the git commit and the package version as `config.json` next to each output (what a run resolves from its
inputs is its own: a training run's plan.json); `read_record` reads such a record back. `read_json` is the one way a
JSON file is read where a bad one is the user's: a JSON object, or one line naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import hstap


class HstapError(Exception):
    """A user-facing error: the CLI prints `hstap: error: <message>` (one line) and exits with status 2."""


def one_line(e: BaseException | str) -> str:
    """An exception's message on one line (what a user-facing error quotes)."""
    return " ".join(str(e).split()) or type(e).__name__


def user_message(e: HstapError) -> str:
    """The one line of a user-facing error, also of one raised in a DataLoader worker: the loader re-raises it in the
    main process with the worker's traceback around the original message, which ends the text."""
    text = str(e)
    marker = f"{HstapError.__module__}.{HstapError.__qualname__}: "
    if "\n" in text and marker in text:
        text = text.rsplit(marker, 1)[1]
    return one_line(text)


_UMASK = os.umask(0)  # os.umask can only be read by setting it: read once, at import
os.umask(_UMASK)


def file_mode() -> int:
    """The permissions open() gives a new file in this process (0o666 less the umask): what mkstemp's 0600 becomes."""
    return 0o666 & ~_UMASK


def temp_dir_beside(out: Path) -> Path:
    """A new temporary directory next to `out` (the same file system: the finished result is renamed into place), with
    the permissions mkdir would give it (mkdtemp makes 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o777 & ~_UMASK)
    return tmp


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file below `root` and every directory, each after its contents."""
    for dirpath, _, names in os.walk(root, topdown=False):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


EXISTING = ("refuse", "aside", "remove")


def publish_dir(tmp: Path, out: Path, existing: str = "refuse", refusal: str = "exists",
                aside: Path | None = None) -> None:
    """Publish the finished directory `tmp` (beside `out`: the same file system) at `out`: everything in it fsynced,
    one rename, the parent fsynced, so that `out` is either absent, the old one or the new one, never half-written.

    `existing` says what becomes of a directory already at `out`:
      "refuse": HstapError `{out}: {refusal}`, nothing moved (`tmp` stays the caller's);
      "aside": renamed to `aside` (default: a hidden sibling) just before the rename and removed after it, so that `out`
        is missing only between two renames; a fixed `aside` lets the caller's recovery put it back after a crash;
      "remove": removed first (for what a later run writes again: a crash there leaves no `out`)."""
    if existing not in EXISTING:
        raise ValueError(f"publish_dir: existing must be one of {EXISTING}, got {existing!r}")
    fsync_tree(tmp)
    if existing == "refuse" and out.exists():
        raise HstapError(f"{out}: {refusal}")
    if existing == "remove":
        shutil.rmtree(out, ignore_errors=True)
    if existing == "aside":
        aside = aside or out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        if out.exists():
            os.rename(out, aside)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if existing == "aside":
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def publishing_dir(out: Path, existing: str = "refuse", refusal: str = "exists") -> Iterator[Path]:
    """`with publishing_dir(out) as tmp:` the block builds the result in `tmp`, a new hidden directory beside `out`
    (`out`'s parent is made if missing); when the block ends it is published at `out` (`publish_dir`, with `existing`
    and `refusal`). If the block or the publishing raises, `tmp` is removed and `out` is as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(out)
    try:
        yield tmp
        publish_dir(tmp, out, existing, refusal)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Write `data` to `path` atomically: temp file in the same directory, fsync, rename, fsync the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp creates 0600; give the file the permissions open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False, default=_json_default) + "\n").encode())


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def read_json(path: str | os.PathLike, what: str | None = None) -> dict:
    """The JSON object in the file `path`; a one-line HstapError naming the file (and the line of a syntax error) when
    it cannot be read, is not JSON or holds no object. `what` names the file in the message (default: its name)."""
    p = Path(path)
    what = what or p.name
    try:
        obj = json.loads(p.read_bytes())
    except json.JSONDecodeError as e:
        raise HstapError(f"{p}:{e.lineno}: {what} is not valid JSON: {e.msg}") from None
    except (OSError, ValueError) as e:  # ValueError: bytes in no encoding JSON allows
        raise HstapError(f"{p}: cannot read: {one_line(e)}") from None
    if not isinstance(obj, dict):
        raise HstapError(f"{p}:1: {what}: expected a JSON object")
    return obj


def sha256_bytes(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


_GIT_COMMIT: str | None | bool = False


def git_commit() -> str | None:
    """The commit of the hstap checkout (None when not installed from a git checkout)."""
    global _GIT_COMMIT
    if _GIT_COMMIT is False:
        root = Path(hstap.__file__).resolve().parent.parent
        try:
            out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
            _GIT_COMMIT = out.stdout.strip() if out.returncode == 0 and (root / ".git").exists() else None
            if _GIT_COMMIT:
                dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()
                if dirty:
                    _GIT_COMMIT += "-dirty"
        except (OSError, subprocess.SubprocessError):
            _GIT_COMMIT = None
    return _GIT_COMMIT  # type: ignore[return-value]


def run_meta(stage: str, cfg: Any) -> dict:
    """The config of a stage as parsed plus provenance, as stored in `config.json` next to every artifact."""
    return {
        "stage": stage,
        "config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg,
        "git_commit": git_commit(),
        "hstap_version": hstap.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_run_config(out_dir: str | os.PathLike, stage: str, cfg: Any) -> None:
    atomic_write_json(Path(out_dir) / "config.json", run_meta(stage, cfg))


def read_record(path: str | os.PathLike) -> dict | None:
    """The run record in the file `path` (a JSON object with "stage" and "hstap_version", `run_meta`), or None when it
    is missing, unreadable or not one."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if isinstance(rec, dict) and isinstance(rec.get("stage"), str) and "hstap_version" in rec:
        return rec
    return None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (the OS's choice): for servers hstap or its tests start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_module(module: str, what: str, dist: str | None = None) -> None:
    """HstapError `{what}: needs the {dist} package ...` with its install line when `module` cannot be imported here:
    an optional dependency a stage needs, asked for before its work starts (not an ImportError traceback in it)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise HstapError(f"{what}: needs the {dist or module!r} package, which cannot be imported here ({one_line(e)}; "
                         f"pip install {dist or module})") from None


def package_files(dist: str, suffix: str = "") -> list[Path]:
    """Files of an installed Python distribution (`pip install NAME`) whose path ends with `suffix`, as installed
    (importlib.metadata's record). Raises a one-line HstapError when the distribution is not installed."""
    import importlib.metadata as md

    try:
        files = md.distribution(dist).files or []
    except (md.PackageNotFoundError, ValueError):  # ValueError: no name at all ("")
        raise HstapError(f"package {dist!r} is not installed (pip install {dist})") from None
    return [Path(f.locate()) for f in files if str(f).endswith(suffix) and "__pycache__" not in str(f)]


def package_version(dist: str) -> str | None:
    """The installed version of a distribution (None when it is not installed)."""
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
