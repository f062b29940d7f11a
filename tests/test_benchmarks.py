"""The GPU benchmarks' CPU smoke modes run end to end: bench_train.py --tiny (both shapes, profile; --store-checks) and
quality_variants.sh --tiny (toy target; prepare, capture bf16 + fp8, train, replay, hstap eval of a 2-layer drafter);
bench_ngram.py on a few streams (its index and its scan propose the same drafts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_ngram_small():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_ngram
    finally:
        sys.path.pop(0)
    out = bench_ngram.main(["--streams", "3", "--repeat", "1", "--prompt", "40", "--new", "30", "--vocab", "6"])
    assert out["same_drafts"] and out["rounds"] >= 30 and out["scan_us_per_round"] > 0 < out["index_us_per_round"]


def test_bench_train_tiny_both_shapes():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_train
    finally:
        sys.path.pop(0)
    out = bench_train.main(["--tiny", "--steps", "1", "--warmup", "1", "--ref-configs", "eager,eager-chunk16k",
                            "--profile"])
    assert set(out["shapes"]) == {"8b", "ref"} and set(out["shapes"]["ref"]["runs"]) == {"eager", "eager-chunk16k"}
    for shape in out["shapes"].values():
        for r in shape["runs"].values():
            assert r["tok_s"] > 0 and 0 < r["mfu"] < 1 and r["host_syncs_per_step"] is None  # counted on CUDA only
            assert r["profile_top5"]["cpu"] and r["tokens_per_step"] > 0


def test_quality_variants_tiny(tmp_path):
    env = {**os.environ, "W": str(tmp_path / "w"), "OUT": str(tmp_path / "out"), "VARIANTS": "base,n2",
           "MEASURE": "n2", "NP": "1", "EP": "1", "STEPS": "1", "PAR": "2", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(REPO / "benchmarks" / "quality_variants.sh"), "--tiny"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "quality_variants" and set(summary["variants"]) == {"base", "n2"}
    n2 = summary["variants"]["n2"]
    assert n2["rc"] == 0 and n2["steps"] == 1 and n2["val_chain5"] >= 1.0 and n2["eval_chain5"] >= 1.0
    assert n2["lossless"] is True and n2["measured_prompts"] == 1 and n2["measured_tau"] >= 1.0
    assert summary["variants"]["base"]["eval_ratio"] == 1.0
    assert (tmp_path / "out" / "variants.json").is_file()


def test_bench_train_store_checks_tiny(tmp_path, monkeypatch):
    """bench_train.py --store-checks --tiny: a real store written, then train's data path over it with the checksum
    check off and on; the on pass hashes the whole store once (and the check is back on afterwards)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_train
    finally:
        sys.path.pop(0)
    from hstap.store import reader

    out = bench_train.main(["--tiny", "--store-checks", "--store-passes", "1", "--steps", "2", "--store-dir",
                            str(tmp_path)])
    r = out["store_checks"]
    off, on = r["passes"]
    assert (off["checks"], on["checks"], off["hashed_gb"]) == ("off", "on", 0.0) and reader.CHECK_CHECKSUMS
    shards = sum(f.stat().st_size for f in (tmp_path / "store" / "shards").iterdir()) / 1e9
    assert on["hashed_gb"] == shards and r["store_gb"] <= shards < 1.01 * r["store_gb"]
    assert on["steps"] == off["steps"] == 2 and on["tokens"] == off["tokens"] > 0 and r["hash_gb_s"] > 0
