"""Assets and child processes for the training tests.

Assets: a tiny random Llama target (6 layers, H=64, its lm_head scaled up so that the target distribution is peaked and
a drafter has something to learn), a prepared set of stdlib-documentation chats (hstap.data.prepare.prepare, a 96-token draft
vocabulary) and an fp32 store captured from it by the real capture stage (hstap.capture.stage, layers 1,3,4).
`states_store` writes a store of random states of that target's shape with the real StoreWriter (ids of one's
choosing, writing ended or not). `cli_argv`, `ids_log` and `train_lines` turn options into train's flags and read what a
--follow run wrote.

Child processes: `hstap.train.stage` runs as real processes (gloo process groups across them), forked from the shared
forkserver of `helpers.procs`. Children run single-threaded, like the in-process reference runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import sys
from pathlib import Path

from helpers import procs
from helpers.procs import redirect_output, start_forkserver  # noqa: F401 (re-exported)

from hstap.common import free_port


def build_assets(root: Path, tokenizer, n: int = 28, with_store: bool = True) -> dict:
    """target/, prepared/ and (with_store) store/ (fp32) under root; returns their paths."""
    import torch

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import prepare
    from hstap.demo.toy import build_random_target, stdlib_conversations

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
    if not with_store:
        return {"target": target, "prepared": root / "prepared"}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        capture(CaptureConfig(target=str(target), data=str(root / "prepared"), out=str(root / "store"), layers="1,3,4",
                              dtype="fp32", device="cpu", batch_tokens=4096))
    return {"target": target, "prepared": root / "prepared", "store": root / "store"}


def metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(train lines, eval lines) of RUN/metrics.jsonl."""
    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if not r.get("eval")], [r for r in rows if r.get("eval")]


def cli_argv(opts: dict) -> list[str]:
    """{"batch_tokens": 600, "follow": True} -> ["--batch-tokens", "600", "--follow"]."""
    out = []
    for k, v in opts.items():
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def ids_log(run: Path) -> list[dict]:
    """RUN/follow.jsonl's lines (a line being written is left out)."""
    rows = []
    for line in (Path(run) / "follow.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def train_lines(run: Path) -> list[tuple]:
    """What a train line of RUN/metrics.jsonl says of the training itself (no timings)."""
    return [(r["step"], r["loss"], r["loss_k"], r["acc"], r["grad_norm"], r["lr"]) for r in metrics(run)[0]]


def states_store(path: Path, target: Path, names: list[str], seed: int, shard_tokens: int = 1,
                 layers: tuple = (1, 3, 4), hidden: int = 64, close: bool = True) -> None:
    """A store written by the real StoreWriter with random fp32 states of the training assets' target's shape (its
    fingerprint in the header) for samples `names`: 20-79 tokens each, token ids of the target's vocabulary; with
    shard_tokens=1 one sample per shard. close=False leaves the writer's rank open (writing not ended)."""
    import torch

    from hstap.artifacts.model_dir import target_fingerprint
    from hstap.store.writer import StoreWriter

    hdr = {"target": target_fingerprint(target), "engine": {"name": "test"}, "dtype": "fp32", "layers": list(layers),
           "hidden_size": hidden}
    w = StoreWriter(path, hdr, shard_tokens=shard_tokens)
    gen = torch.Generator().manual_seed(seed)
    for name in names:
        T = int(torch.randint(20, 80, (1,), generator=gen))
        w.add(name, torch.randint(0, 90, (T,), generator=gen), torch.ones(T, dtype=torch.long),
              torch.randn(T, len(layers), hidden, generator=gen), torch.randn(T, hidden, generator=gen))
    if close:
        w.close()
    else:
        w.flush()


def _child(argv: list[str], env: dict, log_path: str) -> None:
    os.environ.update(env)
    redirect_output(log_path)
    import torch

    torch.set_num_threads(1)
    from hstap.cli import make_config
    from hstap.common import HstapError
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    try:
        train(make_config("train", TrainConfig, list(argv)))
        code = 0
    except HstapError as e:
        print(f"hstap: error: {e}")
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Child(procs.Child):
    """`hstap train <argv>` in a forked child; env adds to the environment (RANK, WORLD_SIZE, ... for gloo ranks)."""

    timeout = 180.0

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        super().__init__(_child, argv, log, env)


def ranks(argv: list[str], logdir: Path, world: int = 2) -> list[Child]:
    """`world` gloo ranks of one run, launched the way torchrun would (env vars), as real processes."""
    port = str(free_port())
    Path(logdir).mkdir(parents=True, exist_ok=True)
    return [Child(argv, logdir / f"rank{r}.log", {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                                   "MASTER_PORT": port}) for r in range(world)]


def greedy_drafter(target_dir: Path, root: Path, ttt: int = 3, n_new: int = 24, steps: int = 80,
                   layers: str = "1,3,4") -> tuple[Path, Path]:
    """(prepared set of the target's own greedy answers, a training RUN of a short drafter on them) under root: 16
    stdlib prompts, each followed by `n_new` greedy tokens of the target (identity draft map: every argmax countable),
    an fp32 store of `layers`, `steps` steps of TTT `ttt` (eval split = the store)."""
    import shutil

    import datasets
    import numpy as np
    import pyarrow as pa

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import load_prepared, prepare, record_batch
    from hstap.artifacts.model_dir import load_target
    from hstap.speculative.drivers import target_generate
    from hstap.data.prompts import prompt_from_mask
    from hstap.speculative.evaluate import eos_ids
    from hstap.demo.toy import stdlib_conversations
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    convs = [{"id": c["id"], "conversations": c["conversations"][:1] + [{"role": "assistant", "content": "x"}]}
             for c in stdlib_conversations()[:16]]
    (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        prepare(PrepareConfig(tokenizer=str(target_dir), data=[str(root / "c.jsonl")], out=str(root / "p0"),
                              draft_vocab=100000))
        target, tok = load_target(str(target_dir), device="cpu", dtype="fp32")
        eos = eos_ids(tok, target)
        rows = list(load_prepared(root / "p0"))
        ids, masks = [], []
        for r in rows:  # each prompt followed by the target's own greedy answer, as the prepared set's answer
            p = prompt_from_mask(r["input_ids"], r["loss_mask"])
            a = target_generate(target, p, n_new, eos_ids=eos)[0]
            ids.append(np.array(p + a, dtype=np.int32))
            masks.append(np.array([0] * len(p) + [1] * len(a), dtype=np.int8))
        greedy = root / "greedy"
        greedy.mkdir()
        for f in ("meta.json", "vocab_map.safetensors"):
            shutil.copy(root / "p0" / f, greedy / f)
        table = pa.Table.from_batches([record_batch([r["id"] for r in rows], ids, masks)])
        datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(greedy))
        capture(CaptureConfig(target=str(target_dir), data=str(greedy), out=str(root / "store"), layers=layers,
                              dtype="fp32", device="cpu"))
        run = root / "run"
        train(from_flags(TrainConfig, out=str(run), target=str(target_dir), store=str(root / "store"),
                         eval_store=str(root / "store"), ttt=ttt, steps=steps, lr=5e-3, warmup_ratio=0.0,
                         batch_tokens=4096, save_every=steps, device="cpu", tensorboard=False))
    return greedy, run
