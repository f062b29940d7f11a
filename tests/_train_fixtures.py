"""Assets and child processes for the training tests.

Assets: a tiny random Llama target (6 layers, H=64, its lm_head scaled up so that the target distribution is peaked and
a drafter has something to learn), a prepared set of stdlib-documentation chats (hstap.data.prepare, a 96-token draft
vocabulary) and an fp32 store captured from it by the real capture stage (hstap.capture, layers 1,3,4).

Child processes: `hstap.train` runs as real processes (own pid, SIGKILL-able, gloo process groups across them) forked
from a multiprocessing forkserver that has imported torch/transformers/hstap once; a fresh interpreter per run would
cost seconds of CPU each on the 2-core test box. Children run single-threaded, like the in-process reference runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import signal
import socket
import sys
from pathlib import Path

PRELOAD = ["torch", "numpy", "safetensors", "tqdm", "transformers", "transformers.models.llama.configuration_llama",
           "transformers.models.llama.modeling_llama", "torch.distributed", "torch.distributed.fsdp",
           "torch.nn.parallel", "hstap.cli", "hstap.train", "hstap.drafter", "hstap.store", "hstap.export",
           "hstap.data", "hstap.dist", "_train_fixtures"]


def build_assets(root: Path, tokenizer, n: int = 28) -> dict:
    """target/, prepared/ and store/ (fp32) under root; returns their paths."""
    import torch

    from hstap.capture import CaptureConfig, capture
    from hstap.data import PrepareConfig, prepare
    from hstap.toy import build_random_target, stdlib_conversations

    target = root / "target"
    model = build_random_target(target, tokenizer, model_type="llama", num_layers=6, hidden_size=64, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # a peaked target: a learnable signal, argmaxes both in and out of the vocab
    model.save_pretrained(str(target))
    rng = random.Random(0)
    convs = stdlib_conversations()
    rng.shuffle(convs)
    lines = []
    for c in convs[:n]:
        user, asst = c["conversations"]
        lines.append(json.dumps({"id": c["id"], "conversations": [
            user, {"role": "assistant", "content": asst["content"][:rng.randint(40, 240)]}]}))
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare(PrepareConfig(tokenizer=str(target), data=[str(root / "chats.jsonl")], out=str(root / "prepared"),
                              draft_vocab=96))
        capture(CaptureConfig(target=str(target), data=str(root / "prepared"), out=str(root / "store"), layers="1,3,4",
                              dtype="fp32", device="cpu", batch_tokens=4096))
    return {"target": target, "prepared": root / "prepared", "store": root / "store"}


def metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(train lines, eval lines) of RUN/metrics.jsonl."""
    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if not r.get("eval")], [r for r in rows if r.get("eval")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(argv: list[str], env: dict, log_path: str) -> None:
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    torch.set_num_threads(1)
    from hstap.cli import make_config
    from hstap.common import HstapError
    from hstap.train import TrainConfig, train

    try:
        train(make_config("train", TrainConfig, list(argv)))
        code = 0
    except HstapError as e:
        print(f"hstap: error: {e}")
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CTX = None


def forkserver():
    global _CTX
    if _CTX is None:
        here = str(Path(__file__).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def start_forkserver() -> None:
    from multiprocessing import forkserver as fs

    forkserver()
    fs.ensure_running()


class Child:
    """`hstap train <argv>` in a forked child; env adds to the environment (RANK, WORLD_SIZE, ... for gloo ranks)."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = Path(log)
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = forkserver().Process(target=_child, args=(list(argv), env, str(self.log)), daemon=False)
        self.proc.start()

    def kill(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 180.0) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.kill()
            self.proc.join()
            raise AssertionError(f"child did not finish in {timeout} s; log:\n{self.output()[-3000:]}")
        return self.proc.exitcode

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def ranks(argv: list[str], logdir: Path, world: int = 2) -> list[Child]:
    """`world` gloo ranks of one run, launched the way torchrun would (env vars), as real processes."""
    port = str(free_port())
    Path(logdir).mkdir(parents=True, exist_ok=True)
    return [Child(argv, logdir / f"rank{r}.log", {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                                   "MASTER_PORT": port}) for r in range(world)]
