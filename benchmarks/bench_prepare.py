"""Throughput of `hstap prepare` on the reference corpus, for several --num-proc values.

    python benchmarks/bench_prepare.py                      # ../shared reference tokenizer + train.jsonl.gz
    python benchmarks/bench_prepare.py --num-proc 1 2 4 8   # on a bigger machine

Baseline measured in the same run: the plain `tokenizer.apply_chat_template(tokenize=True)` loop over the same
conversations in one process (ids only, no loss mask, nothing written), i.e. what a naive prepare would cost.
Each prepare run is end to end (tokenizer load, reading, worker start-up, writing). Outputs of all runs are
compared: they must be identical whatever --num-proc is. Also prints the masked-token coverage of a few draft
vocabulary sizes, computed from the run's token_freq with the same function prepare uses. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import numpy as np

from hstap.data.conversations import read_conversations
from hstap.data.prepare_config import PrepareConfig
from hstap.data.prepare import prepare
from hstap.artifacts.vocab_map import build_vocab_map
from hstap.artifacts.model_dir import load_tokenizer

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "reference"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(SHARED / "target-tiny"))
    ap.add_argument("--data", default=str(SHARED / "corpus" / "train.jsonl.gz"))
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--coverage-at", type=int, nargs="+", default=[32000, 8192, 4096, 2048, 1024])
    args = ap.parse_args()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f} at start; python {sys.version.split()[0]}")
    tok = load_tokenizer(args.tokenizer)
    convs = [m for _, m in read_conversations(args.data)]
    t0 = time.perf_counter()
    n_tokens = sum(len(tok.apply_chat_template(m, tokenize=True, return_dict=False)) for m in convs)
    base = time.perf_counter() - t0
    print(f"baseline apply_chat_template(tokenize=True), 1 process: {len(convs)} samples, {n_tokens} tokens "
          f"in {base:.2f} s: {len(convs) / base:.0f} samples/s, {n_tokens / base:.0f} tokens/s (untruncated)")

    runs, freqs = [], []
    with tempfile.TemporaryDirectory(prefix="bench_prepare.") as tmp:
        for n in args.num_proc:
            out = Path(tmp) / f"np{n}"
            r0, c0 = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
            with redirect_stdout(StringIO()):
                s = prepare(PrepareConfig(tokenizer=args.tokenizer, data=[args.data], out=str(out), num_proc=n,
                                          draft_vocab=args.draft_vocab))
            r1, c1 = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
            # CPU seconds do not depend on what else the machine runs: main process vs (reaped) workers.
            s["cpu_main_s"] = round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2)
            s["cpu_workers_s"] = round(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, 2)
            runs.append(s)
            freqs.append((out / "token_freq.safetensors").read_bytes())
            print(f"prepare --num-proc {n}: {s['elapsed_s']:.2f} s, {s['samples_per_s']:.0f} samples/s, "
                  f"{s['tokens_per_s']:.0f} tokens/s (end to end); CPU s: main {s['cpu_main_s']}, "
                  f"workers {s['cpu_workers_s']}")
        from safetensors.numpy import load_file
        freq = load_file(str(Path(tmp) / f"np{args.num_proc[0]}" / "token_freq.safetensors"))["token_freq"]
    identical = all(f == freqs[0] for f in freqs) and all(
        {k: r[k] for k in ("written", "total_tokens", "masked_tokens")} ==
        {k: runs[0][k] for k in ("written", "total_tokens", "masked_tokens")} for r in runs)
    s = runs[0]
    print(f"counts: read {s['read']}, written {s['written']}, truncated {s['truncated']} (max_len 2048), "
          f"skipped {s['skipped_total']} {s['skipped']}; {s['total_tokens']} tokens, {s['masked_tokens']} loss-masked; "
          f"outputs identical across --num-proc: {identical}")
    coverage = {}
    for n in args.coverage_at:
        d2t, t2d = build_vocab_map(freq, n)
        coverage[n] = {"size": len(d2t), "coverage_pct": round(100.0 * float(freq[t2d].sum()) / float(freq.sum()), 3)}
        print(f"draft vocab {n:>6} -> {len(d2t):>5} ids: {coverage[n]['coverage_pct']:.2f}% of loss-masked tokens")
    print(json.dumps({
        "bench": "prepare", "cpus": os.cpu_count(), "loadavg_end": round(os.getloadavg()[0], 2),
        "samples": s["read"],
        "baseline_chat_template": {"s": round(base, 3), "samples_per_s": round(len(convs) / base, 1),
                                   "tokens_per_s": round(n_tokens / base, 1)},
        "prepare": {str(r["num_proc"]): {k: r[k] for k in ("elapsed_s", "samples_per_s", "tokens_per_s", "cpu_main_s",
                                                                  "cpu_workers_s")} for r in runs},
        "speedup_vs_num_proc_1": {str(r["num_proc"]): round(runs[0]["elapsed_s"] / r["elapsed_s"], 3) for r in runs},
        "identical_outputs": identical,
        "counts": {k: s[k] for k in ("read", "written", "truncated", "skipped", "total_tokens", "masked_tokens")},
        "coverage": coverage, "distinct_masked_tokens": int(np.count_nonzero(freq)),
    }))


if __name__ == "__main__":
    main()
