"""Real child processes for the tests, forked from one multiprocessing forkserver.

Why a forkserver: importing torch + transformers + datasets costs ~6 s of CPU per fresh interpreter on the 2-core test
box, and the kill/resume tests need many separate `hstap` processes. The forkserver imports them once; each child is
then a real process (own pid, SIGKILL-able, its own exit status, gloo process groups across them). The forkserver runs
no compute before forking, so children start with clean OpenMP / tokenizer thread state. There is one forkserver per
test process, whichever module starts it first, so PRELOAD covers every test module's children.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from pathlib import Path

PRELOAD = ["torch", "numpy", "datasets", "pyarrow", "safetensors", "tqdm", "transformers", "torch.distributed",
           "torch.distributed.fsdp", "torch.nn.parallel", "transformers.models.llama.modeling_llama",
           "transformers.models.llama.configuration_llama", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "hstap.cli", "hstap.capture.stage", "hstap.capture.hf.driver",
           "hstap.store.reader", "hstap.store.writer", "hstap.data.prepare", "hstap.models.target", "hstap.layers", "hstap.train.stage",
           "hstap.models.drafter", "hstap.export.stage", "hstap.dist", "helpers.capture", "helpers.train"]

_CTX = None


def forkserver():
    """The multiprocessing context whose server has imported PRELOAD (started on first use)."""
    global _CTX
    if _CTX is None:
        tests = str(Path(__file__).resolve().parents[1])  # the server imports `helpers.*` (PRELOAD) from tests/
        if tests not in sys.path:
            sys.path.insert(0, tests)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CTX = ctx
    return _CTX


def start_forkserver() -> None:
    """Start the server now (its imports then overlap whatever the caller does next)."""
    from multiprocessing import forkserver as fs

    forkserver()
    fs.ensure_running()


def redirect_output(log_path: str) -> None:
    """In a child: stdout and stderr (file descriptors 1 and 2) to log_path."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class Child:
    """`target(argv, env, log_path, *extra)` in a forked child process; env adds to the child's environment."""

    timeout = 120.0  # wait()'s default

    def __init__(self, target, argv: list[str], log: Path, env: dict | None = None, extra: tuple = ()):
        self.log = Path(log)
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = forkserver().Process(target=target, args=(list(argv), env, str(self.log), *extra))
        self.proc.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had just exited
            pass

    def wait(self, timeout: float | None = None) -> int:
        timeout = self.timeout if timeout is None else timeout
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.kill()
            self.proc.join()
            raise AssertionError(f"child {self.pid} did not finish in {timeout} s; log:\n{self.output()[-3000:]}")
        return self.proc.exitcode

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""
