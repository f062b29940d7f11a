"""The GPU benchmarks' CPU smoke modes run end to end: bench_train.py --tiny (both shapes, profile; --store-checks) and
research/quality_variants.sh --tiny (toy target; prepare, capture bf16 + fp8, train, replay, hstap eval of a 2-layer drafter);
bench_ngram.py on a few streams (its index and its scan propose the same drafts); research/peer_speculators.py --tiny
(speculators' trainer on a tiny store, hstap's reading of its checkpoints equal to speculators' model); bench_wide.py
--tiny (a SmolLM2-like tiny target widened, every method lossless); bench_capture.py --tiny (every pass profiled, the
stores bitwise equal to the old gather path's); bench_decode.py --tiny --big-spec (every step split against the bound);
gpu_speed.sh's SMOKE form (the H200 protocol's two parts and its summary); bench_serve_shift.py --tiny (the serve loop
across a traffic shift, on the live vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.procs
@pytest.mark.slow
def test_quality_variants_tiny(tmp_path):
    env = {**os.environ, "W": str(tmp_path / "w"), "OUT": str(tmp_path / "out"), "VARIANTS": "base,n2",
           "MEASURE": "n2", "NP": "1", "EP": "1", "STEPS": "1", "PAR": "2", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(REPO / "benchmarks" / "research" / "quality_variants.sh"), "--tiny"], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=900)
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


@pytest.fixture(scope="module")
def peer_tiny(tmp_path_factory):
    """peer_speculators.py --tiny, one epoch: (its JSON line, its output dir with assets/{target,store})."""
    pytest.importorskip("speculators.train.trainer")
    out_dir = tmp_path_factory.mktemp("peer")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "research" / "peer_speculators.py"), "--tiny",
                        "--out", str(out_dir), "--epochs", "1", "--parity-samples", "2"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), out_dir


@pytest.mark.procs
@pytest.mark.slow
def test_peer_speculators_tiny(peer_tiny):
    """speculators' trainer on a tiny store built in-process, both configurations: validated with hstap's replay, each
    best checkpoint converted to an hstap drafter whose logits are speculators' (every TTT step)."""
    out, _ = peer_tiny
    assert out["bench"] == "peer_speculators" and set(out["configs"]) == {"default", "hstap"}
    for name, c in out["configs"].items():
        par = c["parity"]
        assert par["positions"] > 100 and par["argmax_equal"] == 1.0 and par["max_abs_logit_diff"] < 1e-3, (name, par)
        assert c["steps"] > 0 and c["tokens"] > 0 and c["tokens_per_s"] > 0 and len(c["val_chain_tau"]) == 3
        assert c["val_chain_tau"][0] >= 1.0 and c["epochs"][0]["val_rounds"] > 0
        meta = json.loads((Path(c["drafter"]) / "drafter.json").read_text())
        assert meta["peer"]["config"] == name and meta["config"]["aux_layers"] == [1, 3, 4]
    assert out["configs"]["default"]["ttt_steps"] == 3 and out["configs"]["hstap"]["ttt_steps"] == 5
    flags = json.loads((Path(out["configs"]["default"]["drafter"]) / "drafter.json").read_text())["config"]
    assert flags["norm_before_fc"] and flags["norm_before_residual"] and flags["norm_output"]  # speculators' layout
    assert out["chosen"] in out["configs"] and out["chosen_drafter"] == out["configs"][out["chosen"]]["drafter"]


@pytest.mark.procs
@pytest.mark.slow
def test_peer_replay_equals_hstap_train_replay(peer_tiny, tmp_path):
    """The selection figure is hstap's: a drafter trained by `hstap train` on the tiny store, exported for vLLM and run
    as speculators' Eagle3DraftModel through peer_speculators.replay_validation, gives the chain taus hstap train's
    own evaluation replayed on the same validation split (same split, counting and replay; both fp32)."""
    import torch

    _, out_dir = peer_tiny
    assets, run = out_dir / "assets", tmp_path / "run"
    common = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in (["train", "--store", str(assets / "store"), "--target", str(assets / "target"), "--out", str(run),
                  "--steps", "20", "--eval-frac", "0.25", "--batch-tokens", "1024"],
                 ["export", "--run", str(run), "--to", "vllm", "--out", str(tmp_path / "vl"), "--dtype", "fp32",
                  "--target", str(assets / "target")]):
        p = subprocess.run([sys.executable, "-m", "hstap.cli", *argv], env=common, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    ev = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval": true' in x][-1]
    sys.path.insert(0, str(REPO / "benchmarks" / "research"))
    try:
        import peer_speculators as P
    finally:
        sys.path.pop(0)
    from speculators.model import SpeculatorModel

    model = SpeculatorModel.registry["eagle3"].from_pretrained(str(tmp_path / "vl")).float().eval()
    model.verifier_norm = torch.nn.Identity()
    a = type("A", (), {"store": str(assets / "store"), "target": str(assets / "target"), "tiny": True,
                       "val_frac": 0.25, "val_samples": 0})()
    ctx = P.context(a)
    # an export holds no embedding; speculators 0.9 (transformers 5.17) fills it from the verifier only when the freshly
    # materialized parameter happens to hold a NaN (its from_pretrained checks isnan()): set it as vLLM shares it
    with torch.no_grad():
        model.embed_tokens.weight.copy_(ctx["embed"])
    dl = P.loader(P.StoreSamples(a.store, ctx["val"], 1024, torch.float32), 1024, 48, 3, 0, 0)
    mine = P.replay_validation(model, dl, ctx["head"], ctx["hot"], ctx["t2d_dev"], 5, torch.device("cpu"),
                               torch.float32)
    assert mine["val_chain_tau"] == pytest.approx(ev["sim_chain_tau"], abs=1e-9), (mine, ev)
    assert ev["sim_chain_tau"][0] > 1.0  # drafts were accepted: the comparison counts something


@pytest.mark.procs
@pytest.mark.slow
def test_bench_wide_tiny():
    """The widened target decodes what the reference decodes, and every drafting method is lossless on both."""
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_wide.py"), "--tiny"], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads([x for x in p.stdout.splitlines() if x.startswith('{"bench": "wide"')][-1])
    # the widened target's greedy outputs equal the reference's on every prompt
    assert out["target_only_outputs_equal"] == out["prompts"] > 0
    assert [t["name"] for t in out["targets"]] == ["reference", "wide"]
    for t in out["targets"]:
        drafted = {name: m for name, m in t["methods"].items() if name != "target"}
        assert "ngram" in drafted and len(drafted) >= 2
        assert all(m["lossless"] is True for m in drafted.values()), (t["name"], drafted.keys())


def test_bench_generate_tiny():
    """bench_generate.py --tiny: the continuous engine and the lockstep batches over the same multi-turn conversations
    give the same answers (fp32, CPU), and the continuous engine prefills fewer tokens (its rows kept across turns)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_generate
    finally:
        sys.path.pop(0)
    out = bench_generate.main(["--tiny"])
    assert out["equal_answers"] == 1.0
    c, lock = out["continuous"], out["lockstep"]
    assert c["generated"] == lock["generated"] > 0 and c["decode_steps"] > 0
    assert c["prefilled_tokens"] + c["reused_tokens"] >= lock["prefilled_tokens"] > c["prefilled_tokens"]


def test_bench_capture_tiny_profiles_every_pass(tmp_path):
    """bench_capture.py --tiny --cli --trace-batches 1: every pass (the plain prefill, bf16 and fp8 into a RAM-backed
    and a disk directory, `hstap capture` itself on the same samples) reports where its time went: the runner's stages on
    both threads, the store writer's split, the host syncs by site; each store at its formula's bytes per token."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_capture
    finally:
        sys.path.pop(0)
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    out = bench_capture.main(["--tiny", "--samples", "8", "--seq", "32", "--batch-tokens", "64", "--shm-dir", str(shm),
                              "--disk-dir", str(disk), "--disk-dtypes", "bf16,fp8", "--sink-gb", "0.01", "--cli",
                              "--trace-batches", "1", "--out-dir", str(tmp_path / "out"), "--repeat-prefill"])
    assert out["prefill"]["profile"]["host_s"]["forward"] > 0 and out["prefill_again"]["tok_per_s"] > 0
    assert all(v["equal"] and v["split_last_equal"] and v["shards"] >= 1 for v in out["bytes_check"].values())
    for key in ("capture_shm_bf16", "capture_shm_fp8", "capture_disk_bf16", "capture_disk_fp8", "cli"):
        c = out[key]
        assert c["tokens"] == 8 * 32 and c["vs_prefill"] > 0, key
        formula = bench_capture.store_bytes_per_token(3, 128, c["dtype"])  # + each shard's header and offsets
        assert formula <= c["bytes_per_token"] < 1.01 * formula, key
        p = c["profile"]
        assert p["batches"] == 4 and p["host_s"]["forward"] > 0 and p["host_s"]["store"] > 0, key
        assert p["store"]["samples"] == 8 and p["store"]["shards"] >= 1 and p["store"]["write_s"] > 0, key
        assert p["syncs"]["main_syncs"] >= 0 and "sites" in p["syncs"], key
        assert c["loss_vs_prefill"] is None  # the split against the prefill needs device events (CUDA)
    assert (tmp_path / "out" / "capture_trace.json").is_file() and out["trace"]["top_ops"]
    assert not list(shm.iterdir()) and not [f for f in disk.iterdir() if f.name.startswith("hstap-bench")]


def test_bench_decode_tiny_says_where_each_step_goes():
    """bench_decode.py --tiny --big-spec: every target-only step and every speculative round is split against the
    weight-bandwidth bound (bound + gemm + other kernels + gaps + host = the step's time), for the reference stand-in,
    the big-shape stand-in and its speculative loop; fp32 outputs equal the eager engine's and target-only decoding's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_decode
    finally:
        sys.path.pop(0)
    out = bench_decode.main(["--tiny", "--big-spec", "--spec-variants", "lean+cdt", "--variants", "base",
                             "--chains", "5", "--new-tokens", "12"])

    def adds_up(b):
        o = b["over_bound_ms"]
        assert abs(b["bound_ms"] + o["gemm"] + o["other"] + o["gaps"] + o["host"] - b["ms"]) < 1e-6 * max(1, b["ms"])
        assert b["bound_ms"] > 0 and b["kernels"] > 0 and b["kinds"]["gemm"]["kernels"] > 0 and b["read_gb"] > 0

    assert {t["target"] for t in out["targets"]} == {"tiny", "tiny-llama-shape"}
    for t in out["targets"]:
        adds_up(t["step"])
        assert t["step"]["ms"] == pytest.approx(t["ms_per_token"], rel=1e-6)
        if t["eager_tokens"]:
            assert t["eager_equal_tokens"] == t["eager_tokens"]  # fp32 on the CPU: the same greedy tokens
    for store in (out["speculative"], out["speculative_big"]):
        rows = next(iter(store.values()))
        assert "chain5" in rows and all(r["lossless"] for r in rows.values())
        rb = rows["chain5"]["round"]
        adds_up(rb["verify"])
        adds_up(rb["draft"])
        assert rb["bound_ms"] == pytest.approx(rb["verify"]["bound_ms"] + rb["draft"]["bound_ms"])
        assert rb["ms"] == pytest.approx(rows["chain5"]["draft_ms_per_round"] + rows["chain5"]["verify_ms_per_round"]
                                         + rows["chain5"]["host_ms_per_round"])


@pytest.mark.procs
@pytest.mark.slow
def test_gpu_speed_protocol_smoke(tmp_path):
    """benchmarks/gpu_speed.sh in its SMOKE form: its three parts run, every result file is there (each part writes
    at most 6: the device tool brings back 8 a command), and the summary has the capture passes, the bytes check and
    the decode rows."""
    out = tmp_path / "out"
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "W": str(tmp_path / "w"), "DISK": str(tmp_path / "disk"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_speed.sh"), "all"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    files = sorted(f.name for f in out.iterdir())
    assert files == ["capture.json", "capture.log", "capture_trace.json.gz", "capture_where.json", "capture_where.log",
                     "decode.json", "decode.log", "env.txt", "summary.txt"]
    summary = (out / "summary.txt").read_text()
    assert "capture_disk_bf16" in summary and "capture_disk_fp8" in summary and "cli" in summary, summary
    assert "capture_shm_bf16_no_mask_sync" in summary and "goal capture -> disk bf16" in summary, summary
    assert "bytes vs the old gather: bf16 equal, fp8 equal" in summary and "spec cdt/chain5" in summary, summary
    assert "capture_disk_bf16_tailsplit" in summary, summary
    assert json.loads((out / "decode.json").read_text())["checks"]["big_spec_no_violations"]


@pytest.mark.vllm
@pytest.mark.procs
@pytest.mark.slow
def test_bench_serve_shift_tiny(tmp_path):
    """benchmarks/bench_serve_shift.py --tiny on the live vLLM: the offline drafter, the four stream runs and the three
    forgetting runs end to end; every request answered once, outputs equal target-only, the figures in its JSON."""
    from helpers.vllm import require_vllm

    require_vllm()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_serve_shift.py"), "--tiny", "--work",
                        str(tmp_path / "w"), "--server-cpus", "", "--trainer-cpus", ""], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    line = json.loads(p.stdout.strip().splitlines()[-1])
    assert line["requests"] == 64 and line["shift_at"] == 16
    r = json.loads((tmp_path / "w" / "bench_serve_shift.json").read_text())
    assert set(r["curves"]) == {"fixed", "loop, window", "loop, anchor replay"}
    for name, run in r["runs"].items():
        assert run["answered"] == 64 and run["lost"] == 0 and run["duplicates"] == 0, name
        assert name == "target only" or run["lossless"]["lossless"], name
    assert all(a > 0 for a in r["forgetting"].values())  # every final drafter served the held-back first domain
    for i in (2, 3):  # the loops trained, and every load they made beat the served drafter on held-back samples
        assert (tmp_path / "w" / f"run{i}" / "run" / "follow.jsonl").read_text().strip()
        for u in map(json.loads, (tmp_path / "w" / f"run{i}" / "updates.jsonl").read_text().splitlines()):
            g = u.get("gate")
            assert g is None or (g["decision"] == "load") == (g["candidate_sim_tau"] > g["served_sim_tau"])
    follow = (tmp_path / "w" / "run3" / "run" / "follow.jsonl").read_text().splitlines()
    assert any(json.loads(x).get("anchor") for x in follow)  # the anchor run rehearsed the offline store
    assert (tmp_path / "w" / "shift.png").read_bytes()[:4] == b"\x89PNG"
