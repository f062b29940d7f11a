"""Helpers for the capture tests: a small prepared set, store comparison, and CLI runs in real child processes
(forked from the shared forkserver of `helpers.procs`). One test still runs a fresh `sys.executable` (the real entry
point).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

from helpers.procs import Child, redirect_output


def corpus(n: int, seed: int = 0, min_chars: int = 10, max_chars: int = 260) -> list[dict]:
    """n chat records of varied length (answers cut to a random size) from the stdlib docs."""
    from hstap.demo.toy import stdlib_conversations

    rng = random.Random(seed)
    convs = stdlib_conversations()
    rng.shuffle(convs)
    out = []
    for c in convs[:n]:
        user, asst = c["conversations"]
        cut = rng.randint(min_chars, max_chars)
        out.append({"id": c["id"], "conversations": [user, {"role": "assistant", "content": asst["content"][:cut]}]})
    return out


def prepare_records(tokenizer_dir: Path, out: Path, recs: list[dict], **settings) -> Path:
    """`hstap prepare` (quiet; PrepareConfig `settings`, a draft vocabulary of 64 unless they set one) of the chat
    records `recs`, written beside `out` as OUT.jsonl -> out."""
    import contextlib
    import io

    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import prepare

    jsonl = out.parent / f"{out.name}.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(PrepareConfig(tokenizer=str(tokenizer_dir), data=[str(jsonl)], out=str(out),
                              **{"draft_vocab": 64, **settings}))
    return out


def make_prepared(tokenizer_dir: Path, out: Path, n: int, seed: int = 0, chat_template: str | None = None,
                  **kw) -> Path:
    """A prepared set of `corpus(n, seed, **kw)`."""
    return prepare_records(tokenizer_dir, out, corpus(n, seed, **kw), chat_template=chat_template)


def store_samples(path) -> dict[str, dict]:
    """id -> sample of a store, plus checks that every id is there once and that verify() is clean."""
    from hstap.store.reader import open_store

    s = open_store(path)
    problems = s.verify()
    assert problems == [], problems
    assert len(set(s.ids)) == len(s.ids), "a sample id appears twice"
    return {s.ids[i]: s[i] for i in range(len(s))}


def committed_count(store) -> int:
    """Samples a store has committed so far, as a resumed capture counts them (`committed_ids_of`); 0 before its
    manifest exists. What the kill tests poll while a capture runs."""
    from hstap.common import HstapError
    from hstap.store.manifest import committed_ids_of

    try:
        return len(committed_ids_of(store))
    except HstapError:
        return 0


def assert_same_store(a: dict[str, dict], b: dict[str, dict], atol: float = 1e-5) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for sid in a:
        x, y = a[sid], b[sid]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"]), sid
        torch.testing.assert_close(x["aux"], y["aux"], rtol=1e-5, atol=atol)
        torch.testing.assert_close(x["final"], y["final"], rtol=1e-5, atol=atol)


# ---------------------------------------------------------------------------------------------------------------------
# CLI runs in forked children


def _child(argv: list[str], env: dict, log_path: str, fsize_limit: int | None) -> None:
    """Body of a child process: `hstap <argv>` with stdout+stderr to log_path; exit status = the CLI's."""
    os.environ.update(env)
    redirect_output(log_path)
    if fsize_limit is not None:  # a real OS write failure (EFBIG) once a file would grow past the limit
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    import torch

    torch.set_num_threads(1)  # tiny model, shared 2-core box
    from hstap import cli

    code = cli.main(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _make_tqdm_lock() -> None:
    # datasets.load_from_disk takes tqdm's multiprocessing lock; created here (in the forkserver, at preload) the
    # children inherit it instead of registering a named semaphore that a SIGKILL would leak (a warning at exit).
    from tqdm import tqdm

    tqdm.get_lock()


_make_tqdm_lock()


class Run(Child):
    """One `hstap ...` child process (fsize_limit: RLIMIT_FSIZE in bytes, for real EFBIG write failures)."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None, fsize_limit: int | None = None):
        super().__init__(_child, argv, log, env, extra=(fsize_limit,))


def run_cli(argv: list[str], log: Path, **kw) -> tuple[int, str]:
    r = Run(argv, log, **kw)
    code = r.wait()
    return code, r.output()
