"""`hstap train --follow` with real processes: capture (a child, one sample per shard) and a consuming follow trainer
(a child) run side by side; both are killed with SIGKILL at seeded moments and resumed. The trainer's losses and the
ids it trained on equal those of an uninterrupted follow run (bitwise, CPU fp32); every sample is trained on exactly
--epochs times, none is consumed before its last use, the store stays within its window and valid, and capture's
resume never captures a consumed sample again. Then two gloo ranks (FSDP2) follow a growing store and take the same
stream as one process with two micro-batches per step. The store side (back-pressure, consumed shards, the end of
writing) and the stream's pure parts are tested in tests/store/test_consumer.py."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import random
import time
from pathlib import Path

import pytest
from helpers.capture import Run
from helpers.train import Child, cli_argv, ids_log, metrics, ranks, train_lines

from hstap.store.manifest import committed_ids_of, load_manifest, load_parts, union_entries

pytestmark = pytest.mark.procs

EPOCHS, KEEP = 2, 4


ASSETS = {"n": 20, "with_store": False}  # `build_assets`' settings of this module's `assets` (conftest.py)


def _capture_argv(a, store, batch_tokens=1, shard_tokens=1) -> list[str]:
    # --batch-tokens 1: every sample runs alone (no padding), so a killed and resumed capture computes the same bits;
    # --shard-tokens 1: one sample per shard, so its shards are the same whatever was killed when
    return ["capture", "--target", str(a["target"]), "--data", str(a["prepared"]), "--out", str(store), "--layers",
            "1,3,4", "--dtype", "fp32", "--device", "cpu", "--batch-tokens", str(batch_tokens), "--shard-tokens",
            str(shard_tokens)]


def _train_opts(a, store, out, **kw) -> dict:
    return {"store": store, "target": a["target"], "out": out, "vocab_map": a["prepared"], "eval_frac": 0.0,
            "batch_tokens": 600, "ttt": 3, "lr": 3e-3, "log_every": 1, "save_every": 4, "device": "cpu",
            "tensorboard": False, "follow": True, **kw}


def _consumed_ids(store: Path) -> set[str]:
    """Ids of the shards consumer.json marks consumed, from the part files (which keep every entry)."""
    try:
        rec = json.loads((store / "consumer.json").read_bytes())
        entries, _, _ = union_entries(load_manifest(store), load_parts(store))
    except Exception:  # noqa: BLE001 - no store or no record yet
        return set()
    return {i for e in entries if e["seq"] < rec["consumed"].get(str(e["rank"]), 0) for i in e["ids"]}


@pytest.mark.slow
def test_capture_and_follow_train_killed_and_resumed_equal_an_uninterrupted_run(assets, tmp_path):
    opts = dict(consume=True, keep_shards=KEEP, epochs=EPOCHS, replay_fraction=0.25)
    # The uninterrupted reference: capture first, then follow the finished store (in this process, one thread).
    from hstap.cli import main, make_config
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    ref_store = tmp_path / "ref-store"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(_capture_argv(assets, ref_store)) == 0
        train(make_config("train", TrainConfig, cli_argv(_train_opts(assets, ref_store, tmp_path / "ref", **opts))))
    ids = committed_ids_of(ref_store)
    assert len(ids) == 20

    # Side by side, with SIGKILLs: the trainer first (it claims the store: writers keep to the window from shard one).
    store, run, logs = tmp_path / "store", tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    rng = random.Random(18)
    kills = {"train": sorted(rng.sample(range(3, 24), 2)), "capture": sorted(rng.sample(range(2, 16), 2))}
    starts = collections.Counter()

    def start(kind: str):
        starts[kind] += 1
        log = logs / f"{kind}{starts[kind]}.log"
        if kind == "train":
            return Child(cli_argv(_train_opts(assets, store, run, **opts, resume=starts[kind] > 1)), log)
        return Run(_capture_argv(assets, store), log)

    procs = {"train": start("train")}
    while not (store / "consumer.json").exists():
        assert procs["train"].proc.is_alive(), procs["train"].output()
        time.sleep(0.01)
    procs["capture"] = start("capture")
    progress = {"train": lambda: len(ids_log(run)) if (run / "follow.jsonl").exists() else 0,
                "capture": lambda: len(committed_ids_of(store)) if (store / "manifest.json").exists() else 0}
    peak, landed, early, t0 = 0, collections.Counter(), [], time.monotonic()
    while any(p.proc.exitcode is None for p in procs.values()):
        assert time.monotonic() - t0 < 150, {k: p.output()[-2000:] for k, p in procs.items()}
        peak = max(peak, sum(1 for _ in (store / "shards").iterdir()) if (store / "shards").is_dir() else 0)
        consumed = _consumed_ids(store)
        if consumed:  # a consumed sample had all its EPOCHS passes in the logged steps
            uses = collections.Counter(i for row in ids_log(run) for i in row["ids"])
            early += [i for i in consumed if uses[i] < EPOCHS]
        for kind, p in procs.items():
            if kills[kind] and p.proc.exitcode is None and progress[kind]() >= kills[kind][0]:
                kills[kind].pop(0)
                time.sleep(rng.uniform(0, 0.02))
                p.kill()
                if p.wait() == -9:
                    landed[kind] += 1
                    procs[kind] = start(kind)
            elif p.proc.exitcode not in (None, 0):
                raise AssertionError(f"{kind} failed:\n{p.output()[-3000:]}")
        time.sleep(0.002)
    assert landed["train"] >= 1 and landed["capture"] >= 1, (landed, starts)
    assert early == [], "consumed before its last use"
    assert 0 < peak <= KEEP, peak

    # The same training as the uninterrupted run, bit for bit, on the same samples, each EPOCHS times.
    assert train_lines(run) == train_lines(tmp_path / "ref")
    assert ids_log(run) == ids_log(tmp_path / "ref")
    uses = collections.Counter(i for row in ids_log(run) for i in row["ids"])
    assert set(uses) == ids and set(uses.values()) == {EPOCHS}
    assert any(row["replay"] for row in ids_log(run))
    # Everything was consumed; what remains is a valid (empty) store that still knows every committed sample once.
    from hstap.store.reader import open_store

    st = open_store(store)
    assert len(st) == 0 and st.verify() == [] and not list((store / "shards").iterdir())
    entries, problems, _ = union_entries(load_manifest(store), load_parts(store))
    assert problems == [] and sorted(i for e in entries for i in e["ids"]) == sorted(ids)
    rec = json.loads((store / "consumer.json").read_bytes())
    assert rec["active"] is False and rec["consumed"] == {"0": 20}
    # A capture re-run now skips every sample (consumed ones included) and never blocks: the window is released.
    code = Run(_capture_argv(assets, store), logs / "again.log")
    assert code.wait() == 0 and "0 samples" in code.output() and "20 already in the store" in code.output()


def test_two_gloo_ranks_follow_a_growing_store_like_one_process(assets, tmp_path):
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.cli import make_config
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    store, ref = tmp_path / "store", tmp_path / "ref-store"
    common = dict(save_every=5, ttt=2)  # 10 steps: the last checkpoint comes before the stream's end is known
    # two FSDP2 ranks wait for the store, then follow it while a capture child writes it
    fsdp = ranks(cli_argv(_train_opts(assets, store, tmp_path / "fsdp", consume=True, keep_shards=2, fsdp=True,
                                   **common)), tmp_path / "fsdp_logs")
    cap = Run(_capture_argv(assets, store, batch_tokens=256, shard_tokens=300), tmp_path / "capture.log")
    # one process, two micro-batches per step, on the same shards captured beforehand: the same global batches
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        capture(CaptureConfig(target=str(assets["target"]), data=str(assets["prepared"]), out=str(ref),
                              layers="1,3,4", dtype="fp32", device="cpu", batch_tokens=256, shard_tokens=300))
        train(make_config("train", TrainConfig, cli_argv(_train_opts(assets, ref, tmp_path / "one", grad_accum=2,
                                                                  **common))))
    assert cap.wait() == 0, cap.output()
    for c in fsdp:
        assert c.wait() == 0, c.output()[-3000:]
    assert len(load_manifest(ref)["shards"]) >= 4
    assert ids_log(tmp_path / "fsdp") == ids_log(tmp_path / "one")  # the same stream, dealt to two ranks
    a, b = metrics(tmp_path / "fsdp")[0], metrics(tmp_path / "one")[0]
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) >= 4
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["acc"] == pytest.approx(y["acc"], abs=1e-9)
    assert not list((store / "shards").iterdir())  # both ranks used every shard, rank 0 consumed them
    assert json.loads((store / "consumer.json").read_bytes())["active"] is False


def test_two_writer_ranks_give_the_canonical_order_whatever_the_arrival(assets, tmp_path):
    """Rank 1 commits first and rank 0 starts late: the trainer waits for rank 0, takes the shards round robin, skips
    rank 1 once it closed; a run over the finished store takes the same stream and the same losses."""
    import threading

    import torch

    from hstap.cli import make_config
    from hstap.artifacts.model_dir import target_fingerprint
    from hstap.store.writer import StoreWriter
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    store = tmp_path / "store"
    hdr = {"target": target_fingerprint(assets["target"]), "engine": {"name": "test"}, "dtype": "fp32",
           "layers": [1, 3, 4], "hidden_size": 64}
    w0, w1 = (StoreWriter(store, hdr, rank=r, world_size=2, shard_tokens=1) for r in (0, 1))
    gen = torch.Generator().manual_seed(0)

    def add(w, name):  # one sample per shard (shard_tokens=1): random states, tokens of the target's vocabulary
        T = int(torch.randint(20, 120, (1,), generator=gen))
        w.add(name, torch.randint(0, 90, (T,), generator=gen), torch.ones(T, dtype=torch.long),
              torch.randn(T, 3, 64, generator=gen), torch.randn(T, 64, generator=gen))

    def follow(out):
        train(make_config("train", TrainConfig, cli_argv(_train_opts(assets, store, out, skip_verify=True)) + []))

    t = threading.Thread(target=follow, args=(tmp_path / "live",))
    t.start()
    add(w1, "b0")
    add(w1, "b1")
    time.sleep(0.5)  # the trainer waits for rank 0's first shard meanwhile
    assert not (tmp_path / "live" / "follow.jsonl").exists()
    add(w0, "a0")
    w1.close()
    add(w0, "a1")
    add(w0, "a2")
    w0.close()
    t.join(120)
    assert [row["ids"] for row in ids_log(tmp_path / "live")] == [["a0"], ["b0"], ["a1"], ["b1"], ["a2"]]
    follow(tmp_path / "after")
    assert ids_log(tmp_path / "after") == ids_log(tmp_path / "live")
    assert train_lines(tmp_path / "after") == train_lines(tmp_path / "live")


def test_a_damaged_shard_stops_the_stream_at_its_first_slot(assets, tmp_path):
    """--follow hashes each shard once, at the first slot that reads it (a growing store has no "before the first
    step" for all of its shards): a flipped bit in the second shard stops the run with one line naming it, after the
    steps of the first shard and before any step on the damaged one."""
    import torch

    from hstap.cli import make_config
    from hstap.common import HstapError
    from hstap.artifacts.model_dir import target_fingerprint
    from hstap.store.writer import StoreWriter
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    store = tmp_path / "store"
    hdr = {"target": target_fingerprint(assets["target"]), "engine": {"name": "test"}, "dtype": "fp32",
           "layers": [1, 3, 4], "hidden_size": 64}
    gen = torch.Generator().manual_seed(1)
    with StoreWriter(store, hdr, shard_tokens=1) as w:  # one sample per shard
        for name in ("a", "b", "c"):
            T = int(torch.randint(20, 60, (1,), generator=gen))
            w.add(name, torch.randint(0, 90, (T,), generator=gen), torch.ones(T, dtype=torch.long),
                  torch.randn(T, 3, 64, generator=gen), torch.randn(T, 64, generator=gen))
    f = store / load_manifest(store)["shards"][1]["file"]
    blob = bytearray(f.read_bytes())
    blob[-8] ^= 0x01
    f.write_bytes(bytes(blob))
    with pytest.raises(HstapError, match=f"^{f}: sha256 differs from the one recorded"):
        train(make_config("train", TrainConfig, cli_argv(_train_opts(assets, store, tmp_path / "run", skip_verify=True))))
    assert [row["ids"] for row in ids_log(tmp_path / "run")] == [["a"]]
