"""hstap.store.writer: commit protocol, resume rules, shard sizing (expect, shard_bytes), early writeback,
when_written, resume after SIGKILL, multi-rank writes, ENOSPC, a failing hash."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import threading
import time

import pytest
import torch
from helpers.store import H, K, grow_tmpfs, header, raw, sample, sid, small_tmpfs, write

from hstap.common import HstapError
from hstap.store.format import store_bytes_per_token
from hstap.store.manifest import merge_manifest
from hstap.store.reader import open_store
from hstap.store.writer import StoreWriter


def test_header_mismatch_refused_and_new_replaces(tmp_path):
    p = tmp_path / "s"
    write(p, 20)
    for field, value in [("target.config_sha256", "x"), ("target.weights_fingerprint", "x"),
                         ("target.tokenizer_sha256", "x"), ("target.chat_template_sha256", "x"),
                         ("layers", [1, 3, 5]), ("dtype", "fp8"), ("hidden_size", 32)]:
        with pytest.raises(HstapError, match=field.replace(".", r"\.")):
            StoreWriter(p, header(**{field.split(".")[-1]: value}))
    # engine/capture settings may change between a run and its resume
    w = StoreWriter(p, header(engine={"name": "sglang"}, capture_config={"batch_tokens": 1}))
    assert len(w.committed_ids()) == 20
    w.close()
    (p / "config.json").write_text("{}")  # a user's/capture's own file: new=True must leave it alone
    w = StoreWriter(p, header(hidden_size=32), new=True)
    assert w.committed_ids() == set() and list((p / "shards").iterdir()) == [] and (p / "config.json").exists()
    w.close()
    s = open_store(p)
    assert len(s) == 0 and s.header["hidden_size"] == 32 and "shards" not in s.header
    with pytest.raises(HstapError, match="no manifest.json"):
        open_store(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text('{"format": "hstap-store",\n "version": 1,\n oops}')
    with pytest.raises(HstapError, match=r"manifest.json:3: manifest is not valid JSON"):
        open_store(tmp_path / "bad")


def test_add_and_flush_from_two_threads(tmp_path):
    w = StoreWriter(tmp_path / "s", header(), shard_tokens=10_000)
    stop = threading.Event()

    def flusher():
        while not stop.is_set():
            w.flush()

    t = threading.Thread(target=flusher)
    t.start()
    for i in range(60):
        w.add(sid(i), *sample(i))
        deadline = time.time() + 30
        while i == 29 and w.committed_samples == 0 and time.time() < deadline:
            time.sleep(0.001)  # let the flusher commit at least once mid-run (else the check below is luck)
    stop.set()
    t.join()
    w.close()
    s = open_store(tmp_path / "s")
    assert s.ids == [sid(i) for i in range(60)] and s.verify() == [] and len(s.manifest["shards"]) > 1
    assert raw(s[50]["aux"]) == raw(sample(50)[2].to(torch.bfloat16))


def test_expect_shrinks_the_last_shards_and_stores_the_same_samples(tmp_path):
    n = 600
    total = sum(len(sample(i)[0]) for i in range(n))  # ~12,000 tokens: 7-8 shards of 1,600
    plain = write(tmp_path / "plain", n, shard_tokens=1600)
    assert plain.summary["samples"] == n
    w = StoreWriter(tmp_path / "tail", header(), shard_tokens=1600)
    w.expect(total)
    for i in range(n):
        w.add(sid(i), *sample(i))
    w.close()
    a, b = open_store(tmp_path / "plain"), open_store(tmp_path / "tail")
    assert a.ids == b.ids and b.verify() == []
    for i in range(0, n, 7):
        assert all(raw(a[i][k]) == raw(b[i][k]) for k in ("input_ids", "loss_mask", "aux", "final"))
    fixed = [e["tokens"] for e in a.manifest["shards"]]
    tail = [e["tokens"] for e in b.manifest["shards"]]
    assert tail[:4] == fixed[:4]  # far from the end: the same full shards
    # near the end each shard closes at a third of what is still to come, never below 1/16 of the limit (100 tokens)
    assert tail[-1] < 100 + 40 and len(tail) > len(fixed)
    left = total
    for j, (t, e) in enumerate(zip(tail, b.manifest["shards"])):
        last = e["lengths"][-1]
        assert t - last < min(1600, max(100, -(-(left - t + last) // 3)))  # still open before its last sample
        if j < len(tail) - 1:
            assert t >= min(1600, max(100, -(-(left - t) // 3)))  # closed by add(), at the limit
        left -= t
    assert left == 0
    with pytest.raises(HstapError, match="tokens >= 0"):
        w.expect(-1)


def test_early_writeback_hands_every_byte_over_once_in_page_aligned_ranges(tmp_path, monkeypatch):
    import hstap.store.shard_file as shard_file

    calls = []
    monkeypatch.setattr(shard_file, "_sfr", lambda fd, off, n, flags: calls.append((off, n, flags)) or 0)
    monkeypatch.setattr(shard_file, "WRITEBACK_BYTES", 4096)
    write(tmp_path / "on", 60, shard_tokens=300)
    files = [tmp_path / "on" / e["file"] for e in open_store(tmp_path / "on").manifest["shards"]]
    assert len(files) > 2 and len(calls) > 2 * len(files) and all(f == 2 for _, _, f in calls)  # while writing
    # per file, in write order, the ranges tile [0, size) exactly; each starts on a page boundary
    sizes, pos, k = [f.stat().st_size for f in files], 0, 0
    for off, n, _ in calls:
        if off == 0 and pos:
            assert pos == sizes[k]
            k, pos = k + 1, 0
        assert off == pos and n > 0 and off % 4096 == 0
        pos += n
    assert pos == sizes[k] and k == len(files) - 1
    calls.clear()
    monkeypatch.setattr(shard_file, "START_WRITEBACK", False)
    write(tmp_path / "off", 60, shard_tokens=300)
    assert calls == []
    a, b = open_store(tmp_path / "on").manifest["shards"], open_store(tmp_path / "off").manifest["shards"]
    assert [e["sha256"] for e in a] == [e["sha256"] for e in b]


def test_expect_boundaries_bytes_limit_and_overrun(tmp_path):
    # equal lengths make the limits exact: 10-token samples, limit 160 tokens, floor 10
    g = torch.Generator().manual_seed(0)

    def s10():
        return (torch.randint(0, 100, (10,), generator=g), torch.ones(10, dtype=torch.uint8),
                torch.randn(10, K, H, generator=g), torch.randn(10, H, generator=g))

    w = StoreWriter(tmp_path / "a", header(), shard_tokens=160)
    w.expect(300)
    for i in range(30):
        w.add(sid(i), *s10())
    w.close()
    # closes once open >= ceil(left / 3): 300 -> shard of 80 (80 >= ceil(220/3) = 74, 70 < ceil(230/3) = 77), then
    # 60, 40 (exactly ceil(120/3)), 30, 30, 20, and the 10-token floor
    want = [80, 60, 40, 30, 30, 20, 10, 10, 10, 10]
    assert [e["tokens"] for e in open_store(tmp_path / "a").manifest["shards"]] == want
    bpt = store_bytes_per_token(K, H, "bf16")
    w = StoreWriter(tmp_path / "b", header(), shard_tokens=10_000, shard_bytes=160 * bpt)  # the bytes limit rules
    assert w.shard_limit_bytes == 160 * bpt
    for name, kw, limit in (("b2", {"shard_tokens": 7, "shard_bytes": 160 * bpt}, 7 * bpt),
                            ("b3", {"shard_bytes": bpt + 1}, 2 * bpt)):  # rounded up to whole tokens
        with StoreWriter(tmp_path / name, header(), **kw) as other:
            assert other.shard_limit_bytes == limit
    w.expect(300)
    for i in range(30):
        w.add(sid(i), *s10())
    w.close()
    assert [e["tokens"] for e in open_store(tmp_path / "b").manifest["shards"]] == want
    w = StoreWriter(tmp_path / "c", header(), shard_tokens=160)
    w.expect(20)  # fewer than are added: the rest gets full-size shards, not a stream of floor-sized ones
    for i in range(40):
        w.add(sid(i), *s10())
    w.close()
    assert [e["tokens"] for e in open_store(tmp_path / "c").manifest["shards"]] == [10, 10, 160, 160, 60]
    with pytest.raises(HstapError, match="after close"):
        w.expect(10)


def test_when_written_runs_after_the_commit_and_never_for_dropped_samples(tmp_path):
    w = StoreWriter(tmp_path / "s", header(), shard_tokens=100)
    calls = []
    w.when_written(lambda: calls.append(("empty", len(w.committed_ids()))))  # nothing pending: called at once
    assert calls == [("empty", 0)]
    w.add(sid(0), *sample(0, max_len=40))
    w.when_written(lambda: calls.append(("s0", sorted(w.committed_ids()))))
    assert len(calls) == 1  # sample 0 is still in the open shard
    i = 1
    while len(calls) == 1:  # the callback fires inside the add that commits the shard, after the commit point
        w.add(sid(i), *sample(i, max_len=40))
        i += 1
    assert calls[1][0] == "s0" and sid(0) in calls[1][1] and (tmp_path / "s" / "parts" / "rank000.json").is_file()
    w.add(sid(i), *sample(i, max_len=40))
    w.when_written(lambda: calls.append("dropped"))
    with pytest.raises(RuntimeError):
        with w:
            raise RuntimeError("boom")  # an exception inside `with` drops the open shard: no callback
    assert calls[-1] != "dropped" and sid(i) not in open_store(tmp_path / "s").ids


def _killable_writer(path: str, n: int, ready) -> None:
    torch.set_num_threads(1)
    w = StoreWriter(path, header(), shard_tokens=60)
    done = w.committed_ids()
    ready.set()
    for i in range(n):
        if sid(i) not in done:
            w.add(sid(i), *sample(i))
    w.close()


@pytest.mark.procs
def test_resume_after_sigkill_at_random_moments(tmp_path):
    n, p = 400, tmp_path / "s"
    ctx = mp.get_context("fork")  # fork: a killed writer costs milliseconds, not a fresh interpreter
    rnd = random.Random(1234)
    progress, kills_mid_run = [0], 0
    for _ in range(12):
        ready = ctx.Event()
        proc = ctx.Process(target=_killable_writer, args=(str(p), n, ready))
        proc.start()
        assert ready.wait(30)
        time.sleep(rnd.uniform(0.002, 0.03))
        kills_mid_run += proc.exitcode is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        s = open_store(p)  # after every kill: committed shards are intact and never duplicated
        assert s.verify() == [] and len(set(s.ids)) == len(s.ids) >= progress[-1]
        progress.append(len(s))
    assert kills_mid_run >= 10 and 0 < progress[-1] < n, progress
    # leftovers of the kind a kill leaves (temp file, renamed-but-uncommitted shard), plus another rank's, which stays
    last = open_store(p).manifest["shards"][-1]
    shutil.copy(p / last["file"], p / "shards" / "r000-999999.safetensors")
    (p / "shards" / ".r000-999998.safetensors.tmp").write_bytes(b"partial")
    (p / "shards" / ".r001-000000.safetensors.tmp").write_bytes(b"rank 1's")
    w = StoreWriter(p, header(), shard_tokens=60)
    left = sorted(x.name for x in (p / "shards").iterdir() if "999" in x.name or x.name.startswith("."))
    assert left == [".r001-000000.safetensors.tmp"]
    done = w.committed_ids()
    assert len(done) == progress[-1]
    for i in range(n):
        if sid(i) not in done:
            w.add(sid(i), *sample(i))
    w.close()
    s = open_store(p)
    assert s.verify() == [] and sorted(s.ids) == [sid(i) for i in range(n)] and len(s.ids) == n
    assert sorted(x.name for x in (p / "parts").iterdir()) == ["rank000.json"]  # no temp part files left either
    ref = open_store(write(tmp_path / "ref", n, shard_tokens=1 << 20).path)  # uninterrupted run
    for i in rnd.sample(range(n), 200) + [0, n - 1]:
        a, b = s[s.index_of(sid(i))], ref[ref.index_of(sid(i))]
        assert all(raw(a[k]) == raw(b[k]) for k in ("input_ids", "loss_mask", "aux", "final"))


def _rank_writer(path: str, rank: int, n: int, importing_done) -> None:
    importing_done.set()
    w = StoreWriter(path, header(), rank=rank, world_size=2, shard_tokens=80, wait_s=120)
    for i in range(rank, n, 2):
        w.add(sid(i), *sample(i))
    w.close()


@pytest.mark.procs
def test_two_processes_write_disjoint_ids_then_merge(tmp_path):
    p, n = tmp_path / "s", 80
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_rank_writer, args=(str(p), 1, n, ready))  # rank 1: a fresh interpreter
    child.start()
    assert ready.wait(120)
    time.sleep(0.3)  # rank 1 is now polling for a manifest that only rank 0 creates
    assert not p.exists()
    _rank_writer(str(p), 0, n, threading.Event())  # rank 0: this process
    child.join(120)
    assert child.exitcode == 0
    assert sorted(open_store(p).ids) == sorted(sid(i) for i in range(n))  # manifest ∪ parts, before the final merge
    r = merge_manifest(p)
    assert r["samples"] == n and r["problems"] == []
    m = json.loads((p / "manifest.json").read_text())
    assert {e["rank"] for e in m["shards"]} == {0, 1} and len(m["shards"]) == r["shards"]
    assert all(e["file"].startswith(f"shards/r{e['rank']:03d}-") for e in m["shards"])
    s = open_store(p)
    assert s.verify() == [] and len(s) == n
    for i in (0, 1, n - 1):
        assert raw(s[s.index_of(sid(i))]["aux"]) == raw(sample(i)[2].to(torch.bfloat16))


def test_ranks_with_barrier_and_new_replace_an_old_store(tmp_path):
    p, n = tmp_path / "s", 40
    write(p, 10)  # an old store that new=True must wipe before any rank resumes from it
    barrier, errors = threading.Barrier(2), []

    def run(rank):
        try:
            w = StoreWriter(p, header(), rank=rank, world_size=2, shard_tokens=50, new=True, barrier=barrier.wait)
            assert w.committed_ids() == set()
            barrier.wait()  # neither rank commits before both looked: committed_ids() reads every rank's commits
            for i in range(rank, n, 2):
                w.add(sid(i), *sample(i, seed=7))
            w.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    m = json.loads((p / "manifest.json").read_text())  # rank 0 merged after the barrier: complete without a re-merge
    assert sorted(i for e in m["shards"] for i in e["ids"]) == sorted(sid(i) for i in range(n))
    s = open_store(p)
    assert s.verify() == [] and torch.equal(s[s.index_of(sid(3))]["final"], sample(3, seed=7)[3].to(torch.bfloat16))


def test_enospc_on_a_small_tmpfs_keeps_committed_data(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as mnt:
        p, n = mnt / "s", 200  # ~2 MB of fp32 samples for 1 MiB
        w = StoreWriter(p, header("fp32"), shard_tokens=200)  # ~52 KB per shard
        msg = r"no space left on device while writing .*: committed data is intact \(\d+ samples\); free space"
        with pytest.raises(HstapError, match=msg):
            for i in range(n):
                w.add(sid(i), *sample(i, max_len=80))
        done = w.committed_samples
        assert 0 < done < n and not [x for x in (p / "shards").iterdir() if x.name.endswith(".tmp")]
        s = open_store(p)
        assert len(s) == done and s.verify() == []
        assert raw(s[done - 1]["aux"]) == raw(sample(done - 1, max_len=80)[2])
        del s
        grow_tmpfs(mnt, "16m")  # "free space and re-run"
        w = StoreWriter(p, header("fp32"), shard_tokens=200)
        skip = w.committed_ids()
        for i in range(n):
            if sid(i) not in skip:
                w.add(sid(i), *sample(i, max_len=80))
        w.close()
        s = open_store(p)
        assert s.ids == [sid(i) for i in range(n)] and s.verify() == []
        del s


def test_a_failing_hash_never_leaves_the_writer_running_on_a_closed_fd(tmp_path, monkeypatch):
    """If hashing fails mid-shard, the sequential writer thread is stopped and joined before the fd is closed:
    bytes of the shard must not land in a file opened right after (its fd number could be the reused one)."""
    import hstap.store.shard_file as W

    class Boom:
        def __init__(self):
            raise OSError(5, "simulated hash failure")

    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):  # the writer is still inside a write when the hashes fail
        time.sleep(0.3)
        return real_pwrite(fd, data, offset)

    w = StoreWriter(tmp_path / "s", header(), shard_tokens=1 << 30)
    for i in range(20):
        w.add(sid(i), *sample(i, max_len=40))
    monkeypatch.setattr(W.hashlib, "sha256", Boom)
    monkeypatch.setattr(W.os, "pwrite", slow_pwrite)
    with pytest.raises(HstapError):
        w.flush()
    monkeypatch.undo()
    victim = tmp_path / "victim.bin"
    fd = os.open(victim, os.O_WRONLY | os.O_CREAT)  # most likely the number the shard's fd had
    try:
        time.sleep(0.6)  # a writer still running would complete its pwrite on this fd now
    finally:
        os.close(fd)
    assert victim.stat().st_size == 0 and not list((tmp_path / "s" / "shards").glob(".*.tmp"))
