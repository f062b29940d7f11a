"""Host cost of n-gram (prompt-lookup) drafting per decoding round: `hstap.speculative.drivers.NgramIndex`, grown by each
round's tokens, against the whole-context scan the decoders ran before it (numpy sliding windows, in this file), on
the same token streams; both must propose the same drafts.

    python benchmarks/bench_ngram.py                 # ~10 s, one core
    python benchmarks/bench_ngram.py --prompt 1000   # longer contexts

Streams: --streams random token lists of --prompt + --new tokens over a --vocab-id vocabulary; a round appends 1-3
tokens (an accepted draft prefix + the target's token), as n-gram decoding at tau ~2 does. Times: per round (lookup +
the index's update, the index's build over the prompt spread over the rounds), median of --repeat passes over all
streams. The n-gram lookup runs on the host between two verify forwards, so this time adds to each round (RESULTS.md:
0.211 ms a round on the H200 host with the scan). Prints a short table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hstap.speculative.drivers import NgramIndex  # noqa: E402


def scan(ids: list[int], k: int, max_ngram: int) -> list[int]:
    """The lookup as the decoders ran it before NgramIndex: a scan of the whole context every round."""
    arr = np.asarray(ids, dtype=np.int64)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        win = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # (len-n, n): windows that have a next token
        hits = np.flatnonzero((win == arr[-n:]).all(1))
        if hits.size:
            i = int(hits[-1]) + n
            return arr[i:i + k].tolist()
    return []


def streams(a) -> list[tuple[list[int], list[int]]]:
    """(tokens, round sizes) per stream."""
    g = np.random.default_rng(0)
    out = []
    for _ in range(a.streams):
        ids = g.integers(0, a.vocab, a.prompt + a.new).tolist()
        sizes, n = [], 0
        while n < a.new:
            sizes.append(int(min(g.integers(1, 4), a.new - n)))
            n += sizes[-1]
        out.append((ids, sizes))
    return out


def run_scan(data, k: int, max_ngram: int, prompt: int) -> tuple[float, int, list]:
    t, rounds, drafts = time.perf_counter(), 0, []
    for ids, sizes in data:
        at = prompt
        for s in sizes:
            drafts.append(scan(ids[:at], k, max_ngram))
            at += s
            rounds += 1
    return time.perf_counter() - t, rounds, drafts


def run_index(data, k: int, max_ngram: int, prompt: int) -> tuple[float, int, list]:
    t, rounds, drafts = time.perf_counter(), 0, []
    for ids, sizes in data:
        index, at = NgramIndex(max_ngram, ids[:prompt]), prompt  # built once per request, as the decoders do
        for s in sizes:
            drafts.append(index.propose(k))
            index.extend(ids[at:at + s])
            at += s
            rounds += 1
    return time.perf_counter() - t, rounds, drafts


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt", type=int, default=200, help="prompt tokens per stream")
    p.add_argument("--new", type=int, default=128, help="new tokens per stream")
    p.add_argument("--vocab", type=int, default=64, help="token ids drawn from [0, vocab): a small one repeats often")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    data = streams(a)
    res = {}
    for name, fn in (("scan", run_scan), ("index", run_index)):
        times = []
        for _ in range(a.repeat):
            el, rounds, drafts = fn(data, a.k, a.max_ngram, a.prompt)
            times.append(el / rounds)
        res[name] = {"us_per_round": 1e6 * statistics.median(times), "rounds": rounds, "drafts": drafts}
    same = res["scan"]["drafts"] == res["index"]["drafts"]
    out = {"bench": "ngram", "streams": a.streams, "prompt": a.prompt, "new": a.new, "vocab": a.vocab, "k": a.k,
           "max_ngram": a.max_ngram, "rounds": res["index"]["rounds"], "same_drafts": same,
           "scan_us_per_round": round(res["scan"]["us_per_round"], 2),
           "index_us_per_round": round(res["index"]["us_per_round"], 2),
           "speedup": round(res["scan"]["us_per_round"] / res["index"]["us_per_round"], 1)}
    print(f"n-gram lookup per round ({out['rounds']} rounds, contexts {a.prompt}-{a.prompt + a.new} tokens): "
          f"scan {out['scan_us_per_round']:.1f} us, index {out['index_us_per_round']:.1f} us "
          f"({out['speedup']}x); same drafts: {same}", file=sys.stderr)
    print(json.dumps(out))
    if not same:
        raise SystemExit("bench_ngram.py: the index proposed other drafts than the scan")
    return out


if __name__ == "__main__":
    main()
