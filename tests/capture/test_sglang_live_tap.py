"""The SGLang hook's tap mode on a live SGLang 0.5.23 server (its own venv, SGLang's generic CPU path, fp32): an
ordinary client's requests, served together (decode batches of several requests), become store samples of their prompt
and generated tokens once they finish; a streamed request its client abandons is dropped, never half-written, and
SGLang's own health-check generations (`GET /health`) are not traffic; the
states the tap took from the decode batches equal a prefill recompute of the same tokens (`hstap verify`, fp32).

On the CPU there are no CUDA graphs (`--disable-cuda-graph`), so every decode step runs the Python hook; on a GPU the
tap needs `--cuda-graph-backend-decode disabled` (docs/engines.md)."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import pytest
from helpers.sglang_live import events, server, wait_for

from hstap.capture.sglang.protocol import ENV_LAYERS, hook_spec
from hstap.engines.sglang import generate

pytestmark = pytest.mark.sglang

LAYERS = [0, 2, 4]


def _abandon(url: str, prompt: list[int]) -> None:
    """A streamed request whose client goes away after the first chunk (SGLang aborts it)."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=120)
    r.readline()
    r.close()


def test_tap_stores_served_requests_from_live_decode_batches(tiny_llama, tmp_path):
    from hstap.store.reader import open_store
    from hstap.verify.stage import recompute

    store = tmp_path / "tap"
    spec = hook_spec(str(store), None, LAYERS, tap=True, tap_dtype="fp32", flush_s=0.2)
    # --skip-server-warmup: SGLang's start-up request ("The capital city of France is", 8 tokens) is served traffic
    # like any other and would be tapped
    srv = server(tiny_llama, tmp_path / "server.log", "--disable-radix-cache", "--decode-log-interval", "1",
                 "--skip-server-warmup",
                 "--forward-hooks", json.dumps([spec]), env={ENV_LAYERS: ",".join(map(str, LAYERS))})
    prompts = [[5 + i, 17, 33 + 2 * i, 101, 7] * (1 + i) for i in range(5)]
    answers: dict[int, dict] = {}

    def ask(i: int) -> None:  # five clients at once: their decode steps share batches
        answers[i] = generate(srv.url, prompts[i], 8 + 2 * i, sampling={"ignore_eos": True})

    with srv:
        print(f"\nSGLang server (tap) up in {srv.startup_s:.1f} s")
        clients = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for c in clients:
            c.start()
        for c in clients:
            c.join(300)
        _abandon(srv.url, [9, 8, 7, 6] * 10)
        urllib.request.urlopen(srv.url + "/health", timeout=60).read()  # SGLang generates a token for HEALTH_CHECK_*
        wait_for(lambda: (store / "manifest.json").is_file() and len(open_store(store)) >= len(prompts), 120,
                 "the tapped samples")
        wait_for(lambda: [e for e in events(store) if e.get("event") == "dropped"], 60, "the abandoned request's drop")
        log = srv.log_text()
    s = open_store(store)
    assert s.manifest["contents"]["kind"] == "served traffic" and s.layers == LAYERS and s.dtype == "fp32"
    assert s.manifest["engine"]["name"] == "sglang" and s.manifest["engine"]["compute_dtype"] == "fp32"
    assert len(s) == len(prompts)  # neither the abandoned request nor SGLang's health checks are there
    got = sorted([s[i]["input_ids"].tolist(), s[i]["loss_mask"].tolist()] for i in range(len(s)))
    want = []
    for i, p in enumerate(prompts):
        out = answers[i]["output_ids"]
        assert len(out) == 8 + 2 * i
        fed = p + out[:-1]  # the last generated token was never fed: no state
        want.append([fed, [0] * len(p) + [1] * (len(fed) - len(p))])
    assert got == sorted(want)
    drops = [e for e in events(store) if e.get("event") == "dropped"]
    assert len(drops) == 1 and drops[0]["reason"] in ("aborted", "abort"), drops
    running = [int(n) for n in re.findall(r"Decode batch.*?#running-req: (\d+)", log)]
    assert running and max(running) > 1, running[:20]  # decode batches of several requests did run
    assert "replays decode batches from CUDA graphs" not in log
    rep = recompute(str(store), str(tiny_llama), samples=len(s), device="cpu", compute_dtype="fp32")
    assert rep["ok"], rep["problems"]  # decode-step states == a prefill of the same tokens, every layer, fp32
