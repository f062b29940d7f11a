"""Train as you infer on the reference target: capture in one process, `hstap train --follow --consume` in another,
the store's size sampled over time; then the same samples trained offline with the same settings; chain-5 tau of both
drafters on held-out prompts.

    python benchmarks/follow_reference.py                         # one GPU: ../shared/reference (target-tiny, corpus)
    python benchmarks/follow_reference.py --ref DIR --device cuda  # a reference directory elsewhere (or REF=DIR)
    python benchmarks/follow_reference.py --tiny                  # CPU smoke run: a random toy target (tau ~1)

Stages (every one is a `python -m hstap.cli` process):
  1. prepare the first --samples conversations of REF/corpus/train.jsonl.gz (and the eval prompts of eval.jsonl.gz);
  2. in parallel: (a) `hstap train --follow --consume --keep-shards K` started first (it claims the empty store), then
     `hstap capture` into that store; a thread samples the store's shard files (count and bytes, temp files
     included) every 20 ms; (b) `hstap capture` of the same prepared set into a second store, then `hstap train` on
     it offline;
  3. `hstap eval` (greedy, chain k=5, --num-prompts, --max-new-tokens, fp32) of both drafters, side by side.
Both trainings use the same settings: --epochs, --lr (constant: a follow run without --steps has no schedule horizon,
so the offline run gets --warmup-ratio 0 --min-lr-ratio 1), --batch-tokens, --seed, no eval split. They differ only in
the order of the batches (the follow stream mixes each shard's passes into consecutive slots; offline epochs shuffle
the whole set).

The window's bound: the store never holds more than K shard files, so its bytes stay <= K x the largest shard
(reported: peak_files, peak_bytes, bound_bytes = K x the largest shard's bytes in the part files).

Expected on one H200 with the defaults (4000 conversations, ~1.8 M tokens, ~5.6 GB of bf16 states in 128 MiB
shards, window 4 = 512 MiB, 2 epochs): about 3 minutes (prepare ~15 s, the follow and the offline pipelines side by
side ~60-90 s including flex-attention compilation, the two evals side by side ~60 s); not measured at these
defaults. Measured (RESULTS.md, "Train as you serve"): --samples 2000 --num-prompts 24 in 271 s, the capture beside the
follower waiting on the window most of that time. It needs
~7 GB of disk for the work dir (the offline store). Ends with a table and one JSON line; with --out-dir, the logs, the
store size series (store_size.jsonl), the metrics and id logs and the eval reports are copied there.
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
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_STARTED: list[subprocess.Popen] = []  # stopped on the way out if still running (a failed stage ends the run)


def _cli(*args, log: Path, wait: bool = True, timeout: float = 900):
    """`python -m hstap.cli ARGS` with stdout+stderr to log; waits (and checks) unless wait=False."""
    f = open(log, "w")
    p = subprocess.Popen([sys.executable, "-m", "hstap.cli", *map(str, args)], stdout=f, stderr=subprocess.STDOUT,
                         cwd=HERE.parent, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             [str(HERE.parent)] + [x for x in [os.environ.get("PYTHONPATH")] if x])))
    _STARTED.append(p)
    if not wait:
        return p
    if p.wait(timeout) != 0:
        raise SystemExit(f"{' '.join(map(str, args[:1]))} failed ({p.returncode}); log {log}:\n{log.read_text()[-3000:]}")
    return p


def _check(p: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    if p.wait(timeout) != 0:
        raise SystemExit(f"a stage failed ({p.returncode}); log {log}:\n{log.read_text()[-3000:]}")


def _subset(src: Path, dst: Path, n: int) -> Path:
    with gzip.open(src, "rt") as f, open(dst, "w") as out:
        out.writelines(itertools.islice(f, n))
    return dst


def _tiny_reference(w: Path) -> tuple[Path, Path, Path]:
    """A random toy target (peaked head) and stdlib chats split into train/eval: (target, train.jsonl, eval.jsonl)."""
    import torch

    from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts, stdlib_conversations

    tok = build_tokenizer(sample_texts(), vocab_size=512, out_dir=w / "tok")
    model = build_random_target(w / "target", tok, model_type="llama", num_layers=6, hidden_size=64, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(str(w / "target"))
    convs = stdlib_conversations()
    (w / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs[:160]))
    (w / "eval.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs[160:200]))
    return w / "target", w / "train.jsonl", w / "eval.jsonl"


class StoreSampler(threading.Thread):
    """Samples STORE/shards (files and bytes, temp files included) every `period` seconds."""

    def __init__(self, store: Path, period: float = 0.02):
        super().__init__(daemon=True)
        self.store, self.period, self.stop, self.series = store, period, threading.Event(), []
        self.peak_files = self.peak_bytes = 0

    def run(self):
        t0 = time.monotonic()
        while not self.stop.is_set():
            files = nbytes = 0
            try:
                for e in os.scandir(self.store / "shards"):
                    try:
                        nbytes += e.stat().st_size
                        files += 1
                    except FileNotFoundError:  # consumed between the listing and the stat
                        pass
            except FileNotFoundError:
                pass
            self.peak_files, self.peak_bytes = max(self.peak_files, files), max(self.peak_bytes, nbytes)
            self.series.append((round(time.monotonic() - t0, 3), files, nbytes))
            time.sleep(self.period)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a random toy target (no REF needed)")
    ap.add_argument("--ref", default=os.environ.get("REF", str(HERE.parent.parent / "shared" / "reference")),
                    help="a directory with target-tiny/ and corpus/ (default: ../shared/reference beside the checkout)")
    ap.add_argument("--work", default=None, help="work dir for the stores and runs (default: a temp dir)")
    ap.add_argument("--out-dir", default=None, help="copy the small outputs here: logs, store sizes, metrics, reports")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    ap.add_argument("--samples", type=int, default=4000, help="training conversations (first N of train.jsonl.gz)")
    ap.add_argument("--keep-shards", type=int, default=4)
    ap.add_argument("--shard-mb", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    dev = a.device or ("cpu" if a.tiny else "cuda")
    work = Path(a.work or tempfile.mkdtemp(prefix="hstap-follow-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    if a.tiny:
        target, train_src, eval_src = _tiny_reference(work)
        a.samples, a.batch_tokens, a.num_prompts, a.max_new_tokens = 160, 1024, 2, 16
        shard = ["--shard-tokens", "1200"]  # ~20 shards
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # 3-4 processes side by side on a small CPU
        vocab, cap_extra, extra = 96, ["--layers", "1,3,4"], ["--ttt", "3"]
    else:
        ref = Path(a.ref)
        target = ref / "target-tiny"
        train_src = _subset(ref / "corpus" / "train.jsonl.gz", work / "train.jsonl", a.samples)
        eval_src = ref / "corpus" / "eval.jsonl.gz"
        shard, vocab = ["--shard-mb", str(a.shard_mb)], 8192
        cap_extra, extra = ["--compute-dtype", "fp32", "--batch-tokens", "65536"], ["--workers", "0"]
    timings = {}

    t = time.monotonic()
    procs = [(_cli("prepare", "--tokenizer", target, "--data", src, "--out", work / out, "--draft-vocab", vocab,
                   "--num-proc", 1 if a.tiny else 8, log=work / f"{out}.log", wait=False), work / f"{out}.log")
             for src, out in ((train_src, "prep"), (eval_src, "prep-eval"))]
    for p, log in procs:
        _check(p, log)
    timings["prepare_s"] = round(time.monotonic() - t, 1)

    train_common = ["--target", target, "--vocab-map", work / "prep", "--eval-frac", "0", "--epochs", a.epochs,
                    "--lr", a.lr, "--batch-tokens", a.batch_tokens, "--device", dev, "--log-every", 10,
                    "--save-every", 100000, "--keep", 2, "--seed", 0, "--no-tensorboard", *extra]
    capture = ["capture", "--target", target, "--data", work / "prep", "--device", dev, *shard, *cap_extra]

    t = time.monotonic()
    # (a) follow: the trainer first, so that its window holds from the capture's first shard
    follow = _cli("train", "--store", work / "store-follow", "--out", work / "run-follow", "--follow", "--consume",
                  "--keep-shards", a.keep_shards, *train_common, log=work / "train-follow.log", wait=False)
    while not (work / "store-follow" / "consumer.json").exists():
        if follow.poll() is not None:
            raise SystemExit(f"the follow trainer stopped:\n{(work / 'train-follow.log').read_text()[-3000:]}")
        time.sleep(0.05)
    sampler = StoreSampler(work / "store-follow")
    sampler.start()
    cap_f = _cli(*capture, "--out", work / "store-follow", log=work / "capture-follow.log", wait=False)
    # (b) offline, side by side: capture the same samples into another store, then train on it
    cap_o = _cli(*capture, "--out", work / "store-offline", log=work / "capture-offline.log", wait=False)
    _check(cap_o, work / "capture-offline.log")
    off = _cli("train", "--store", work / "store-offline", "--out", work / "run-offline", "--warmup-ratio", 0,
               "--min-lr-ratio", 1, *train_common, log=work / "train-offline.log", wait=False)
    _check(cap_f, work / "capture-follow.log")
    timings["follow_capture_s"] = round(time.monotonic() - t, 1)
    _check(follow, work / "train-follow.log")
    timings["follow_s"] = round(time.monotonic() - t, 1)
    sampler.stop.set()
    sampler.join()
    _check(off, work / "train-offline.log")
    timings["follow_and_offline_s"] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    evals = {name: _cli("eval", "--target", target, "--drafter", work / f"run-{name}", "--data", work / "prep-eval",
                        "--out", work / f"eval-{name}", "--num-prompts", a.num_prompts, "--max-new-tokens",
                        a.max_new_tokens, "--k", 5, "--mode", "chain", "--device", dev, "--dtype", "fp32",
                        log=work / f"eval-{name}.log", wait=False) for name in ("follow", "offline")}
    for name, p in evals.items():
        _check(p, work / f"eval-{name}.log")
    timings["eval_s"] = round(time.monotonic() - t, 1)

    from hstap.store.manifest import load_manifest, load_parts, union_entries
    sf = work / "store-follow"
    entries, _, _ = union_entries(load_manifest(sf), load_parts(sf))
    biggest = max(int(e["bytes"]) for e in entries)
    reports = {n: json.loads((work / f"eval-{n}" / "report.json").read_text()) for n in evals}
    steps = {n: [json.loads(x) for x in (work / f"run-{n}" / "metrics.jsonl").read_text().splitlines()
                 if x.strip() and not json.loads(x).get("eval")][-1]["step"] for n in evals}
    with open(work / "store_size.jsonl", "w") as f:
        f.writelines(json.dumps({"t": s, "files": n, "bytes": b}) + "\n" for s, n, b in sampler.series)
    res = {"bench": "follow_reference", "tiny": a.tiny, "device": dev, "samples": sum(len(e["ids"]) for e in entries),
           "shards": len(entries), "epochs": a.epochs,
           "keep_shards": a.keep_shards, "peak_files": sampler.peak_files, "peak_bytes": sampler.peak_bytes,
           "largest_shard_bytes": biggest, "bound_bytes": a.keep_shards * biggest,
           "store_bytes_total": sum(int(e["bytes"]) for e in entries),
           "within_window": sampler.peak_files <= a.keep_shards and sampler.peak_bytes <= a.keep_shards * biggest,
           "left_on_disk": len(list((sf / "shards").iterdir())), "steps": steps,
           "tau": {n: round(r["tau"], 4) for n, r in reports.items()},
           "tau_follow_minus_offline": round(reports["follow"]["tau"] - reports["offline"]["tau"], 4),
           "lossless": {n: r["lossless"] for n, r in reports.items()}, "num_prompts": a.num_prompts,
           "timings": timings, "total_s": round(time.monotonic() - t_start, 1), "work": str(work)}
    print(f"{'':10s} {'steps':>6s} {'chain-5 tau':>12s}")
    for n in evals:
        print(f"{n:10s} {steps[n]:6d} {reports[n]['tau']:12.3f}")
    print(f"store: {len(entries)} shards, {res['store_bytes_total'] / 1e9:.2f} GB captured; peak on disk "
          f"{sampler.peak_files} files / {sampler.peak_bytes / 1e6:.1f} MB (bound {a.keep_shards} x "
          f"{biggest / 1e6:.1f} MB = {a.keep_shards * biggest / 1e6:.1f} MB); {res['left_on_disk']} left at the end")
    if a.out_dir:  # the small outputs only: logs, the store size series, metrics, id logs, eval reports
        out = Path(a.out_dir)
        for f in [*work.glob("*.log"), work / "store_size.jsonl", *work.glob("run-*/metrics.jsonl"),
                  *work.glob("run-*/follow.jsonl"), *work.glob("eval-*/report.json")]:
            dst = out / f.relative_to(work)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    print(json.dumps(res))


if __name__ == "__main__":
    try:
        main()
    finally:
        for proc in _STARTED:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
