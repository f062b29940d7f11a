"""`hstap capture` as real processes: SIGKILL at random moments then resume, bad input, a disk that refuses writes,
two torchrun-style ranks on gloo. Child processes come from a forkserver that imported torch once (see
tests/helpers/capture.py); one run uses a fresh interpreter."""

from __future__ import annotations

import contextlib
import io
import json
import random
import subprocess
import sys
import time

import pytest
from helpers.capture import Run, assert_same_store, make_prepared, run_cli, store_samples
from helpers.procs import start_forkserver

from hstap.capture.config import CaptureConfig
from hstap.capture.stage import capture
from hstap.common import free_port
from hstap.store.reader import open_store

pytestmark = pytest.mark.procs

N = 40  # samples
LAYERS = "1,3,4"


@pytest.fixture(scope="module", autouse=True)
def _forkserver_early():
    start_forkserver()  # its imports overlap the fixtures below


@pytest.fixture(scope="module")
def data(tiny_tokenizer, tmp_path_factory):
    return make_prepared(tiny_tokenizer[1], tmp_path_factory.mktemp("cap-procs") / "prepared", n=N, seed=2)


@pytest.fixture(scope="module")
def reference(tiny_llama, data, tmp_path_factory):
    """The store of one uninterrupted in-process capture."""
    out = tmp_path_factory.mktemp("cap-ref") / "store"
    with contextlib.redirect_stdout(io.StringIO()):
        capture(CaptureConfig(target=str(tiny_llama), data=str(data), out=str(out), layers=LAYERS, dtype="fp32",
                              device="cpu", batch_tokens=256))
    return store_samples(out)


def _argv(target, data, out, *extra):
    return ["capture", "--target", str(target), "--data", str(data), "--out", str(out), "--layers", LAYERS,
            "--dtype", "fp32", "--device", "cpu", "--batch-tokens", "256", "--shard-tokens", "60", *extra]


def _committed(out) -> int:
    try:
        return len(open_store(out))
    except Exception:  # noqa: BLE001 - killed before rank 0 wrote the manifest
        return 0


def _commits(out) -> int:
    """Shards committed by rank 0 so far (its part file is replaced atomically at each commit)."""
    try:
        return len(json.loads((out / "parts" / "rank000.json").read_bytes())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tiny_llama, data, reference, tmp_path):
    out = tmp_path / "store"
    rng = random.Random(1234)
    kills, partial, history, attempt = 0, 0, [], 0
    to_first_commit = 0.5  # seconds from start to the first commit, learnt from the runs below
    while kills < 10:
        before = _committed(out)
        t0 = time.monotonic()
        r = Run(_argv(tiny_llama, data, out), tmp_path / f"run{len(history)}.log")
        if kills % 3 == 0:  # early: loading, resuming, the first batch
            delay = rng.uniform(0, to_first_commit)
            time.sleep(delay)
        else:  # while samples are being written: after 1-3 new commits (robust to the machine's speed), plus jitter
            n0, deadline = _commits(out), time.monotonic() + 120
            want = n0 + rng.randint(1, 3)
            while _commits(out) < want and r.proc.is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)
            if _commits(out) > n0:
                to_first_commit = time.monotonic() - t0
            delay = rng.uniform(0, 0.01)
            time.sleep(delay)
        alive = r.proc.is_alive()
        if alive:
            r.kill()
        code = r.wait()
        after = _committed(out)
        history.append((kills % 3 == 0, round(delay, 3), code, before, after))
        assert after >= before, history  # a kill never loses committed samples
        assert len(history) < 60, history
        if alive and code == -9:
            kills += 1
            partial += 0 < after < N
        else:
            assert code == 0, r.output()
        if after == N and kills < 10:  # finished before the 10th kill: check it, go on with a new store
            assert_same_store(store_samples(out), reference)
            attempt += 1
            out = tmp_path / f"store{attempt}"
    assert partial >= 3, f"too few kills landed mid-capture: {history}"

    code, log = run_cli(_argv(tiny_llama, data, out), tmp_path / "final.log")  # resume to completion
    assert code == 0, log
    got = store_samples(out)  # verify() clean, every id once
    assert len(got) == N
    assert_same_store(got, reference)
    assert not list((out / "shards").glob(".*.tmp")), "a temp shard survived the resume"


def test_bad_input_is_one_error_line_and_status_2(tiny_llama, data, tmp_path):
    from hstap.demo.toy import build_tokenizer, sample_texts

    other_tok = tmp_path / "other-tok"
    build_tokenizer(sample_texts()[:2], vocab_size=300, out_dir=other_tok)
    other = make_prepared(other_tok, tmp_path / "other-prepared", n=4, seed=3)
    cases = {
        "tokenizer": (_argv(tiny_llama, other, tmp_path / "s1"), "tokenizer_sha256"),
        "layer": (_argv(tiny_llama, data, tmp_path / "s2") + ["--layers", "1,6"], "layer id 6 is out of range"),
        "target": (_argv(tmp_path / "missing", data, tmp_path / "s4"), "does not exist"),
    }
    runs = {k: Run(argv, tmp_path / f"{k}.log") for k, (argv, _) in cases.items()}
    # one through a fresh interpreter: the real entry point, `python -m hstap.cli capture` (cheap: the config is refused
    # before torch is imported)
    p = subprocess.run([sys.executable, "-m", "hstap.cli", *_argv(tiny_llama, data, tmp_path / "s3"), "--dtype", "fp16"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p
    assert p.stderr.strip().splitlines() == ["hstap: error: --dtype: expected one of bf16, fp8, fp32, got 'fp16'"]
    for k, r in runs.items():
        code, out = r.wait(), r.output()
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert code == 2, (k, out)
        assert len(lines) == 1 and lines[0].startswith("hstap: error: ") and cases[k][1] in lines[0], (k, out)
    assert not (tmp_path / "s1" / "manifest.json").exists()  # refused before creating anything


def test_write_failure_stops_cleanly_then_resumes(tiny_llama, data, reference, tmp_path):
    """A real OS write error in the writer thread (RLIMIT_FSIZE: EFBIG once a shard file passes 100 kB): one error line,
    exit 2, the shards committed before stay intact; re-running without the limit completes the store."""
    out = tmp_path / "store"
    with contextlib.redirect_stdout(io.StringIO()):  # commit 10 samples first
        capture(CaptureConfig(target=str(tiny_llama), data=str(data), out=str(out), layers=LAYERS, dtype="fp32",
                              device="cpu", max_samples=10, shard_tokens=60))
    before = open_store(out).ids
    argv = _argv(tiny_llama, data, out)[:-2] + ["--shard-tokens", "400"]  # fp32: ~1 kB per token, 400+ per shard
    code, log = run_cli(argv, tmp_path / "fail.log", fsize_limit=100_000)
    lines = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith("capture: checked")]  # the resume's check
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hstap: error: File too large"), log
    st = open_store(out)
    assert st.ids == before and st.verify() == []
    assert not list((out / "shards").glob(".*.tmp"))  # the failed shard's temp file was removed
    code, log = run_cli(argv, tmp_path / "resume.log")
    assert code == 0, log
    assert_same_store(store_samples(out), reference)


def test_two_ranks_on_gloo_equal_one_process(tiny_llama, data, reference, tmp_path):
    out = tmp_path / "store"
    port = free_port()
    runs = [Run(_argv(tiny_llama, data, out, "--new"), tmp_path / f"rank{r}.log",
                env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
    for r in runs:
        assert r.wait() == 0, r.output()
    st = open_store(out)
    assert sorted({e["rank"] for e in st.manifest["shards"]}) == [0, 1]  # both ranks wrote shards ...
    merged = [i for e in st.manifest["shards"] for i in e["ids"]]
    assert len(merged) == N  # ... and rank 0 merged them all into manifest.json
    assert "2 process(es)" in runs[0].output() and f"{N} samples" in runs[0].output()
    assert_same_store(store_samples(out), reference)
