"""Which model runner a vLLM engine runs, and what of hstap runs under each.

vLLM 0.32 has two model runners: V1 (`vllm/v1/worker/gpu_model_runner.py`, and the CPU build's subclass
`cpu_model_runner.py`) and Model Runner V2 (the package `vllm/v1/worker/gpu/`, and `vllm/v1/worker/cpu/` on the CPU).
`VllmConfig.use_v2_model_runner` picks one: `VLLM_USE_V2_MODEL_RUNNER` when set, else V2 wherever Triton runs (every
CUDA machine) unless the run asks for a feature V2 lacks, else V1 (the CPU build: Triton has no CPU backend).

What hstap does inside vLLM, by runner (docs/engines.md has the file-by-file list of what a V2 port needs):

| path | V1 | V2 |
|---|---|---|
| connector capture (`HstapConnector`, `extract_hidden_states`) | runs | allowed: reads only the KV-connector interface and the `extract_hidden_states` cache both runners fill (not run here: V2 cannot start on a CPU) |
| `hstap eval --engine vllm` (stock EAGLE-3, `LLM.get_metrics()`) | runs | allowed: public API only |
| tap beside EAGLE-3 (`HstapEagleTapConnector`, `hstap_tap_start`) | runs | refused: wraps `_model_forward`, reads `input_batch` and `query_start_loc` of V1's runner |
| `hstap serve-loop` | runs | refused (it taps beside EAGLE-3); its own server is started with V1 |
| drafter reload (`hstap_load_drafter`) | runs | allowed: `get_draft_model()`, `get_model()`, `vllm_config` exist on both |

Every engine hstap starts itself (`hstap.engines.vllm.start_llm`, `vllm_server`) gets `VLLM_USE_V2_MODEL_RUNNER=0`
(`V1_ENV`) unless the environment already names a runner; `hstap serve-loop` always pins V1.
"""

from __future__ import annotations

import os

from hstap.common import HstapError

ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its model runners (0: V1, 1: V2; unset: vLLM decides, `VllmConfig.use_v2_model_runner`)."""

V1_ENV = {ENV: "0"}
"""The environment that makes vLLM run its V1 model runner."""

V2_PACKAGES = ("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")
"""Modules of Model Runner V2's classes (V1's are the modules `vllm.v1.worker.gpu_model_runner`, `cpu_model_runner`)."""


def runner_of(model_runner) -> str:
    """'v2' when `model_runner` (a worker's `model_runner`) is an instance of Model Runner V2 (a class of its packages
    anywhere in its MRO), else 'v1'."""
    mods = [getattr(c, "__module__", "") or "" for c in type(model_runner).__mro__]
    return "v2" if any(m.startswith(V2_PACKAGES) for m in mods) else "v1"


def configured_runner(vllm_config) -> str:
    """'v2' or 'v1': the runner `vllm_config` makes its workers build (`VllmConfig.use_v2_model_runner`)."""
    return "v2" if bool(getattr(vllm_config, "use_v2_model_runner", False)) else "v1"


def require_v1(runner: str, what: str, reads: str) -> None:
    """HstapError, one line naming the setting, unless `runner` is 'v1'. `what` is the hstap path, `reads` the V1
    internals it relies on."""
    if runner != "v1":
        raise HstapError(f"{what}: this vLLM runs Model Runner V2, and {what} reads V1's model runner ({reads}); start "
                         f"vLLM with {ENV}=0 (docs/engines.md, \"vLLM's model runners\")")


def pin_v1(env: dict | None = None, force: bool = False) -> dict:
    """`env` (default: this process's os.environ, changed in place) with V1's setting, unless it names a runner already
    and `force` is off. Returns the mapping it changed."""
    target = os.environ if env is None else env
    if force or ENV not in target:
        target[ENV] = V1_ENV[ENV]
    return target
