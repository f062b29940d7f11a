"""`hstap` CLI runs in fresh interpreters for the CUDA fault tests (tests/test_cuda.py): CUDA does not survive fork, so
these children are new `python -m hstap.cli` processes (what a user, a scheduler or a preemption sees), each with its
own log file, SIGKILL-able at any moment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/helpers/ -> the repository root


class Cli:
    """`python -m hstap.cli <argv>` with stdout and stderr to `log`."""

    def __init__(self, argv: list[str], log: Path):
        self.log = Path(log)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "hstap.cli", *map(str, argv)], stdout=f,
                                         stderr=subprocess.STDOUT, cwd=REPO, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had just exited
            pass

    def wait(self, timeout: float = 300.0) -> int:
        """The exit status (-9 after SIGKILL)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            raise AssertionError(f"{self.proc.args} did not finish in {timeout} s; log:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def wait_for(cond, proc: Cli, timeout: float = 240.0, poll: float = 0.002) -> bool:
    """Poll until cond() or the process ended or timeout; -> cond()."""
    deadline = time.monotonic() + timeout
    while not cond() and proc.alive() and time.monotonic() < deadline:
        time.sleep(poll)
    return bool(cond())


def commits(store: Path) -> int:
    """Shards rank 0 has committed so far (its part file is replaced atomically at each commit)."""
    try:
        return len(json.loads((Path(store) / "parts" / "rank000.json").read_bytes())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def record(name: str, obj: dict) -> None:
    """With $OUT set (the lead's GPU runs), write what a test measured to $OUT/<name>.json."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / f"{name}.json").write_text(json.dumps(obj, indent=1) + "\n")
