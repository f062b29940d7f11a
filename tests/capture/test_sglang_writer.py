"""The SGLang capture hook's writer thread (capture/sglang/writer.py) under SIGKILL: a real process streams requests
through the hook (real sglang types, no server) and is killed mid-stream; the committed shards are intact, and a new hook
on the same store (the next driver session) stores the rest, every sample exactly once with its exact values."""

from __future__ import annotations

import importlib.util
import json
import random
import time

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # installed but broken must fail, not skip: no importorskip
    pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23, see docs/engines.md)",
                allow_module_level=True)

from helpers.sglang_hook import LAYERS, attach, expected, feed, stream_child  # noqa: E402
from helpers.procs import Child, start_forkserver  # noqa: E402
from helpers.sglang import create_store, records  # noqa: E402

from hstap.data.prepare import load_prepared  # noqa: E402
from hstap.store.reader import open_store  # noqa: E402

pytestmark = pytest.mark.procs

N = 30


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    start_forkserver()  # its imports overlap the prepare of `prepared`


def prepared_records() -> list[dict]:
    """The chats of this module's `prepared` set (conftest.py)."""
    return records(N, seed=5)


def _commits(store) -> int:
    try:
        return len(json.loads((store / "parts" / "rank000.json").read_bytes())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def _check(store, ds) -> list[str]:
    """verify() clean, no id twice, every stored sample equal to what was fed -> the stored ids."""
    s = open_store(store)
    assert s.verify() == [] and len(set(s.ids)) == len(s.ids)
    rows = {ds[r]["id"]: r for r in range(len(ds))}
    for i in range(len(s)):
        got, want = s[i], expected(ds, rows[s.ids[i]])
        assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "loss_mask", "aux", "final")), s.ids[i]
    return list(s.ids)


@pytest.mark.slow
def test_sigkill_of_the_hook_writer_mid_stream_then_a_new_hook_resumes(tiny_llama, prepared, tmp_path):
    store = tmp_path / "store"
    create_store(tiny_llama, prepared, store, LAYERS)
    ds = load_prepared(prepared)
    child = Child(stream_child, [], tmp_path / "child.log",
                  extra=(str(store), str(prepared), str(tiny_llama), list(range(N)), 0.03))
    deadline, want = time.monotonic() + 120, random.Random(7).randint(3, 6)
    while _commits(store) < want and child.proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(random.Random(8).uniform(0, 0.02))  # somewhere inside the next shard
    alive = child.proc.is_alive()
    child.kill()
    assert child.wait() == -9 and alive, f"the stream ended before the kill:\n{child.output()[-3000:]}"
    before = _check(store, ds)
    assert 0 < len(before) < N, (len(before), child.output()[-2000:])

    root, hook = attach(store, prepared, tiny_llama, flush_s=0.05, shard_tokens=64)  # the next session: all rows
    feed(root, ds, range(N), "resumed")
    hook.close()
    after = _check(store, ds)
    assert sorted(after) == sorted(ds[r]["id"] for r in range(N))  # every sample once, none lost
    assert set(before) <= set(after) and hook.stats["duplicates"] == len(before) and hook.stats["samples"] == N - len(
        before)
    assert not list((store / "shards").glob(".*.tmp"))  # the killed writer's temp shard was cleaned up
