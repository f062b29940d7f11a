"""Generation throughput of the embedded engine: multi-turn conversations answered by the lockstep batches of
`hstap.data.decode.generate_batch` (turn k of a batch together, each turn's prompt prefilled whole, the batch shrinking
as rows finish) against `hstap.data.continuous.ContinuousEngine` (KV rows kept across turns, finished rows refilled),
same prompts, same greedy settings, in one run.

    python benchmarks/bench_generate.py --shape smollm2 --convs 1024 --turns 3 --new-tokens 256 --rows 512   # H200
    python benchmarks/bench_generate.py --target DIR --convs 256 ...     # a real target: its weights and tokenizer
    python benchmarks/bench_generate.py --tiny                            # CPU smoke run (numbers mean nothing)

A random target (--shape) rarely emits a stop token, so every answer runs to --new-tokens: the worst case for the
lockstep batches' shrinking and the common case of a small chat model's greedy answers. Turn k+1's user message is
a fixed number of random tokens appended after turn k's answer (no tokenizer needed). Reported per engine: generated
tokens, seconds, generated tokens/s, prefilled tokens (what re-prefilling costs the lockstep path), and the fraction
of answers equal token for token to the other engine's (bf16 batching can flip near-ties; fp32 on CPU gives 1.0).
Ends with one JSON line; the lockstep path is the same-run baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hstap.data.continuous import ContinuousEngine, Dialogue, Turn  # noqa: E402
from hstap.data.decode import generate_batch  # noqa: E402

SHAPES = {"smollm2": dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                          vocab_size=49152),
          "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512)}


def load(args):
    from hstap.artifacts.model_dir import load_target
    from hstap.demo.toy import build_random_target

    path = args.target
    if path is None:
        path = Path("/tmp/hstap-bench-generate") / args.shape
        if not (path / "config.json").exists():
            build_random_target(path, **SHAPES[args.shape])
    target, _ = load_target(str(path), device=args.device, dtype=args.dtype)
    return target


class Conv(Dialogue):
    """Turn 0's prompt, then per turn the answer plus `user` tokens (a fixed user message)."""

    def __init__(self, prompt: list[int], user: list[int], turns: int, new: int):
        self.ids, self.user, self.turns, self.new, self.k, self.outs = list(prompt), user, turns, new, 0, []

    def first(self) -> Turn:
        return Turn(list(self.ids), self.new)

    def answered(self, new_ids, finish):
        self.outs.append(list(new_ids))
        self.k += 1
        if self.k == self.turns:
            return None
        self.ids = self.ids + list(new_ids) + self.user
        return Turn(list(self.ids), self.new)


def lockstep(target, prompts, user, turns, new, batch, stops):
    outs = [[] for _ in prompts]
    ids = [list(p) for p in prompts]
    prefilled = 0
    for lo in range(0, len(prompts), batch):
        idx = list(range(lo, min(lo + batch, len(prompts))))
        for _ in range(turns):
            res = generate_batch(target, [ids[i] for i in idx], new, stops)
            prefilled += sum(len(ids[i]) for i in idx)
            for i, (o, _) in zip(idx, res):
                outs[i].append(o)
                ids[i] = ids[i] + o + user
    return outs, prefilled


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--convs", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=512, help="continuous engine: KV rows")
    ap.add_argument("--batch", type=int, default=512, help="lockstep: conversations per batch")
    ap.add_argument("--prefill-tokens", type=int, default=65536)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--skip-lockstep", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    if args.tiny:
        args.shape, args.convs, args.turns, args.new_tokens, args.rows, args.batch = "tiny", 6, 2, 8, 4, 4
        args.prompt_tokens, args.user_tokens, args.device, args.dtype = 12, 5, "cpu", "fp32"
    target = load(args)
    V = target.vocab_size
    g = torch.Generator().manual_seed(0)
    stops = [V - 1]  # a token a random model samples about never: answers run to --new-tokens
    prompts = [torch.randint(3, V - 1, (args.prompt_tokens + (i * 37) % args.prompt_tokens,), generator=g).tolist()
               for i in range(args.convs)]
    user = torch.randint(3, V - 1, (args.user_tokens,), generator=g).tolist()
    max_len = 2 * args.prompt_tokens + args.turns * (args.new_tokens + args.user_tokens) + 8
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    res = {"device": str(target.device), "dtype": str(target.dtype), "shape": args.shape if not args.target else
           args.target, "convs": args.convs, "turns": args.turns, "new_tokens": args.new_tokens}

    # warm-up (kernels, allocator, the CUDA graph of every attention span the run reaches) on the same engine, then the
    # timed run: the graphs are captured once, outside the timed region
    eng = ContinuousEngine(target, stops, rows=args.rows, max_len=max_len, prefill_tokens=args.prefill_tokens)
    list(eng.run([Conv(p, user, 1, 4) for p in prompts[:8]]))
    for span in range(eng.quantum, max_len + 1, eng.quantum):
        eng.steps(torch.zeros(args.rows, 1, dtype=torch.long), torch.full((args.rows, 1), max_len), span)
    eng.stats = dict.fromkeys(eng.stats, 0)
    convs = [Conv(p, user, args.turns, args.new_tokens) for p in prompts]
    sync()
    t0 = time.perf_counter()
    for _ in eng.run(convs):
        pass
    sync()
    dt = time.perf_counter() - t0
    gen = sum(len(o) for c in convs for o in c.outs)
    res["continuous"] = {"seconds": round(dt, 2), "generated": gen, "tok_s": round(gen / dt, 1), **eng.stats}
    print(f"continuous: {gen:,} tokens in {dt:.1f} s = {gen / dt:,.0f} tok/s; {eng.stats}", flush=True)
    if not args.skip_lockstep:
        generate_batch(target, prompts[:8], 4, stops)
        sync()
        t0 = time.perf_counter()
        outs, prefilled = lockstep(target, prompts, user, args.turns, args.new_tokens, args.batch, stops)
        sync()
        dt2 = time.perf_counter() - t0
        gen2 = sum(len(o) for c in outs for o in c)
        same = sum(a == b for c, oc in zip(convs, outs) for a, b in zip(c.outs, oc)) / max(1, len(outs) * args.turns)
        res["lockstep"] = {"seconds": round(dt2, 2), "generated": gen2, "tok_s": round(gen2 / dt2, 1),
                           "prefilled_tokens": prefilled}
        res["equal_answers"] = round(same, 4)
        res["speedup"] = round(dt2 / dt, 3)
        print(f"lockstep: {gen2:,} tokens in {dt2:.1f} s = {gen2 / dt2:,.0f} tok/s; prefilled {prefilled:,}; "
              f"answers equal: {same:.3f}; continuous {dt2 / dt:.2f}x", flush=True)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
