"""Speculative decoding benchmark: EAGLE-3 drafter vs a baseline drafter vs n-gram prompt lookup, chain and tree, all
against target-only decoding on the same prompts in the same process.

    python benchmarks/bench_eval.py --target MODEL_DIR --drafter RUN_EAGLE3 --baseline-drafter RUN_EAGLE1 \
        --data PREPARED_OR_JSONL --num-prompts 40 --max-new-tokens 256 --device cuda --dtype bf16
    python benchmarks/bench_eval.py --tiny      # CPU smoke run: random tiny target and random drafters, built here

Rows: target (plain decoding with a KV cache: the 1.00x reference), ngram (k = --k), eagle3-chain (k = --k),
eagle3-tree (--tree topk,depth,tokens), and baseline-chain / baseline-tree when --baseline-drafter is given (e.g. an
EAGLE-1-style final-state drafter from `hstap train --aux-layers final`). Each method runs one warm-up prompt first.
Greedy (temperature 0) by default: every output is checked against the target's (near-ties in low precision are
reported, not failed; see hstap/speculative/evaluate.py). tau = tokens from verify forwards / verify forwards; tokens/s includes
the prefill. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from hstap.speculative.drivers import ngram_generate, speculative_generate, target_generate
from hstap.data.prompts import load_prompts
from hstap.speculative.evaluate import check_lossless, eos_ids, read_sim_tau, run_method, sim_chain_tau


def build_tiny(root: Path) -> dict:
    """A random tiny Llama target with a chat tokenizer, a random EAGLE-3 drafter, a random final-state drafter and a
    JSONL of prompts, all written under root."""
    from hstap.artifacts.drafter_dir import save_drafter
    from hstap.layers import fc_slots
    from hstap.models.drafter import DrafterConfig, Eagle3Drafter
    from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts

    texts = sample_texts()
    tok = build_tokenizer(texts, vocab_size=400)
    model = build_random_target(root / "target", tok, num_layers=6, hidden_size=64)
    for name, layers in (("eagle3", [1, 2, 3]), ("baseline", [])):
        torch.manual_seed(0)
        cfg = DrafterConfig.from_target_config(model.config, draft_vocab_size=300, num_aux=fc_slots(layers),
                                               aux_layers=layers)
        d = Eagle3Drafter(cfg)
        hot = torch.arange(300) * 4 // 3  # any increasing subset of the vocabulary
        t2d = torch.zeros(400, dtype=torch.bool)
        t2d[hot] = True
        d.set_vocab_map(hot - torch.arange(300), t2d)
        d.init_from_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        save_drafter(root / name, d)
    lines = [t.splitlines()[i] for t in texts for i in range(5, 60, 7)]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": s}]}) + "\n"
                            for i, s in enumerate(x for x in lines if x.strip())))
    return {"target": root / "target", "drafter": root / "eagle3", "baseline_drafter": root / "baseline", "data": data}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", help="target model directory")
    ap.add_argument("--drafter", help="EAGLE-3 drafter directory or training RUN")
    ap.add_argument("--baseline-drafter", help="a second drafter to compare with (e.g. EAGLE-1-style final-state)")
    ap.add_argument("--data", help="prepared dataset directory or conversations JSONL")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--prompt-offset", type=int, default=0,
                    help="skip this many prompts first (to split the work over processes)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=5, help="chain length (and n-gram proposal length)")
    ap.add_argument("--tree", default="8,6,60", help="topk,depth,tokens of the tree runs")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=None,
                    help="comma list of methods to run besides target (default all): ngram, eagle3-chain,\n"
                         "eagle3-tree, baseline-chain, baseline-tree; lets several processes share the work")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on random tiny models built in a temp dir")
    args = ap.parse_args(argv)
    tmp = None
    if args.tiny:
        torch.set_num_threads(1)  # batch-1 decoding of a 64-wide model: extra threads only synchronise
        tmp = tempfile.TemporaryDirectory(prefix="hstap-bench-eval-")
        built = build_tiny(Path(tmp.name))
        args.target, args.drafter, args.baseline_drafter, args.data = (str(built[k]) for k in (
            "target", "drafter", "baseline_drafter", "data"))
        args.device, args.dtype, args.num_prompts, args.max_new_tokens, args.tree = "cpu", "fp32", 4, 32, "3,4,10"
    if not (args.target and args.drafter and args.data):
        ap.error("--target, --drafter and --data are required (or --tiny)")
    topk, depth, tokens = (int(x) for x in args.tree.split(","))

    from hstap.artifacts.model_dir import load_target
    from hstap.speculative.evaluate import load_any_drafter

    target, tok = load_target(args.target, device=args.device, dtype=args.dtype)
    dev = target.device
    drafters = {"eagle3": load_any_drafter(args.drafter, target)[0]}
    if args.baseline_drafter:
        drafters["baseline"] = load_any_drafter(args.baseline_drafter, target)[0]
    if args.prompt_offset < 0:
        ap.error("--prompt-offset: must be >= 0")
    prompts = load_prompts(args.data, tok, args.prompt_offset + args.num_prompts)[args.prompt_offset:]
    if not prompts:
        ap.error(f"--prompt-offset {args.prompt_offset}: {args.data} has no prompt past it")
    eos, T, n = eos_ids(tok, target), args.temperature, args.max_new_tokens
    methods = {"target": lambda p, g, m=n: target_generate(target, p, m, T, eos, g),
               "ngram": lambda p, g, m=n: ngram_generate(target, p, m, args.k, 3, T, eos, g)}
    for name, d in drafters.items():
        methods[f"{name}-chain"] = lambda p, g, m=n, d=d: speculative_generate(target, d, p, m, "chain", args.k,
                                                                               temperature=T, eos_ids=eos, generator=g)
        methods[f"{name}-tree"] = lambda p, g, m=n, d=d: speculative_generate(target, d, p, m, "tree", topk=topk,
                                                                              depth=depth, tokens=tokens, temperature=T,
                                                                              eos_ids=eos, generator=g)
    if args.methods:
        want = {m.strip() for m in args.methods.split(",") if m.strip()}
        unknown = want - set(methods)
        if unknown:
            ap.error(f"--methods: unknown {sorted(unknown)}; choose from {sorted(set(methods) - {'target'})}")
        methods = {k: v for k, v in methods.items() if k == "target" or k in want}
    sims = {}
    for name, path in (("eagle3", args.drafter), ("baseline", args.baseline_drafter)):
        rec = read_sim_tau(path) if path else None
        if rec is not None:
            sims[name] = {"step": rec.get("step"), "acc_cond": rec.get("acc_cond"),
                          "chain_tau": sim_chain_tau(rec, args.k)}
    t0 = time.perf_counter()
    outputs, results = {}, {}
    for name, fn in methods.items():
        fn(prompts[0][1], torch.Generator(device=dev).manual_seed(args.seed), min(n, 32))  # warm-up
        outputs[name], results[name] = run_method(fn, prompts, args.seed, dev)
        print(f"  {name}: done ({results[name]['total_s']:.1f} s)", file=sys.stderr)
    base = results["target"]["tokens_per_s"]
    mismatches = []
    for name, r in results.items():
        r["speedup"] = r["tokens_per_s"] / base if base > 0 else 0.0
        if T == 0 and name != "target":
            tol = 1e-3 if target.dtype == torch.float32 else 0.5
            mismatches += check_lossless(target, prompts, outputs["target"], outputs[name], name, tol)
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"\n{len(prompts)} prompts, <= {n} new tokens, T={T}, {str(target.dtype).replace('torch.', '')} on {hw}; "
          f"chain k={args.k}, tree topk={topk} depth={depth} tokens={tokens}")
    print(f"{'method':16s} {'tau':>6s} {'tok/s':>8s} {'speedup':>8s} {'draft s':>8s} {'verify s':>9s}  "
          "acceptance by position")
    for name, r in results.items():
        acc = " ".join(f"{a:.2f}" for a in r.get("per_position_acceptance", []))
        print(f"{name:16s} {r['tau']:6.3f} {r['tokens_per_s']:8.1f} {r['speedup']:7.2f}x "
              f"{r.get('draft_s', 0.0):8.2f} {r.get('verify_s', 0.0):9.2f}  {acc}")
    for name, sm in sims.items():
        r = results.get(f"{name}-chain")
        if r is not None and sm["chain_tau"] is not None:
            sm["measured_chain_tau"] = r["tau"]
            sm["sim_vs_measured"] = sm["chain_tau"] / r["tau"] - 1.0
            print(f"{name}: simulated chain-{args.k} tau {sm['chain_tau']:.3f} (training eval, step {sm['step']}) vs "
                  f"measured {r['tau']:.3f}: {100 * sm['sim_vs_measured']:+.1f}%")
    failed = [m for m in mismatches if not m["near_tie"]]
    for m in mismatches:
        print(f"{'near-tie' if m['near_tie'] else 'LOSSLESSNESS VIOLATION'}: {json.dumps(m)}", file=sys.stderr)
    print(json.dumps({"bench": "eval", "device": hw, "dtype": str(target.dtype).replace("torch.", ""),
                      "prompts": len(prompts), "max_new_tokens": n, "temperature": T, "k": args.k,
                      "tree": [topk, depth, tokens], "lossless": not failed if T == 0 else None,
                      "near_ties": sum(m["near_tie"] for m in mismatches), "wall_s": round(time.perf_counter() - t0, 2),
                      "results": {name: {key: r.get(key) for key in ("tau", "tokens_per_s", "speedup", "draft_s",
                                                                     "verify_s", "per_position_acceptance",
                                                                     "new_tokens", "verify_forwards")}
                                  for name, r in results.items()},
                      "simulated": sims}))
    if tmp is not None:
        tmp.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
