"""`hstap capture --engine sglang` through a live SGLang 0.5.23 server (its own venv, SGLang's generic CPU path, fp32)
with hstap's `--forward-hooks` hook and plugin, on a tiny random Llama built here. One server for the module (it is
restarted once, by the kill test): capture equals `--engine hf` (prompts longer than `--chunked-prefill-size` are
prefilled in chunks and stitched); a SIGKILL of the whole server mid-capture, a restart and the same command give every
sample exactly once with the values of the uninterrupted run; a request whose prefix comes from SGLang's radix cache is
dropped, never stored truncated, while the driver's own requests never hit the cache (docs/engines.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest
from helpers.capture import assert_same_store, committed_count, prepare_records, store_samples
from helpers.sglang import records
from helpers.sglang_live import REPO, events, server, wait_for

from hstap.capture.session import encode_rid, http_json
from hstap.capture.sglang.protocol import ENV_LAYERS, hook_spec
from hstap.engines.sglang import generate

pytestmark = pytest.mark.sglang

LAYERS = [0, 2, 4]  # canonical ids in the 6-layer tiny target (5, the last layer's output, SGLang cannot capture)
CHUNK = 64  # --chunked-prefill-size: most prompts here are longer (21 of 24: 56..154 tokens)
N = 24


def _cmd(model, data, store, url) -> list[str]:
    return [sys.executable, "-m", "hstap.cli", "capture", "--engine", "sglang", "--server", url, "--target",
            str(model), "--data", str(data), "--out", str(store), "--layers", ",".join(map(str, LAYERS)),
            "--dtype", "fp32", "--concurrency", "2"]


@pytest.fixture(scope="module")
def live(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-live")
    data = prepare_records(tiny_llama, root / "p", records(N, seed=3))  # hostile sample ids first
    store = root / "store"
    spec = hook_spec(str(store), str(data), LAYERS, flush_s=0.5, shard_tokens=400)
    srv = server(tiny_llama, root / "server.log", "--chunked-prefill-size", str(CHUNK),
                 "--forward-hooks", json.dumps([spec]), env={ENV_LAYERS: ",".join(map(str, LAYERS))})
    srv.start()
    print(f"\nSGLang server up in {srv.startup_s:.1f} s")
    try:
        yield SimpleNamespace(srv=srv, data=data, store=store, root=root, model=tiny_llama)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf_store(live):
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    out = live.root / "hf"
    capture(CaptureConfig(target=str(live.model), data=str(live.data), out=str(out), layers="0,2,4", dtype="fp32",
                          device="cpu"))
    return store_samples(out)


@pytest.fixture(scope="module")
def uninterrupted(live):
    """The whole capture in one run of the command; its store, copied aside (the kill test reuses the hook's path)."""
    p = subprocess.run(_cmd(live.model, live.data, live.store, live.srv.url), capture_output=True, text=True,
                       timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    ref = live.root / "ref"
    shutil.copytree(live.store, ref)
    return ref, p.stdout


def test_capture_through_a_live_server_equals_hf(live, uninterrupted, hf_store):
    ref, stdout = uninterrupted
    assert f"capture: {N} samples via SGLang 0.5.23" in stdout and "dropped 0" in stdout, stdout
    got = store_samples(ref)
    # fp32 on both sides: SGLang's torch_native kernels against HF's; seen: max abs error 1e-6 on states up to ~4
    assert_same_store(got, hf_store, atol=1e-5)
    man = json.loads((ref / "manifest.json").read_text())
    assert man["engine"]["name"] == "sglang" and man["engine"]["version"] == "0.5.23"
    assert man["engine"]["compute_dtype"] == "float32" and man["dtype"] == "fp32" and man["layers"] == LAYERS
    part = json.loads((ref / "parts" / "rank000.json").read_text())
    assert part["closed"] is True and len(part["shards"]) > 1  # the session ended; several commits
    info = http_json(live.srv.url + "/server_info")
    assert info["chunked_prefill_size"] == CHUNK and info["disable_radix_cache"] is False
    long = [sid for sid, s in got.items() if len(s["input_ids"]) > CHUNK]
    assert len(long) >= N // 2  # prefilled in several chunks (SGLang cuts a prompt at CHUNK tokens), then stitched
    log = live.srv.log_text()
    assert f"#new-token: {CHUNK}," in log  # full chunks did run
    assert "hstap: LlamaForCausalLM captures canonical layers [0, 2, 4]" in log  # the plugin, inside the server


def test_sigkill_of_the_server_mid_capture_then_restart_and_resume(live, uninterrupted):
    import time

    ref, _ = uninterrupted
    shutil.rmtree(live.store)  # the same command as the uninterrupted run, from scratch (its rank is closed)
    cmd = _cmd(live.model, live.data, live.store, live.srv.url)
    with open(live.root / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    wait_for(lambda: committed_count(live.store) > 0 or proc.poll() is not None, 600, "a first commit")
    live.srv.kill()  # SIGKILL to the server's whole process group: HTTP server, scheduler, detokenizer
    done = committed_count(live.store)
    assert proc.wait(120) != 0  # the driver sees the server gone and stops, saying so
    out = (live.root / "killed.log").read_text()
    assert 0 < done < N, f"killed with {done} committed: not mid-capture ({out[-2000:]})"
    assert "hstap: error:" in out

    t0 = time.monotonic()
    live.srv.start()  # the same flags, the same port: the hook deletes what its killed writer left uncommitted
    print(f"\nSGLang server restarted in {time.monotonic() - t0:.1f} s")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert f"capture: {N - done} samples via SGLang" in p.stdout and f"{done} already in the store" in p.stdout
    resumed, want = store_samples(live.store), store_samples(ref)  # store_samples: no id twice, verify() clean
    assert sorted(resumed) == sorted(want)
    # The resumed run batches the rest differently: fp32 sums may differ in the last bits; a wrong or misplaced row
    # would be off by the states' own size (~1)
    assert_same_store(resumed, want, atol=1e-6)


def test_a_radix_cache_hit_is_dropped_never_stored_truncated(live):
    """docs/engines.md: the driver's requests each carry a random `extra_key` (their own radix-cache namespace), so they
    never reuse a cached prefix; a request of ours that does (a client without the key) is dropped by the hook."""
    from hstap.data.prepare import load_prepared

    before = store_samples(live.store)
    ds = load_prepared(live.data)
    row = max(range(len(ds)), key=lambda i: len(ds[i]["input_ids"]))
    ids, sid = list(ds[row]["input_ids"]), ds[row]["id"]
    first = generate(live.srv.url, ids, 0)  # another client: now cached
    assert first["meta_info"]["cached_tokens"] == 0
    keyed = generate(live.srv.url, ids, 0, extra_key=uuid.uuid4().hex)  # what the driver sends: a namespace of its own
    assert keyed["meta_info"]["cached_tokens"] == 0
    session = uuid.uuid4().hex[:12]
    hit = generate(live.srv.url, ids, 0, rid=encode_rid(session, row, sid))  # ours, without the key
    assert hit["meta_info"]["cached_tokens"] == len(ids) - 1  # SGLang computed only the last token
    drop = wait_for(lambda: [e for e in events(live.store) if e.get("session") == session
                             and e.get("reason") == "prefix_cache_hit"], 30, "the hook's drop event")
    assert drop[0]["id"] == sid and "radix cache" in drop[0]["detail"]
    after = store_samples(live.store)
    assert sorted(after) == sorted(before)  # nothing stored, nothing truncated
    assert_same_store(after, before, atol=0.0)
