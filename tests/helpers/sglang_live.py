"""The live SGLang server in the tests: sglang 0.5.23 in its own venv (`.venv-sglang` in the repository root, made by
README.md's command 2 and .ci/run from requirements-sglang-server.txt), started on SGLang's generic CPU path in fp32
(`hstap.engines.sglang`), as a process group of its own.

`server_venv()` skips a test only when that venv is absent (a checkout where command 2 was not run); a venv that is
there but cannot start a server fails the test, so that CI never skips the live tests silently. The server imports
this checkout's hstap (PYTHONPATH), whatever checkout the venv's editable install points at.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from hstap.engines.sglang import VENV, SGLangServer, launch_args

REPO = Path(__file__).resolve().parents[2]  # tests/helpers/ -> the repository root
PYTHON = REPO / VENV / "bin" / "python"


def server_venv() -> str:
    """The server venv's python, or a skip naming the command that creates it."""
    if not PYTHON.is_file():
        pytest.skip(f"the SGLang server venv {VENV}/ is absent (README.md, command 2, creates it): live SGLang "
                    "tests skipped")
    return str(PYTHON)


def server_env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **extra}


def server(model: Path, log: Path, *args: str, env: dict | None = None, port: int | None = None) -> SGLangServer:
    """An SGLang server on `model` (CPU, fp32) with `args`, not started yet."""
    return SGLangServer(server_venv(), model, log, [*launch_args("cpu", "fp32"), *args], env=server_env(**(env or {})),
                        port=port)


def events(store: Path) -> list[dict]:
    """Every event line the hook wrote into STORE/sglang-events/."""
    out = []
    for f in sorted((store / "sglang-events").glob("r*.jsonl")):
        out += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return out


def wait_for(cond, timeout: float = 60.0, what: str = "a condition"):
    """Poll `cond()` until it returns something true; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
