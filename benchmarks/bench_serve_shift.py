"""Train as you serve under a traffic shift, on the live vLLM (`hstap serve-loop`): a drafter trained offline on one
domain of the corpus (the Python documentation conversations) is served traffic that starts in that domain and then
shifts to another (the Linux kernel documentation), served fixed, continued by the loop with a plain window, and
continued by the loop with anchor replay (its own offline store rehearsed beside the window), and continued by the loop
that also trains on the drafts vLLM rejected (the tap's side branches, `--side-rows`, `--train.side-branches`);
afterwards each run's final drafter is served held-back prompts of the first domain (forgetting).

    python benchmarks/bench_serve_shift.py                       # the reference target and corpus (../shared)
    python benchmarks/bench_serve_shift.py --tiny                # CPU smoke run: a random toy target built on the spot

Stages (each a `python -m hstap.cli` process; one vLLM server at a time):
  0. the offline drafter: the target's own answers to the first --offline-samples pydocs conversations of
     corpus/train.jsonl.gz, captured in the same pass (`hstap generate --capture`), then `hstap train` --offline-steps
     on that store (constant lr, TTT --k, the whole target vocabulary);
  1. the served stream: --before pydocs prompts (corpus/eval.jsonl.gz), then --requests linuxdocs prompts
     (corpus/train.jsonl.gz: the offline drafter never saw them), each its conversation's first user turn;
  2. `serve-loop --mode target` on the stream: reference outputs, target-only throughput;
  3. `serve-loop --mode fixed --drafter OFFLINE` (the loop off);
  4. `serve-loop --mode loop --drafter OFFLINE` (plain window: the trainer follows the served traffic alone);
  5. `serve-loop --mode loop --drafter OFFLINE --anchor-store OFFLINE_STORE --anchor-fraction A` (anchor replay);
  6. `serve-loop --mode loop --drafter OFFLINE --side-rows R --train.side-branches B` (side branches: the loop also
     trains on the rows of the drafts the target rejected);
  7. forgetting: `serve-loop --mode fixed` with each run's final served drafter on --forget held-back pydocs prompts
     of corpus/eval.jsonl.gz that the stream does not contain;
  8. offline (--offline-side N > 0): a served store with side branches (`serve-loop --mode loop` with the offline
     drafter on N more linuxdocs prompts, its trainer stopped after one step so that the store is kept), then the
     offline drafter trained --offline-side-steps on it with and without its side branches (`hstap train
     --side-branches`), each run's sim tau on the same held-back 15% of that store.
--runs picks the stream runs (target, fixed, window, anchor, side; default all but side; target is the reference and
always runs first);
--train-steps caps every loop trainer at that many steps (constant learning rate), so that loop runs are compared at
equal trainer steps on the same stream.
Every serve-loop run: the same server settings (fp32, enforce_eager on the CPU, prefix caching off) and client load;
vLLM pinned to CPU --server-cpus, the serve-loop process (client, gate) and the loop's trainer to --trainer-cpus, so
that serving throughput with the loop on against off says what the loop costs when the trainer has a core of its own.
Outputs of every stream run are compared with stage 2's token for token; requests lost or answered twice are counted.

Figures: vLLM's acceptance (its per-request counters) per --window answers across the shift for the three drafter
runs; after the shift, over the last --tail answers: each loop run against the fixed drafter (the goal: >= 1.25x
within 1,000 requests after the shift); forgetting: acceptance on the held-back first-domain prompts, each loop run's
final drafter against the fixed one (the goal: within 5%); the gate's decisions (loaded, refused, rolled back); the
time from an answer to a served drafter that learned from it; generated tokens/s per run. Writes bench_serve_shift.json
and shift.png into the work dir (and --out-dir, if given), prints a table and ONE JSON line.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_serve_loop import _cli, _tiny, _vocab  # noqa: E402


def first_turns(src: Path, source: str | None, skip: int, n: int) -> list[dict]:
    """One-turn conversations (the first user turn) of conversations skip..skip+n of `source` in a JSONL(.gz) file
    (source None: any)."""
    out, seen = [], 0
    with (gzip.open(src, "rt") if str(src).endswith(".gz") else open(src)) as f:
        for line in f:
            rec = json.loads(line)
            if source is not None and rec.get("source") != source:
                continue
            seen += 1
            if seen <= skip:
                continue
            conv = rec.get("conversations") or rec.get("messages")
            user = next(m for m in conv if (m.get("role") or m.get("from")) in ("user", "human"))
            out.append({"id": rec.get("id"), "source": rec.get("source"),
                        "conversations": [{"role": "user", "content": user.get("content", user.get("value"))}]})
            if len(out) == n:
                break
    if len(out) < n:
        raise SystemExit(f"{src}: {len(out)} {source} conversations after the first {skip}, fewer than {n}")
    return out


def write_jsonl(path: Path, rows: list[dict], answer: bool = False) -> Path:
    with open(path, "w") as f:
        for r in rows:
            conv = r["conversations"] + ([{"role": "assistant", "content": "-"}] if answer else [])
            f.write(json.dumps({"id": r["id"], "source": r.get("source"), "conversations": conv}) + "\n")
    return path


def windows(served: Path, size: int) -> list[dict]:
    """vLLM's acceptance per `size` answers in the order the prompts were sent (prompt index), the shift at a fixed
    place whatever the finishing order."""
    recs = sorted((json.loads(x) for x in served.read_text().splitlines()), key=lambda r: r["i"])
    recs = [r for r in recs if "tokens" in r]
    out = []
    for a in range(0, len(recs), size):
        w = recs[a:a + size]
        d = sum(r.get("num_draft_tokens", 0) for r in w)
        acc = sum(r.get("num_accepted_draft_tokens", 0) for r in w) / d if d else 0.0
        out.append({"upto": w[-1]["i"] + 1, "acceptance": acc, "drafter": max(r.get("drafter", 0) for r in w)})
    return out


def acceptance_of(served: Path, lo: int, hi: int) -> float:
    """vLLM's acceptance over the answers to prompts lo..hi-1."""
    recs = [json.loads(x) for x in served.read_text().splitlines()]
    recs = [r for r in recs if "tokens" in r and lo <= r["i"] < hi]
    d = sum(r.get("num_draft_tokens", 0) for r in recs)
    return sum(r.get("num_accepted_draft_tokens", 0) for r in recs) / d if d else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a random toy target")
    ap.add_argument("--target", default=str(HERE.parent.parent / "shared" / "reference" / "target-tiny"))
    ap.add_argument("--corpus", default=str(HERE.parent.parent / "shared" / "reference" / "corpus"))
    ap.add_argument("--work", default=None, help="work dir (default: a temp dir, removed unless --keep)")
    ap.add_argument("--out-dir", default=None, help="also copy the result JSON and the figure here")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--offline-samples", type=int, default=400)
    ap.add_argument("--offline-steps", type=int, default=300)
    ap.add_argument("--before", type=int, default=100, help="first-domain requests before the shift")
    ap.add_argument("--requests", type=int, default=1000, help="second-domain requests after the shift")
    ap.add_argument("--forget", type=int, default=150, help="held-back first-domain prompts (forgetting)")
    ap.add_argument("--tail", type=int, default=300, help="the last N answers: 'after the shift' figures")
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--update-every", type=int, default=32)
    ap.add_argument("--keep-shards", type=int, default=6)
    ap.add_argument("--shard-tokens", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3, help="offline training's learning rate")
    ap.add_argument("--loop-lr", type=float, default=1e-3, help="the loop trainer's (continuing a trained drafter)")
    ap.add_argument("--anchor-fraction", type=float, default=0.3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--server-cpus", default="0")
    ap.add_argument("--trainer-cpus", default="1")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--runs", default="target,fixed,window,anchor", help="stream runs (see above; side: add it)")
    ap.add_argument("--side-rows", default="all", choices=["first", "all"])
    ap.add_argument("--side-branches", type=int, default=2, help="side branches trained on per sample")
    ap.add_argument("--side-context", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=0, help="cap every loop trainer (0: no cap)")
    ap.add_argument("--offline-side", type=int, default=0, help="prompts of the offline side-branch comparison")
    ap.add_argument("--offline-side-steps", type=int, default=60)
    ap.add_argument("--stage", default="all", choices=["all", "offline", "served", "offline-side", "report"],
                    help="offline: the offline drafter only (no server); served: the rest, reusing it from --work; "
                         "offline-side: stage 8's training on the served stores in --work, then the report; report: "
                         "the report of the runs in --work")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="hstap-serve-shift-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if a.tiny:
        target, train_src, eval_src = _tiny(work)
        first, second = None, None  # the toy chats have one source: the smoke run checks the machinery only
        a.offline_samples, a.offline_steps, a.before, a.requests, a.forget = 48, 30, 16, 48, 16
        a.max_tokens, a.shard_tokens, a.update_every, a.max_model_len, a.window, a.tail = 24, 512, 8, 512, 16, 24
        a.keep_shards, a.save_every, a.batch_tokens = 4, 3, 1024
        fsrc = ssrc = eval_src
        offline = first_turns(train_src, None, 0, a.offline_samples)
        before = first_turns(eval_src, None, 0, a.before)
        after = first_turns(eval_src, None, a.before, a.requests)
        forget = first_turns(eval_src, None, a.before + a.requests, a.forget)
    else:
        corpus = Path(a.corpus)
        target, first, second = Path(a.target), "pydocs", "linuxdocs"
        fsrc, ssrc = corpus / "eval.jsonl.gz", corpus / "train.jsonl.gz"
        offline = first_turns(ssrc, first, 0, a.offline_samples)
        before = first_turns(fsrc, first, 0, a.before)
        after = first_turns(ssrc, second, 0, a.requests)
        forget = first_turns(fsrc, first, a.before, a.forget)
    other = write_jsonl(work / "offline.jsonl", offline, answer=True)
    stream = write_jsonl(work / "stream.jsonl", before + after)
    held = write_jsonl(work / "forget.jsonl", forget)
    n = len(before) + len(after)

    t = time.monotonic()  # 0. the offline drafter, on the first domain
    if a.stage in ("all", "offline"):
        offline_drafter(a, work, target, other)
    if a.stage == "offline":
        return
    offline_s = time.monotonic() - t
    if a.stage in ("offline-side", "report"):  # the stream runs of an earlier --stage served in --work
        summaries, forgetting, loads = earlier_runs(a, work)
    else:
        summaries, forgetting, loads = stream_runs(a, work, target, stream, held)
    side_offline = offline_side(a, work, target, ssrc, second, len(after)) if a.offline_side and \
        a.stage != "report" else None
    report(a, work, n, len(before), summaries, forgetting, loads, offline_s, time.monotonic() - t0, side_offline)
    if not a.keep and a.work is None:
        shutil.rmtree(work, ignore_errors=True)


def offline_drafter(a, work: Path, target: Path, other: Path) -> None:
    """Stage 0: the target's answers to the offline prompts, captured, and the offline drafter trained on them."""
    _cli(work / "generate.log", "generate", "--target", target, "--data", other, "--out",
         work / "offline.generated.jsonl", "--capture", work / "offline-store", "--max-new-tokens", a.max_tokens,
         "--device", "cpu")
    _cli(work / "train-offline.log", "train", "--store", work / "offline-store", "--target", target, "--out",
         work / "offline-run", "--steps", a.offline_steps, "--ttt", a.k, "--lr", a.lr, "--warmup-ratio", 0,
         "--min-lr-ratio", 1, "--batch-tokens", a.batch_tokens, "--draft-vocab", _vocab(target), "--eval-frac", 0,
         "--save-every", a.offline_steps, "--device", "cpu", "--tensorboard", "false")


def stream_runs(a, work: Path, target: Path, stream: Path, held: Path):
    """Stages 2-7: the stream runs --runs picks, then the forgetting runs -> (summaries, forgetting, loads)."""
    common = ["--target", target, "--concurrency", a.concurrency, "--max-tokens", a.max_tokens, "--k", a.k,
              "--update-every", a.update_every, "--max-model-len", a.max_model_len, "--device", "cpu",
              "--server-cpus", a.server_cpus]
    loop = ["--mode", "loop", "--drafter", work / "offline-run", "--keep-shards", a.keep_shards, "--shard-tokens",
            a.shard_tokens, "--train.epochs", a.epochs, "--train.lr", a.loop_lr, "--train.ttt", a.k,
            "--train.batch_tokens", a.batch_tokens, "--train.save_every", a.save_every, "--trainer-cpus",
            a.trainer_cpus]
    if a.train_steps:  # equal trainer steps: every loop trainer stops there, its learning rate constant
        loop += ["--train.steps", a.train_steps, "--train.warmup_ratio", 0, "--train.min_lr_ratio", 1]
    runs = {"target only": ["--mode", "target"],
            "fixed": ["--mode", "fixed", "--drafter", work / "offline-run"],
            "loop, window": loop,
            "loop, anchor replay": [*loop, "--anchor-store", work / "offline-store", "--anchor-fraction",
                                    a.anchor_fraction],
            "loop, side branches": [*loop, "--side-rows", a.side_rows, "--train.side_branches", a.side_branches,
                                    "--train.side_context", a.side_context]}
    pick = {"target": "target only", "fixed": "fixed", "window": "loop, window", "anchor": "loop, anchor replay",
            "side": "loop, side branches"}
    chosen = {"target only"} | {pick[x.strip()] for x in a.runs.split(",") if x.strip()}
    runs = {k: v for k, v in runs.items() if k in chosen}
    summaries, loads, pin = {}, {}, ["taskset", "-c", a.trainer_cpus] if a.trainer_cpus else []
    for i, (name, extra) in enumerate(runs.items()):
        out = work / f"run{i}"
        ref = ["--reference", work / "run0" / "served.jsonl"] if i else []
        loads[name] = os.getloadavg()[0]
        _cli(work / f"run{i}.log", "serve-loop", *common, "--prompts", stream, *extra, *ref, "--out", out,
             prefix=pin)
        summaries[name] = json.loads((out / "summary.json").read_text())
        print(f"bench_serve_shift: {name}: {summaries[name]['tokens_per_s']:.1f} tok/s, acceptance "
              f"{summaries[name]['acceptance']:.3f}", file=sys.stderr, flush=True)
    forgetting = {}
    for i, name in enumerate([k for k in summaries if k != "target only"], 1):
        final = summaries[name].get("final_drafter") or str(work / "offline-run")
        out = work / f"forget{i}"
        _cli(work / f"forget{i}.log", "serve-loop", *common, "--prompts", held, "--mode", "fixed", "--drafter", final,
             "--out", out, prefix=pin)
        forgetting[name] = json.loads((out / "summary.json").read_text())["acceptance"]
    return summaries, forgetting, loads


def earlier_runs(a, work: Path):
    """(summaries, forgetting, loads) of the stream and forgetting runs an earlier --stage served left in --work."""
    names = ["target only"] + [k for k in ("fixed", "loop, window", "loop, anchor replay", "loop, side branches")
                               if {"fixed": "fixed", "loop, window": "window", "loop, anchor replay": "anchor",
                                   "loop, side branches": "side"}[k] in a.runs.split(",")]
    summaries = {k: json.loads((work / f"run{i}" / "summary.json").read_text()) for i, k in enumerate(names)}
    forgetting = {k: json.loads((work / f"forget{i}" / "summary.json").read_text())["acceptance"]
                  for i, k in enumerate(names[1:], 1)}
    return summaries, forgetting, {k: float("nan") for k in names}


def offline_side(a, work: Path, target: Path, ssrc, second, skip: int) -> dict:
    """Stage 8: a served store with side branches, then the offline drafter trained on it with and without them; each
    run's last eval line (sim tau on the same held-back samples). --stage offline-side: the training only, on the
    served stores an earlier run left in --work."""
    rows = first_turns(ssrc, second, skip, a.offline_side) if second else first_turns(ssrc, None, 0, a.offline_side)
    prompts = write_jsonl(work / "side-prompts.jsonl", rows)
    tap = {}
    for name, side in (("plain tap", "none"), ("side rows", a.side_rows)):  # the same drafter, served fixed: the
        if a.stage == "offline-side":
            out = work / f"side-served-{side}"
        else:
            out = work / f"side-served-{side}"  # tap's cost is the only difference (its trainer stops after a step)
            _cli(work / f"side-served-{side}.log", "serve-loop", "--target", target, "--concurrency", a.concurrency,
                 "--max-tokens", a.max_tokens, "--k", a.k, "--max-model-len", a.max_model_len, "--device", "cpu",
                 "--server-cpus", a.server_cpus, "--prompts", prompts, "--mode", "loop", "--drafter",
                 work / "offline-run", "--side-rows", side, "--keep-shards", 1000, "--shard-tokens", a.shard_tokens,
                 "--train.steps", 1, "--update-every", 10 ** 9, "--holdout-frac", 0, "--trainer-cpus", a.trainer_cpus,
                 "--out", out, prefix=["taskset", "-c", a.trainer_cpus] if a.trainer_cpus else [])
        sm = json.loads((out / "summary.json").read_text())
        tap[name] = {"tokens_per_s": sm["tokens_per_s"], "acceptance": sm["acceptance"],
                     "store_bytes": sm["store"].get("bytes_at_end"), "samples": sm["store"].get("samples_committed")}
    from hstap.artifacts.drafter_dir import resolve_drafter_dir

    res = {}
    for name, nb in (("without side branches", 0), ("with side branches", a.side_branches)):
        run = work / f"side-train-{nb}"
        _cli(work / f"side-train-{nb}.log", "train", "--store", out / "store", "--target", target, "--out", run,
             "--init-from", resolve_drafter_dir(work / "offline-run"), "--steps", a.offline_side_steps, "--ttt", a.k, "--lr", a.loop_lr,
             "--warmup-ratio", 0, "--min-lr-ratio", 1, "--batch-tokens", a.batch_tokens, "--eval-frac", 0.15,
             "--save-every", a.offline_side_steps, "--device", "cpu", "--tensorboard", "false", "--side-branches", nb,
             "--side-context", a.side_context, "--vocab-map", out / "vocab_map.safetensors")
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        ev, st = [x for x in lines if x.get("eval")], [x for x in lines if "tokens" in x]
        last = ev[-1] if ev else {}  # a store too small for a held-back split (--tiny) has no eval line
        res[name] = {"sim_tau": last.get("sim_tau"), "eval_positions": last.get("eval_positions", 0),
                     "steps": st[-1]["step"] if st else 0,
                     "tokens_per_step": sum(x["tokens"] for x in st) / len(st) if st else 0}
    from hstap.store.reader import open_store
    s = open_store(out / "store")
    res["store"] = {"samples": len(s), "tokens": sum(s.lengths),
                    "side_rows": sum(int(n) for e in s.manifest["shards"] for n in e.get("side_rows", ()))}
    res["tap"] = tap | {"side / plain tokens/s": tap["side rows"]["tokens_per_s"] / tap["plain tap"]["tokens_per_s"]}
    return res


def trainer_steps(run: Path) -> int | None:
    """The last optimizer step of a loop run's trainer (its metrics.jsonl), None for a run without one."""
    f = run / "run" / "metrics.jsonl"
    steps = [json.loads(x).get("step", 0) for x in f.read_text().splitlines()] if f.is_file() else []
    return max(steps) if steps else None


def report(a, work: Path, n: int, shift: int, summaries: dict, forgetting: dict, loads: dict, offline_s: float,
           total_s: float, side_offline: dict | None = None) -> None:
    from hstap.console import table
    from hstap.plots import serve_shift_plot

    curves = {k: windows(work / f"run{i}" / "served.jsonl", a.window) for i, k in enumerate(summaries) if i}
    serve_shift_plot(curves, shift, work / "shift.png")
    tail = {k: acceptance_of(work / f"run{i}" / "served.jsonl", n - a.tail, n) for i, k in enumerate(summaries) if i}
    pre = {k: acceptance_of(work / f"run{i}" / "served.jsonl", 0, shift) for i, k in enumerate(summaries) if i}
    post = {k: acceptance_of(work / f"run{i}" / "served.jsonl", shift, n) for i, k in enumerate(summaries) if i}
    ref = "fixed" if "fixed" in tail else "loop, window"  # what the x columns are relative to
    base, fbase = tail[ref], forgetting[ref]
    tps = summaries[ref]["tokens_per_s"]
    steps = {k: trainer_steps(work / f"run{i}") for i, k in enumerate(summaries)}
    rows = []
    for name, s in summaries.items():
        spec, loop = s["mode"] != "target", s["mode"] == "loop"
        ll, g, la = s.get("lossless") or {}, s.get("gate") or {}, s.get("learned_after") or {}
        rows.append([name, f"{s['answered']}/{s['requests']}, {s['lost']} lost, {s['duplicates']} twice",
                     f"{ll.get('equal')}/{ll.get('compared')}" if ll else "ref",
                     f"{pre[name]:.3f}" if spec else "-", f"{post[name]:.3f}" if spec else "-",
                     f"{tail[name]:.3f} ({tail[name] / base:.2f}x)" if spec and base else "-",
                     f"{forgetting[name]:.3f} ({forgetting[name] / fbase:.2f}x)" if name in forgetting and fbase
                     else "-",
                     f"{s['updates_taken']} / {g.get('refused')} / {g.get('rolled_back')}" if loop else "-",
                     f"{la['median_s']:.0f}" if loop and la.get("median_s") is not None else "-",
                     str(steps[name]) if loop else "-",
                     f"{s['tokens_per_s']:.1f} ({s['tokens_per_s'] / tps:.2f}x)", f"{loads[name]:.1f}"])
    print(table(["run", "requests", "= target", "acc before shift", "acc after", f"acc last {a.tail}",
                 "acc first domain, final drafter", "loaded / refused / rolled back", "answer -> served s",
                 "trainer steps", f"tok/s (vs {ref})", "load"], rows))
    goals = {name: {f"after_shift_vs_{ref}": tail[name] / base if base else None,
                    f"forgetting_vs_{ref}": forgetting[name] / fbase if fbase else None}
             for name in ("loop, window", "loop, anchor replay", "loop, side branches") if name in tail}
    if "loop, side branches" in tail and "loop, window" in tail:  # the side-branch goal: against the plain loop
        w = "loop, window"
        goals["side_vs_window"] = {"after_shift": tail["loop, side branches"] / tail[w] if tail[w] else None,
                                   "forgetting": forgetting["loop, side branches"] / forgetting[w]
                                   if forgetting[w] else None,
                                   "tokens_per_s": summaries["loop, side branches"]["tokens_per_s"]
                                   / summaries[w]["tokens_per_s"]}
    if side_offline:
        print(json.dumps({"offline_side": side_offline}))
    result = {"bench": "serve_shift", "args": {k: str(v) for k, v in vars(a).items()}, "offline_s": offline_s,
              "total_s": total_s, "loadavg": loads, "shift_at": shift, "requests": n, "tail_acceptance": tail,
              "before_shift": pre, "after_shift": post, "forgetting": forgetting, "goals": goals, "curves": curves,
              "trainer_steps": steps, "offline_side": side_offline,
              "runs": {k: {x: v.get(x) for x in ("mode", "answered", "lost", "duplicates", "tokens_per_s",
                                                  "acceptance", "tau", "updates_taken", "gate", "learned_after",
                                                  "lossless", "counters_agree", "store", "wall_s")}
                       for k, v in summaries.items()}}
    (work / "bench_serve_shift.json").write_text(json.dumps(result, indent=1))
    if a.out_dir:
        dst = Path(a.out_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("bench_serve_shift.json", "shift.png"):
            shutil.copy(work / f, dst / f)
    print(json.dumps({k: result[k] for k in ("bench", "total_s", "shift_at", "requests", "tail_acceptance",
                                              "forgetting", "goals")}))


if __name__ == "__main__":
    main()
