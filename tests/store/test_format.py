"""hstap.store.format and hstap.store.reader: the on-disk format bit for bit, fp8 quantization, manifest and part
files, merge_manifest, verify, token counts."""

from __future__ import annotations

import json
import re
import shutil
import struct

import numpy as np
import pytest
import torch
from helpers.store import H, K, header, raw, sample, sid, write
from safetensors import safe_open
from safetensors.torch import load_file

from hstap.common import HstapError, atomic_write_json
from hstap.store.format import store_bytes_per_token
from hstap.store.fp8 import dequantize_fp8, quantize_fp8
from hstap.store.manifest import merge_manifest
from hstap.store.reader import open_store
from hstap.store.writer import StoreWriter


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


def test_token_counts_count_loss_masked_tokens_and_refuse_ids_past_the_vocab(tmp_path):
    n = 30
    write(tmp_path / "s", n, "fp8", shard_tokens=80)
    s = open_store(tmp_path / "s")
    assert len(s.manifest["shards"]) > 2
    want = torch.zeros(50_000, dtype=torch.long)
    for i in range(n):
        ids, mask, _, _ = sample(i)
        want += torch.bincount(ids[mask.bool()], minlength=50_000)
    got = s.token_counts(50_000)
    assert got.dtype == np.int64 and got.shape == (50_000,) and got.tolist() == want.tolist()
    assert got.sum() == sum(int(sample(i)[1].sum()) for i in range(n))
    top = max(int(sample(i)[0].max()) for i in range(n) if sid(i) in s.manifest["shards"][0]["ids"])
    first = tmp_path / "s" / s.manifest["shards"][0]["file"]
    msg = f"{first}: token id {top} >= the target's vocab size {top}"
    with pytest.raises(HstapError, match="^" + re.escape(msg) + "$"):
        s.token_counts(top)


def test_check_names_the_first_damaged_shard_and_ranks_split_the_hashing(tmp_path, monkeypatch):
    """Store.check (what train and capture's resume run first): every shard at its recorded size on every rank, each
    hashed by exactly one rank of W; a truncated, missing or bit-flipped shard is one line naming the file, a shard a
    trainer consumed meanwhile is not; CHECK_CHECKSUMS off (the benchmark's comparison pass) skips the hashing only."""
    from hstap.store import reader
    from hstap.store.consumer import write_consumer

    p = tmp_path / "s"
    write(p, 40, "fp32", shard_tokens=120)
    s = open_store(p)
    entries = s.manifest["shards"]
    assert len(entries) >= 4
    hashed = []
    real = reader.file_checksum
    monkeypatch.setattr(reader, "file_checksum", lambda f: hashed.append(f.name) or real(f))
    for r in range(3):
        st = s.check(r, 3)
        assert st["checksums"] and st["shards"] == len(entries)
        assert st["gb"] == sum(e["bytes"] for e in entries[r::3]) / 1e9
    assert sorted(hashed) == sorted(e["file"].split("/")[-1] for e in entries)  # each shard hashed once in all
    f = p / entries[2]["file"]
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    f.write_bytes(bytes(blob))
    with pytest.raises(HstapError, match=f"^{re.escape(str(f))}: sha256 differs from the one recorded"):
        s.check()
    assert s.check(1, 2)["checksums"]  # rank 1 of 2 does not hash shard 2: sizes alone are fine
    monkeypatch.setattr(reader, "CHECK_CHECKSUMS", False)
    hashed.clear()
    st = s.check()
    assert (st["shards"], st["gb"], st["checksums"], hashed) == (len(entries), 0.0, False, [])
    monkeypatch.setattr(reader, "CHECK_CHECKSUMS", True)
    f.write_bytes(bytes(blob[:-100]))
    with pytest.raises(HstapError, match=f"^{re.escape(str(f))}: {len(blob) - 100} bytes, its manifest entry "
                                         f"records {len(blob)} \\(truncated or replaced\\)"):
        s.check(1, 2)  # sizes are every rank's
    with pytest.raises(HstapError, match="bytes, its manifest entry records"):
        s[s.ids.index(entries[2]["ids"][0])]  # the reader's first open of it: one line, not safetensors' error
    (p / entries[0]["file"]).unlink()  # a following trainer consumed shard 0 after this Store was opened
    write_consumer(p, {"run": "r", "active": True, "keep_shards": 2, "store_created_unix": s.manifest["created_unix"],
                       "consumed": {"0": 1}})
    with pytest.raises(HstapError, match=re.escape(str(f))):  # shard 0 is passed over; shard 2 is still damaged
        s.check()


def test_a_creation_killed_before_its_manifest_rename_is_not_a_foreign_directory(tmp_path):
    """A writer killed between writing the manifest's temporary file and renaming it leaves `.manifest.json.X.tmp`
    beside empty shards/ and parts/: the next run creates the store there; a file of the user's is still refused."""
    import pytest

    from hstap.common import HstapError
    from hstap.store.manifest import check_store_dir

    d = tmp_path / "store"
    (d / "shards").mkdir(parents=True)
    (d / "parts").mkdir()
    (d / ".manifest.json.olbim8ns.tmp").write_text("{")
    assert check_store_dir(d) is False  # nothing to resume: created anew
    (d / "notes.txt").write_text("mine")
    with pytest.raises(HstapError, match="holds 'notes.txt' and no manifest.json"):
        check_store_dir(d)
    (d / "notes.txt").unlink()
    (d / ".notes.txt.abc.tmp").write_text("x")  # a temporary file of another name is not the store's
    with pytest.raises(HstapError, match="no manifest.json"):
        check_store_dir(d)
