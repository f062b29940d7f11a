"""Side branches (format version 2, hstap.store.side): written and read back bitwise in every dtype, next to samples
without any; a kill -9 and a resume keep them exact; a version-1 store reads as before; bad side rows are refused."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch
from helpers.store import H, K, header, raw, sample, sid, write

from hstap.common import HstapError
from hstap.store.manifest import load_manifest
from hstap.store.reader import open_store
from hstap.store.writer import StoreWriter

SIDE_HEADER = {"producer": "test", "rows": "all", "max_accepted": -1}


def side(i: int, T: int) -> dict | None:
    """Deterministic side branches of sample i (T tokens): chains of 1-3 rows, some samples without any."""
    g = torch.Generator().manual_seed(7_000_003 + i)
    if T < 3 or i % 4 == 3:
        return None
    cols = {k: [] for k in ("input_ids", "pos", "parent", "step", "accepted")}
    S = 0
    for step in range(int(torch.randint(1, 4, (1,), generator=g))):
        s0 = int(torch.randint(1, T, (1,), generator=g))
        m = min(int(torch.randint(1, 4, (1,), generator=g)), T - s0)
        for j in range(m):
            cols["input_ids"].append(int(torch.randint(0, 50_000, (1,), generator=g)))
            cols["pos"].append(s0 + j)
            cols["parent"].append(s0 - 1 if j == 0 else -1 - (S + j - 1))
            cols["step"].append(step)
            cols["accepted"].append(int(torch.randint(0, 3, (1,), generator=g)))
        S += m
    out = {k: torch.tensor(v, dtype=torch.long) for k, v in cols.items()}
    mag = torch.exp(torch.randn(S, K, 1, generator=g) * 3)
    return out | {"aux": torch.randn(S, K, H, generator=g) * mag, "final": torch.randn(S, H, generator=g)}


def _write(path, n, dtype="bf16", ids=None, shard_tokens=100):
    w = StoreWriter(path, header(dtype, side_branches=SIDE_HEADER), shard_tokens=shard_tokens)
    for i in range(n) if ids is None else ids:
        s = sample(i)
        w.add(sid(i), *s, side=side(i, len(s[0])))
    w.close()
    return w


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_side_branches_round_trip_bitwise(tmp_path, dtype):
    from hstap.store.format import TORCH_DTYPES
    from hstap.store.fp8 import dequantize_fp8, quantize_fp8
    _write(tmp_path / "s", 30, dtype)
    s = open_store(tmp_path / "s")
    assert s.verify() == [] and s.side and load_manifest(tmp_path / "s")["version"] == 2
    rows = 0
    for i in range(30):
        got, want = s[s.index_of(sid(i))], side(i, len(sample(i)[0]))
        g = got["side"]
        if want is None:
            assert all(v.shape[0] == 0 for v in g.values())
            continue
        rows += want["input_ids"].numel()
        for k in ("input_ids", "pos", "parent", "step", "accepted"):
            assert torch.equal(g[k], want[k]), k
        for k in ("aux", "final"):
            if dtype == "fp8":
                q, sc = quantize_fp8(want[k])
                ref = dequantize_fp8(q, sc)
            else:
                ref = want[k].to(TORCH_DTYPES[dtype])
            assert raw(g[k]) == raw(ref), k
    assert rows > 20


def test_side_rows_refused_where_they_do_not_belong(tmp_path):
    w = StoreWriter(tmp_path / "plain", header())
    ids, mask, aux, final = sample(0)
    with pytest.raises(HstapError, match="side branches given to a store without them"):
        w.add(sid(0), ids, mask, aux, final, side=side(0, len(ids)))
    w.close()
    with pytest.raises(HstapError, match="side_branches: the store has no side branches"):
        StoreWriter(tmp_path / "plain", header(side_branches=SIDE_HEADER))
    w = StoreWriter(tmp_path / "s", header(side_branches=SIDE_HEADER))
    T = len(ids)
    bad = side(0, T)
    bad["parent"] = bad["parent"].clone()
    bad["parent"][0] = T + 5  # not the position before the row
    with pytest.raises(HstapError, match=r"sample 'conv-00000': side row 0: .*parent"):
        w.add(sid(0), ids, mask, aux, final, side=bad)
    short = {k: v[:1] for k, v in side(0, T).items()}
    short["final"] = short["final"][:, :3]
    with pytest.raises(HstapError, match=r"side\.final: expected shape"):
        w.add(sid(0), ids, mask, aux, final, side=short)
    w.close()


def test_version_1_store_reads_unchanged(tmp_path):
    """A store without side branches is written as version 1, byte for byte as before, and read without "side"."""
    write(tmp_path / "v1", 20)
    m = load_manifest(tmp_path / "v1")
    assert m["version"] == 1 and "side_rows" not in m["shards"][0]
    s = open_store(tmp_path / "v1")
    assert not s.side and "side" not in s[0] and s.verify() == []
    from safetensors import safe_open
    with safe_open(str(tmp_path / "v1" / m["shards"][0]["file"]), "pt") as f:
        assert list(f.keys()) == sorted(["offsets", "input_ids", "aux", "final", "loss_mask"])
        assert f.metadata()["version"] == "1"


def _killed_at(path: str, n: int, stop: int, in_write: bool) -> None:
    """Resume the store, add samples until `stop` are committed and a few more are queued, then kill -9 this process:
    between commits, or (in_write) halfway through writing the next shard's temp file."""
    import hstap.store.writer as writer_mod

    if in_write:
        real = writer_mod.write_shard

        def dying(tmp, *args, **kw):
            real(tmp, *args, **kw)
            with open(tmp, "r+b") as f:  # a temp file cut short, as a kill during the write leaves it
                f.truncate(os.path.getsize(tmp) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        writer_mod.write_shard = dying
    w = StoreWriter(path, header("bf16", side_branches=SIDE_HEADER), shard_tokens=60)
    done = w.committed_ids()
    for i in range(n):
        if sid(i) in done:
            continue
        s = sample(i)
        w.add(sid(i), *s, side=side(i, len(s[0])))
        if w.committed_samples >= stop:
            break
    os.kill(os.getpid(), signal.SIGKILL)


def test_side_branches_exact_after_kill_and_resume(tmp_path):
    n, p = 150, tmp_path / "s"
    ctx = mp.get_context("fork")
    progress = [0]
    for stop, in_write in ((20, False), (50, True), (90, False), (120, True)):
        proc = ctx.Process(target=_killed_at, args=(str(p), n, stop, in_write))
        proc.start()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        assert any(f.name.endswith(".tmp") for f in (p / "shards").iterdir()) == in_write  # killed mid-write
        st = open_store(p)
        assert st.verify() == [] and len(st) >= progress[-1]  # committed shards intact, nothing lost
        progress.append(len(st))
    assert 0 < progress[1] < progress[-1] < n, progress
    w = StoreWriter(p, header("bf16", side_branches=SIDE_HEADER), shard_tokens=60)
    done = w.committed_ids()
    for i in range(n):
        if sid(i) not in done:
            s = sample(i)
            w.add(sid(i), *s, side=side(i, len(s[0])))
    w.close()
    s, ref = open_store(p), open_store(_write(tmp_path / "ref", n, shard_tokens=1 << 20).path)
    assert s.verify() == [] and sorted(s.ids) == sorted(ref.ids)
    for i in range(n):
        a, b = s[s.index_of(sid(i))], ref[ref.index_of(sid(i))]
        assert all(raw(a[k]) == raw(b[k]) for k in ("input_ids", "aux", "final"))
        assert all(raw(a["side"][k]) == raw(b["side"][k]) for k in b["side"])
