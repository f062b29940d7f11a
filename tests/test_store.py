"""hstap.store: format, commit protocol, resume after SIGKILL, verify, multi-rank writes, ENOSPC, sampler, collate."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import struct
import subprocess
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hstap.common import HstapError, atomic_write_json
from hstap.store import (BucketBatchSampler, StoreWriter, collate, dequantize_fp8, merge_manifest, open_store,
                         quantize_fp8, store_bytes_per_token)

K, H = 3, 16


def header(dtype: str = "bf16", **over) -> dict:
    h = {"target": {"path": "/models/t", "model_type": "llama", "num_layers": 8, "hidden_size": H,
                    "config_sha256": "c" * 64, "weights_fingerprint": "w" * 64, "tokenizer_sha256": "t" * 64,
                    "chat_template_sha256": "h" * 64},
         "engine": {"name": "hf", "version": "5.17", "device": "cpu", "compute_dtype": "fp32"},
         "dtype": dtype, "layers": [1, 3, 4], "hidden_size": H, "capture_config": {"batch_tokens": 64},
         "git_commit": None}
    for k, v in over.items():
        if k in h["target"]:
            h["target"][k] = v
        if k not in h["target"] or k == "hidden_size":
            h[k] = v
    return h


def sample(i: int, seed: int = 0, max_len: int = 40) -> tuple:
    """Deterministic sample i: (input_ids, loss_mask, aux (T,K,H) fp32, final (T,H) fp32); rows of varied scale."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    T = int(torch.randint(1, max_len, (1,), generator=g))
    ids = torch.randint(0, 50_000, (T,), generator=g)
    mask = torch.randint(0, 2, (T,), generator=g)
    mag = torch.exp(torch.randn(T, K, 1, generator=g) * 3)  # per-row scales from ~1e-4 to ~1e4
    aux = torch.randn(T, K, H, generator=g) * mag
    final = torch.randn(T, H, generator=g)
    return ids, mask, aux, final


def sid(i: int) -> str:
    return f"conv-{i:05d}"


def write(path, n: int, dtype: str = "bf16", shard_tokens: int = 100, ids=None, **kw) -> StoreWriter:
    w = StoreWriter(path, header(dtype), shard_tokens=shard_tokens, **kw)
    for i in (range(n) if ids is None else ids):
        w.add(sid(i), *sample(i))
    w.close()
    return w


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp8"])
def test_roundtrip_bitwise_bytes_and_valid_safetensors(tmp_path, dtype):
    n = 60
    w = write(tmp_path / "s", n, dtype)
    s = open_store(tmp_path / "s")
    assert s.ids == [sid(i) for i in range(n)]  # add order preserved across shards
    assert len(s) == n and s.index_of(sid(17)) == 17 and s.verify() == []
    assert len(s.manifest["shards"]) > 3 and w.summary["samples"] == n
    for i in range(n):
        ids, mask, aux, final = sample(i)
        got = s[i]
        assert got["id"] == sid(i) and got["input_ids"].dtype == torch.long and got["loss_mask"].dtype == torch.long
        assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"], mask)
        if dtype == "fp8":
            qa, sa = quantize_fp8(aux)
            qf, sf = quantize_fp8(final)
            assert got["aux"].dtype == torch.float32
            assert raw(got["aux"]) == raw(dequantize_fp8(qa, sa)) and raw(got["final"]) == raw(dequantize_fp8(qf, sf))
        else:
            dt = torch.bfloat16 if dtype == "bf16" else torch.float32
            assert got["aux"].dtype == dt and got["aux"].shape == (len(ids), K, H)
            assert raw(got["aux"]) == raw(aux.to(dt)) and raw(got["final"]) == raw(final.to(dt))
    bpt = store_bytes_per_token(K, H, dtype)
    assert bpt == {"bf16": (K + 1) * H * 2 + 5, "fp32": (K + 1) * H * 4 + 5, "fp8": (K + 1) * (H + 4) + 5}[dtype]
    start = 0
    for e in s.manifest["shards"]:
        f = tmp_path / "s" / e["file"]
        blob = f.read_bytes()
        hlen = struct.unpack("<Q", blob[:8])[0]
        assert hlen % 8 == 0 and blob[8 + hlen - 1:8 + hlen] in (b"}", b" ")
        # data bytes are exactly tokens * bytes_per_token + the offsets: no padding anywhere
        assert len(blob) == e["bytes"] == 8 + hlen + e["tokens"] * bpt + 8 * (len(e["ids"]) + 1)
        t = load_file(str(f))  # the real safetensors library parses it
        with safe_open(str(f), framework="pt") as h:
            assert json.loads(h.metadata()["ids"]) == e["ids"] == s.ids[start:start + len(e["ids"])]
        assert t["offsets"].tolist()[-1] == e["tokens"] == sum(e["lengths"]) and t["input_ids"].dtype == torch.int32
        if dtype == "fp8":
            assert t["aux"].dtype == torch.float8_e4m3fn and t["aux_scale"].shape == (e["tokens"], K)
            ids0, _, aux0, _ = sample(start)  # stored q and scale are the quantizer's, bit for bit
            q0, s0 = quantize_fp8(aux0)
            assert raw(t["aux"][: len(ids0)]) == raw(q0) and raw(t["aux_scale"][: len(ids0)]) == raw(s0)
        start += len(e["ids"])


def test_fp8_quantization_error_bound_and_prequantized_add(tmp_path):
    x = torch.randn(64, 5, 256) * torch.exp(torch.randn(64, 5, 1) * 4)  # (T, K, H)
    x[3, 2] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 5) and torch.isfinite(scale).all()
    assert scale[3, 2] == 1.0 and (dequantize_fp8(q, scale)[3, 2] == 0).all()
    err = (dequantize_fp8(q, scale) - x).abs()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormals (|q| < 2^-6) have spacing 2^-9
    bound = torch.maximum(x.abs() * 2.0**-4, scale.unsqueeze(-1) * 2.0**-10) * (1 + 1e-6)
    assert (err <= bound).all()
    assert (q.float().abs().amax(-1)[scale != 1.0] == 448).all()  # the range is fully used
    assert torch.isinf(quantize_fp8(torch.full((2, 4), 1e-44))[1]).logical_not().all()  # denormal amax: finite scale
    # add() with scales given stores the caller's fp8 bytes unchanged
    w = StoreWriter(tmp_path / "s", header("fp8"), shard_tokens=1000)
    ids, mask, aux, final = sample(0)
    qa, sa = quantize_fp8(aux * 2)
    qf, sf = quantize_fp8(final)
    w.add("x", ids, mask, qa, qf, aux_scale=sa, final_scale=sf)
    with pytest.raises(HstapError, match="aux_scale"):
        w.add("y", ids, mask, qa, qf)
    w.close()
    got = open_store(tmp_path / "s")[0]
    assert torch.equal(got["aux"], dequantize_fp8(qa, sa)) and torch.equal(got["final"], dequantize_fp8(qf, sf))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_quantization_on_cuda_matches_cpu():
    x = torch.randn(128, 3, 512) * torch.exp(torch.randn(128, 3, 1) * 4)  # (T, K, H)
    q, scale = quantize_fp8(x.to("cuda", torch.bfloat16))
    q0, s0 = quantize_fp8(x.to(torch.bfloat16))
    assert q.is_cuda and raw(scale.cpu()) == raw(s0) and raw(q.cpu()) == raw(q0)


def test_manifest_part_files_merge_and_duplicate_defense(tmp_path):
    p = tmp_path / "s"
    w = StoreWriter(p, header(), shard_tokens=100)
    m = json.loads((p / "manifest.json").read_text())
    assert m["format"] == "hstap-store" and m["version"] == 1 and m["shards"] == []
    assert m["target"]["weights_fingerprint"] == "w" * 64 and m["layers"] == [1, 3, 4] and m["engine"]["name"] == "hf"
    for i in range(30):
        w.add(sid(i), *sample(i))
    w.flush()
    part = json.loads((p / "parts" / "rank000.json").read_text())
    committed = [i for e in part["shards"] for i in e["ids"]]
    assert committed == [sid(i) for i in range(30)] and part["closed"] is False
    assert [e["file"] for e in part["shards"]] == [f"shards/r000-{k:06d}.safetensors"
                                                   for k in range(len(part["shards"]))]
    assert json.loads((p / "manifest.json").read_text())["shards"] == []  # not merged yet ...
    assert open_store(p).ids == committed  # ... but the reader sees committed shards through the part file
    with pytest.raises(HstapError, match="already committed"):
        w.add(sid(3), *sample(3))
    with pytest.raises(HstapError, match="shape"):
        w.add("bad", sample(0)[0], sample(0)[1], torch.zeros(len(sample(0)[0]), K, H + 1), sample(0)[3])
    with pytest.raises(HstapError, match="loss_mask"):
        ids, mask, aux, final = sample(1)
        w.add("bad", ids, mask + 1, aux, final)
    w.close()
    m = json.loads((p / "manifest.json").read_text())
    assert [i for e in m["shards"] for i in e["ids"]] == committed
    assert json.loads((p / "parts" / "rank000.json").read_text())["closed"] is True
    before = (p / "manifest.json").read_bytes()
    r = merge_manifest(p)
    assert (p / "manifest.json").read_bytes() == before and r["problems"] == [] and r["samples"] == 30  # idempotent
    # A second entry claiming committed ids (never produced by the protocol) is dropped and reported, not duplicated.
    e0 = m["shards"][0]
    shutil.copy(p / e0["file"], p / "shards" / "r001-000000.safetensors")
    dup = e0 | {"file": "shards/r001-000000.safetensors", "rank": 1, "seq": 0}
    atomic_write_json(p / "parts" / "rank001.json",
                      {"format": "hstap-store-part", "version": 1, "rank": 1, "closed": True, "shards": [dup]})
    r = merge_manifest(p)
    assert len(r["problems"]) == 1 and "already committed" in r["problems"][0] and r["samples"] == 30
    s = open_store(p)
    assert s.ids == committed and any("already committed" in x for x in s.verify())


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
    import hstap.writer as writer_mod

    calls = []
    monkeypatch.setattr(writer_mod, "_sfr", lambda fd, off, n, flags: calls.append((off, n, flags)) or 0)
    monkeypatch.setattr(writer_mod, "WRITEBACK_BYTES", 4096)
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
    monkeypatch.setattr(writer_mod, "START_WRITEBACK", False)
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


def test_verify_catches_flipped_byte_missing_file_nan_and_metadata(tmp_path):
    p = tmp_path / "s"
    write(p, 40, "fp32")
    s = open_store(p)
    assert s.verify() == []
    files = [e["file"] for e in s.manifest["shards"]]
    f = p / files[1]
    blob = bytearray(f.read_bytes())
    blob[len(blob) - 30] ^= 0x01  # one bit, inside the data
    f.write_bytes(bytes(blob))
    problems = open_store(p).verify()
    assert len(problems) == 1 and files[1] in problems[0] and "sha256" in problems[0]
    (p / files[2]).unlink()
    problems = open_store(p).verify()
    assert any(files[2] in x and "missing" in x for x in problems) and len(problems) == 2
    # values that are not finite are reported (the checksum is fine: they were written that way)
    q = tmp_path / "nan"
    w = StoreWriter(q, header("fp32"))
    ids, mask, aux, final = sample(1)
    final[len(ids) - 1, 5] = float("nan")
    w.add("a", *sample(0))
    w.add("b", ids, mask, aux, final)
    w.close()
    problems = open_store(q).verify()
    assert len(problems) == 1 and "final: non-finite" in problems[0]
    # manifest <-> file consistency: an entry whose ids disagree with the file's __metadata__
    part = json.loads((q / "parts" / "rank000.json").read_text())
    part["shards"][0]["ids"] = ["b", "a"]
    atomic_write_json(q / "parts" / "rank000.json", part)
    (q / "manifest.json").write_text(json.dumps(json.loads((q / "manifest.json").read_text()) | {"shards": []}))
    assert any("__metadata__" in x for x in open_store(q).verify())


def _killable_writer(path: str, n: int, ready) -> None:
    torch.set_num_threads(1)
    w = StoreWriter(path, header(), shard_tokens=60)
    done = w.committed_ids()
    ready.set()
    for i in range(n):
        if sid(i) not in done:
            w.add(sid(i), *sample(i))
    w.close()


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
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to provoke ENOSPC (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
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
        subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)  # "free space and re-run"
        w = StoreWriter(p, header("fp32"), shard_tokens=200)
        skip = w.committed_ids()
        for i in range(n):
            if sid(i) not in skip:
                w.add(sid(i), *sample(i, max_len=80))
        w.close()
        s = open_store(p)
        assert s.ids == [sid(i) for i in range(n)] and s.verify() == []
        del s
    finally:
        import gc

        gc.collect()  # drop mmap handles so the mount is not busy
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_sampler_invariants_determinism_and_resume():
    rnd = random.Random(0)
    lengths = [rnd.randint(1, 120) for _ in range(400)] + [300, 1000]  # two longer than the budget
    budget = 256
    s = BucketBatchSampler(lengths, budget, seed=3)
    batches = list(s)
    assert len(batches) == len(s)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every index exactly once
    assert all(len(b) * max(lengths[i] for i in b) <= budget or len(b) == 1 for b in batches)
    assert sorted(b for b in batches if any(lengths[i] > budget for i in b)) == [[400], [401]]  # too long: alone
    assert batches == list(BucketBatchSampler(lengths, budget, seed=3))  # deterministic
    s.set_epoch(1)
    e1 = list(s)
    assert e1 != batches and len(e1) == len(batches) and sorted(i for b in e1 for i in b) == list(range(len(lengths)))
    s.set_epoch(0)
    assert list(s) == batches
    # mid-epoch resume: state after 7 batches -> a fresh sampler continues with batch 8
    s.set_epoch(1)
    it = iter(s)
    first = [next(it) for _ in range(7)]
    st = s.state_dict()
    s2 = BucketBatchSampler(lengths, budget, seed=3)
    s2.load_state_dict(st)
    assert first + list(s2) == e1 and list(s2) == e1  # skip applies to one pass only
    s3 = BucketBatchSampler(lengths, budget, seed=3)
    s3.set_epoch(1)
    s3.skip(len(e1) - 2)
    assert list(s3) == e1[-2:]
    # ranks: equal length, together they cover everything (padding repeats at most world_size - 1 batches)
    per = [list(BucketBatchSampler(lengths, budget, seed=3, rank=r, world_size=3)) for r in range(3)]
    assert len({len(x) for x in per}) == 1 and len(per[0]) == len(BucketBatchSampler(lengths, budget, world_size=3))
    flat = [i for x in per for b in x for i in b]
    assert set(flat) == set(range(len(lengths))) and 3 * len(per[0]) - len(batches) < 3
    dl = [list(BucketBatchSampler(lengths, budget, seed=3, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert all(len(x) == len(batches) // 3 for x in dl)
    assert len({tuple(map(tuple, x)) for x in per}) == 3  # ranks get different batches
    ordered = list(BucketBatchSampler(lengths, budget, shuffle=False))
    assert [lengths[b[0]] for b in ordered] == sorted(lengths[b[0]] for b in ordered)


def test_collate_and_dataloader_with_forked_worker(tmp_path):
    write(tmp_path / "s", 30, "bf16")
    s = open_store(tmp_path / "s")
    sampler = BucketBatchSampler(s.lengths, 120, seed=1)
    assert s[0]["id"] == sid(0) and s._handles  # handles opened in the parent before the fork ...

    def collate_in_worker(samples):  # ... are replaced by the worker's own (runs in the worker process)
        return collate(samples) | {"pid": (os.getpid(), s._pid)}

    dl = torch.utils.data.DataLoader(s, batch_sampler=sampler, collate_fn=collate_in_worker, num_workers=1,
                                     multiprocessing_context="fork")
    seen = []
    for batch, idx in zip(dl, list(sampler)):
        assert batch["pid"][0] == batch["pid"][1] != os.getpid()
        B, T = batch["input_ids"].shape
        assert batch["aux"].shape == (B, T, K, H) and batch["final"].shape == (B, T, H)
        assert batch["aux"].dtype == torch.bfloat16
        assert batch["ids"] == [s.ids[i] for i in idx] and batch["lengths"].tolist() == [s.lengths[i] for i in idx]
        for b, i in enumerate(idx):
            n, x = s.lengths[i], s[i]
            assert torch.equal(batch["aux"][b, :n], x["aux"]) and torch.equal(batch["input_ids"][b, :n], x["input_ids"])
            assert (batch["aux"][b, n:] == 0).all() and (batch["loss_mask"][b, n:] == 0).all()
        seen += batch["ids"]
    assert sorted(seen) == sorted(s.ids)


def test_a_failing_hash_never_leaves_the_writer_running_on_a_closed_fd(tmp_path, monkeypatch):
    """If hashing fails mid-shard, the sequential writer thread is stopped and joined before the fd is closed:
    bytes of the shard must not land in a file opened right after (its fd number could be the reused one)."""
    import hstap.writer as W

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
