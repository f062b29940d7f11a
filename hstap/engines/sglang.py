"""SGLang servers as hstap starts and stops them: `python -m sglang.launch_server` in the SGLang server's own venv, for
`hstap eval --engine sglang` (hstap/speculative/sglang.py) and the live tests.

Why another interpreter: SGLang 0.5.23 pins torch 2.14.1 and imports torchvision at every launch, which the project's
CPU torch cannot host, so the server gets a venv of its own (`.venv-sglang`, requirements-sglang-server.txt, README
command 2) with hstap installed in it (its hook and plugin run inside the server). `server_python` finds it.

On a machine without a GPU the server takes SGLang's generic CPU path (`cpu_args`, docs/engines.md "A real SGLang server on
the CPU"): `--device cpu --attention-backend torch_native --disable-cuda-graph` and a KV pool of `CPU_MAX_TOTAL_TOKENS`
tokens (SGLang's default pool, sized from a fraction of the machine's memory, had its scheduler OOM-killed on a
24 GiB box). Never with `SGLANG_USE_CPU_ENGINE=1`: that path imports sgl_kernel's CPU build, which is not on PyPI.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hstap.common import HstapError, free_port

SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""hstap's compute-dtype names -> SGLang's `--dtype`."""

CPU_MAX_TOTAL_TOKENS = 16384
"""`--max-total-tokens` on the CPU: the KV pool's size in tokens (hstap's requests are prefills and short decodes)."""

VENV = ".venv-sglang"
"""The server venv's directory, beside the project's `.venv` (README command 2)."""


def server_python(explicit: str | None = None) -> str:
    """The interpreter that runs `python -m sglang.launch_server`: `explicit` when given, else `.venv-sglang/bin/python`
    in the current directory or in hstap's source tree (an editable install) when it exists, else this Python (a GPU
    machine where hstap and SGLang share one venv)."""
    if explicit:
        if not Path(explicit).is_file():
            raise HstapError(f"--sglang-python: {explicit} does not exist (the SGLang server venv's python, e.g. "
                             f"{VENV}/bin/python: README.md, command 2)")
        return str(explicit)
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        p = root / VENV / "bin" / "python"
        if p.is_file():
            return str(p)
    return sys.executable


def require_sglang(python: str) -> None:
    """HstapError when `python` (`server_python`) has no sglang package: checked before a run that launches a server
    writes anything (a look-up of the package, not its minute-long import)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise HstapError(f"--engine sglang: {python} has no sglang package (the SGLang server venv: README.md command 2 "
                         f"makes {VENV}; --sglang-python names another)")


def cpu_args() -> list[str]:
    """The flags of SGLang's generic CPU path (module docstring)."""
    return ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]


def launch_args(device: str, dtype: str) -> list[str]:
    """`--dtype` (hstap's name) plus the CPU flags on a machine without a GPU."""
    return ["--dtype", SGLANG_DTYPES[dtype], *(cpu_args() if device == "cpu" else [])]


def startup_error(log_text: str) -> str:
    """The last exception line of a server log (`ValueError: ...`), or its last non-empty line."""
    lines = [x.strip() for x in log_text.splitlines() if x.strip()]
    errs = [x for x in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", x)]
    return (errs or lines or ["(empty log)"])[-1][:500]


class SGLangServer:
    """`PYTHON -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port PORT ARGS` as a process group of its
    own (its scheduler and detokenizer are children), output in `log`. `start()` waits until /health and
    /server_info answer; a server that exits or stays silent for `timeout` s raises RuntimeError with its log's last
    error line. `kill()` sends SIGKILL to the whole group (a crash); `stop()` SIGTERM, then SIGKILL after 30 s; a
    context manager starts and stops it."""

    def __init__(self, python: str, model: str | os.PathLike, log: str | os.PathLike, args: list[str],
                 env: dict | None = None, port: int | None = None, timeout: float = 900.0):
        self.python, self.model, self.log, self.args = python, str(model), Path(log), list(args)
        self.env, self.timeout = env, timeout
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", "--model-path", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]

    def start(self) -> "SGLangServer":
        t0 = time.monotonic()
        with open(self.log, "a") as f:
            f.write(f"$ {' '.join(self.command())}\n")
            f.flush()
            self.proc = subprocess.Popen(self.command(), stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                self.kill()  # children a failed launch may leave behind
                raise RuntimeError(f"the SGLang server exited ({self.proc.returncode}) while starting: "
                                   f"{startup_error(self.log_text())} (log: {self.log})")
            if self._ready():
                break
            if time.monotonic() - t0 > self.timeout:
                self.stop()
                raise RuntimeError(f"the SGLang server did not answer in {self.timeout:.0f} s: "
                                   f"{startup_error(self.log_text())} (log: {self.log})")
            time.sleep(1.0)
        self.startup_s = time.monotonic() - t0
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(self.url + "/server_info", timeout=5) as r:
                return bool(json.loads(r.read()))
        except (OSError, ValueError):
            return False

    def info(self) -> dict:
        """The running server's /server_info (its resolved arguments, `version`)."""
        with urllib.request.urlopen(self.url + "/server_info", timeout=30) as r:
            return json.loads(r.read())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()  # the leader is gone; its group may not be
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def generate(url: str, input_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             stop_token_ids: list[int] | None = None, seed: int | None = None, timeout: float = 3600.0,
             sampling: dict | None = None, **extra) -> dict:
    """POST /generate with token ids; SGLang's answer (`output_ids`, `meta_info`). `sampling` adds to the sampling
    params (ignore_eos, ...); `extra` goes into the request as is (rid, extra_key, ...)."""
    sp: dict = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature), **(sampling or {})}
    if stop_token_ids:
        sp["stop_token_ids"] = [int(i) for i in stop_token_ids]
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    body = json.dumps({"input_ids": [int(i) for i in input_ids], "sampling_params": sp, **extra}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
