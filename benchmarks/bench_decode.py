"""Batch-1 decoding speed: the fast engine (hstap.speculative.fast: static KV cache, CUDA graphs) against the eager one
(hstap.speculative.drivers) in the same run, against the weight-bandwidth bound; and EAGLE-3 chain / tree and n-gram speedups
over target-only decoding on the fast engine, next to the latency models' predictions, for several chain lengths and
tree shapes, and for several engine variants side by side.

    python benchmarks/bench_decode.py --target ../shared/reference/target-tiny --drafter RUN \
        --data ../shared/reference/corpus/eval.jsonl.gz --budget-s 225                                 # H200
    python benchmarks/bench_decode.py --tiny                                                          # CPU, a minute

Targets: --target (a model directory, e.g. the reference target) and, unless --no-big, a Llama-3.1-8B-shaped target
with random bf16 weights built in memory on the GPU (no files; benchmarks/make_random_target.py's shape). --tiny: a
tiny random Llama in place of both, on the CPU. Bound: weight bytes (every parameter once, tied ones once) / the
device-to-device copy bandwidth measured in this run (bytes read + written). Decode tok/s counts the decode loop
only (tokens after the first / its wall time); warm-up runs (graph capture, compilation) are excluded and reported
as capture_s. Speedups: tokens/s including the prefill, over all prompts, against target-only on the same engine
variant (same FastDecoder).

Variants (VARIANTS; --variants for target-only decoding, --spec-variants for the speculative methods): `base` = the
engine's default path, `cdt` = gpt-fast's inductor settings (fast.INDUCTOR_CDT), `lean` = the lean draft step
(FastDecoder(lean=True)), `lean+cdt` both, `leant(+cdt)` also the lean target layers (target_layers="lean"),
`leanm+cdt` that with both lean paths attending as matrix products (attention="math"), `fused+cdt` that with the
products of up to 8 rows written as fused reductions (fuse_rows=8): fast.FUSED, `hstap eval --kernels fused`;
`fusedR+cdt` (R a number) is FUSED with fuse_rows=R (for trees of more than 8 nodes), `fusedR/M+cdt` also with
fuse_bytes=M MiB (the largest weight written as a reduction; benchmarks/bench_rows.py).
The first spec variant runs every --chains length and --trees shape; the others run target-only and the headline
chain (k = --k) for the comparison. Nothing is picked: every row is printed.

Speculative runs are lossless-exact by default: target and drafter in fp32 (--spec-dtype, the eval's convention;
TF32 stays off), every output compared token for token with target-only decoding; a mismatch is classified with
hstap.speculative.evaluate.check_lossless (a near-tie when both tokens are within --tie-tol of the target's top logit).
Latency models, per round from the measured costs: `model` = the naive tau / (1 + D c_draft / c_verify) (D drafter
forwards per round: a chain's k, a tree's depth; c_verify the verify forward of this method), `model+` =
hstap.speculative.latency.round_model, tau c_token / (D c_draft + c_verify + c_host), c_token the target-only per-token cost; the
latency_model_within_10pct check is on model+. Kernels per step: on CUDA the device kernels one run of the step
launches (torch.profiler over the step run outside its graph), on the CPU its top-level aten ops.

--budget-s: jobs run in priority order (headline speculative methods, the 8B target, the baseline variant, the shape
sweep, the reference target-only variants); a job whose estimated cost (compile included) would end past the budget
is skipped and listed. Prints a short table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_budget as SB  # noqa: E402

PROMPTS = ["How do I open a file in Python?", "Explain the Linux page cache.", "Write a function that reverses a list.",
           "What is the difference between a process and a thread?", "Summarise how HTTP caching works."]


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written (median of 10)."""
    n = (1 << 28) if dev.type == "cuda" else (1 << 24)  # 1 GiB of fp32 on the GPU, 64 MiB on the CPU
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y.copy_(x)
            b.record()
            torch.cuda.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            y.copy_(x)
            t = time.perf_counter() - t0
        if i >= 3:
            times.append(t)
    return 2 * x.numel() * x.element_size() / sorted(times)[len(times) // 2]


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def big_target(dev, dtype, tiny: bool = False):
    """Llama-3.1-8B-shaped, random weights (HF's init), built on the device (tiny: make_random_target's tiny shape)."""
    from make_random_target import LLAMA_8B, TINY
    from transformers import LlamaConfig, LlamaForCausalLM

    from hstap.models.target import Target

    torch.manual_seed(0)
    cfg = LlamaConfig(**(TINY if tiny else LLAMA_8B), tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return Target(model.eval().requires_grad_(False))


def tiny_target(tmp: Path):
    from hstap.artifacts.model_dir import load_target
    from hstap.demo.toy import build_random_target

    build_random_target(tmp, None, model_type="llama", num_layers=8, hidden_size=64, vocab_size=256)
    return load_target(str(tmp), device="cpu", dtype="fp32")[0], None


def random_drafter(target, seed: int = 0):
    from hstap.layers import default_aux_layers
    from hstap.models.drafter import DrafterConfig, Eagle3Drafter

    layers = default_aux_layers(target.num_layers)
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=min(target.vocab_size, 32000),
                                           num_aux=len(layers), aux_layers=layers)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    d.init_from_target(target.embed_tokens.weight.float().cpu(), target.lm_head.weight.float().cpu())
    return d.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def prompts_for(target, tok, data: str | None, n: int) -> list[list[int]]:
    if data:
        from hstap.data.prompts import load_prompts

        return [p for _, p in load_prompts(data, tok, n)]
    if tok is not None and getattr(tok, "chat_template", None):
        return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for t in (PROMPTS * n)[:n]]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, target.vocab_size, (24,), generator=g).tolist() for _ in range(n)]


VARIANTS = {"base": {}, "cdt": {"inductor": "cdt"}, "lean": {"lean": True},
            "lean+cdt": {"inductor": "cdt", "lean": True},
            "leant": {"lean": True, "target_layers": "lean"},
            "leant+cdt": {"inductor": "cdt", "lean": True, "target_layers": "lean"},
            "leanm+cdt": {"inductor": "cdt", "lean": True, "target_layers": "lean", "attention": "math"},
            "fused+cdt": {"fused": True}}


def variant_kw(name: str) -> dict:
    from hstap.speculative.fast import FUSED, INDUCTOR_CDT

    rows, _, mb = name.removeprefix("fused").removesuffix("+cdt").partition("/")
    if name.startswith("fused") and name.endswith("+cdt") and rows.isdigit() and (mb.isdigit() or not mb):
        # fusedR[/MB]+cdt: FUSED with fuse_rows R (and fuse_bytes MB MiB)
        return {**FUSED, "fuse_rows": int(rows), **({"fuse_bytes": int(mb) << 20} if mb else {})}
    if name not in VARIANTS:
        raise SystemExit(f"bench_decode.py: --variants: unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    kw = dict(VARIANTS[name])
    if kw.pop("fused", False):
        kw = dict(FUSED)  # what `hstap eval --kernels fused` runs
    if kw.get("inductor") == "cdt":
        kw["inductor"] = INDUCTOR_CDT
    return kw


class Budget:
    """Jobs in priority order; a job whose estimate (the longest job of its kind so far, at least the given default)
    would end past the budget is skipped, and listed."""

    def __init__(self, seconds: float | None, estimates: dict):
        self.t0, self.seconds, self.skipped, self.est = time.perf_counter(), seconds, [], dict(estimates)

    def allows(self, name: str, kind: str) -> bool:
        spent = time.perf_counter() - self.t0
        if self.seconds and spent + self.est[kind] > self.seconds:
            if name in self.skipped:
                return False
            self.skipped.append(name)
            print(f"bench_decode: skipped {name} (estimated {self.est[kind]:.0f} s, {spent:.0f} s of "
                  f"{self.seconds:.0f} s spent)", file=sys.stderr)
            return False
        self.started = time.perf_counter()
        return True

    def done(self, kind: str) -> None:
        self.est[kind] = max(self.est[kind], time.perf_counter() - self.started)


def count_kernels(step, cuda: bool, into: dict | None = None, role: str = "") -> int | None:
    """The step's kernel count; with `into`, also its summed kernel time (`{role}_kernel_us`, GPU time of one run
    outside the graph: the part of a replay that is not launch gaps) and its 12 costliest kernels."""
    try:
        n = step.count_kernels(cuda)
        if into is not None and step.kernel_table:
            into[f"{role}_kernel_us"] = sum(us for _, _, us in step.kernel_table)
            into[f"{role}_top_kernels"] = [[name[:90], c, round(us, 1)] for name, c, us in step.kernel_table[:12]]
        return n
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run (no CUPTI) must not cost the run
        print(f"bench_decode: kernel count failed ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def decode_tok_s(fn, prompt, n: int) -> tuple[float, dict]:
    """Decode-loop tokens/s of a run after a warm-up one (whose one-time costs are returned as capture_s)."""
    _, warm = fn(prompt, min(n, 16))  # warm-up: capture, compilation
    out, st = fn(prompt, n)
    return (len(out) - 1) / (st["total_s"] - st["prefill_s"]), {**st, "capture_s": warm.get("capture_s", 0.0)}


def target_only(name: str, target, args, bw: float, variant: str, eager: bool) -> dict:
    """Target-only decoding on the fast engine: tok/s, against the bound, and where a step's time goes (`step`:
    step_budget.budget); with eager, the eager engine's rate and whether its tokens are the fast engine's."""
    from hstap.speculative.drivers import target_generate
    from hstap.speculative.fast import FastDecoder

    prompt = [1] + list(range(10, 10 + args.prompt_len - 1))
    wb = weight_bytes(target.model)
    fd = FastDecoder(target, max_len=args.prompt_len + args.new_tokens + 8, compile=False if args.no_compile else None,
                     **variant_kw(variant))
    fast, st = decode_tok_s(lambda p, m: fd.target_generate(p, m), prompt, args.new_tokens)
    prof: dict = {}
    step = next(s for k, s in fd.steps.items() if k[0] == "decode")
    kernels = count_kernels(step, fd.dev.type == "cuda", prof, "decode")
    slow, same = None, None
    if eager:
        slow = decode_tok_s(lambda p, m: target_generate(target, p, m), prompt, args.eager_tokens)[0]
        ref, mine = target_generate(target, prompt, args.eager_tokens)[0], fd.target_generate(prompt,
                                                                                              args.eager_tokens)[0]
        same = next((i for i, (x, y) in enumerate(zip(ref, mine)) if x != y), len(ref))  # tokens equal from the start
    bound = bw / wb
    n = st["verify_forwards"] or 1
    budget = SB.budget(SB.op_table(step, fd.dev.type == "cuda"), SB.read_bytes(target.model, 1, SB.cache_tensors(fd)),
                       bw, 1e3 * st["decode_s"] / n, 1e3 * st["host_s"] / n, args.peak_bw)
    peak = {"datasheet_bound_tok_s": args.peak_bw / wb, "fast_of_datasheet_bound": fast * wb / args.peak_bw} \
        if args.peak_bw else {}  # the goal's convention: every parameter once (the embedding table too)
    return {"target": name, "variant": variant, "weight_gb": wb / 1e9, "bound_tok_s": bound, "fast_tok_s": fast,
            "eager_tok_s": slow, "fast_of_bound": fast / bound, **peak,
            "speedup_vs_eager": fast / slow if slow else None,
            "graphs": st["graphs"], "compiled": st["compiled"], "capture_s": st["capture_s"],
            "ms_per_token": 1e3 / fast, "kernels_per_token": kernels, "eager_equal_tokens": same,
            "eager_tokens": args.eager_tokens if eager else None, "step": budget, **prof}


def parse_trees(text: str) -> list[tuple[int, int, int]]:
    try:
        return [tuple(int(x) for x in t.split("x")) for t in text.split(",") if t] if text else []
    except ValueError:
        raise SystemExit(f"bench_decode.py: --trees: expected TOPKxDEPTHxTOKENS,..., got {text!r}") from None


def spec_methods(fd, args, full: bool, first: bool) -> dict:
    """name -> (fn(prompt, max_new), depth D or None) in priority order: target, the headline chain (k = --k) and,
    for the first variant, the headline tree (the first --trees shape) and n-gram; with full, then the other chain
    lengths and tree shapes."""
    chains = [args.k] + ([c for c in args.chains if c != args.k] if full else [])
    trees = args.trees if full else args.trees[:1]
    m = {"target": (lambda p, n: fd.target_generate(p, n), None)}
    for i, k in enumerate(chains):
        m[f"chain{k}"] = (lambda p, n, k=k: fd.speculative_generate(p, n, "chain", k), k)
        if i == 0 and first:  # the first variant's headline: chain, tree, n-gram; the others: the chain alone
            for t in trees[:1]:
                m["tree" + "x".join(map(str, t))] = (lambda p, n, t=t: fd.speculative_generate(p, n, "tree", 1, *t),
                                                     t[1])
            m["ngram"] = (lambda p, n: fd.ngram_generate(p, n, args.k), None)
    for t in trees[1:] if first else []:
        m["tree" + "x".join(map(str, t))] = (lambda p, n, t=t: fd.speculative_generate(p, n, "tree", 1, *t), t[1])
    return m


def run_method(fd, fn, depth, prompts, n: int, bw: float = 0.0, peak_bw: float | None = None) -> tuple[list, dict]:
    from hstap.speculative.evaluate import aggregate
    from hstap.speculative.latency import latency_model

    before = set(fd.steps)
    _, warm = fn(prompts[0], min(n, 32))  # warm-up: capture, compilation
    per = [fn(p, n) for p in prompts]
    r = aggregate([s for _, s in per])
    r["depth"] = depth
    r.update(latency_model(r))
    r["capture_s"] = warm.get("capture_s", 0.0) + sum(s.get("capture_s", 0.0) for _, s in per)
    steps = {}
    for key in set(fd.steps) - before:  # this method's own steps (prefill buckets aside)
        if key[0] != "prefill":
            role = key[-1] if key[-1] == "draft" else "verify"
            r[f"{role}_kernels"] = count_kernels(fd.steps[key], fd.dev.type == "cuda", r, role)
            steps[role] = fd.steps[key]
    if depth and r.get("draft_kernels") is not None:
        r["kernels_per_draft_step"] = r["draft_kernels"] / depth
    r["round"] = round_budget(fd, steps, r, depth, bw, peak_bw)
    return [o for o, _ in per], r


def round_budget(fd, steps: dict, r: dict, depth: int | None, bw: float, peak_bw: float | None) -> dict | None:
    """Where a speculative round's time goes against its bound: the verify step (the target's weights, read once
    for all its tokens) and the draft step (`depth` drafter forwards and heads) each split by step_budget.budget,
    the host's share of the round beside them; of_bound = both steps' bounds over the whole round."""
    if "verify" not in steps or not r.get("verify_forwards"):
        return None
    cuda = fd.dev.type == "cuda"
    rows = steps["verify"].buf["tok"].numel() if "tok" in getattr(steps["verify"], "buf", {}) else 1
    out = {"verify": SB.budget(SB.op_table(steps["verify"], cuda),
                               SB.read_bytes(fd.target.model, rows, SB.cache_tensors(fd)), bw,
                               r["verify_ms_per_round"], 0.0, peak_bw),
           "host_ms": r.get("host_ms_per_round", 0.0)}
    if "draft" in steps and depth:
        d = fd.drafter
        nbytes = SB.draft_round_bytes(SB.read_bytes(d, 1, SB.cache_tensors(fd, True)),
                                      d.fc.weight.numel() * d.fc.weight.element_size(), depth)
        out["draft"] = SB.budget(SB.op_table(steps["draft"], cuda), nbytes, bw, r["draft_ms_per_round"], 0.0, peak_bw)
    ms = out["verify"]["ms"] + out.get("draft", {}).get("ms", 0.0) + out["host_ms"]
    for key in ("bound_ms", "bound_ms_datasheet"):
        if key in out["verify"]:
            out[key] = out["verify"][key] + out.get("draft", {}).get(key, 0.0)
    out.update(ms=ms, of_bound=out["bound_ms"] / ms if ms else 0.0)
    if "bound_ms_datasheet" in out:
        out["of_datasheet_bound"] = out["bound_ms_datasheet"] / ms if ms else 0.0
    return out


def speculative(ctx: dict, args, budget: Budget, variant: str, full: bool, store: dict, first: bool | None = None,
                kind: str = "spec") -> None:
    """The methods of one variant on the fast engine over ctx's prompts into store[variant] (budget permitting);
    ctx holds the target, drafter, prompts, the copy bandwidth and, per variant, its FastDecoder and outputs across
    calls. first: run the first variant's headline methods (default: whether this is --spec-variants' first)."""
    from hstap.speculative.evaluate import check_lossless
    from hstap.speculative.fast import FastDecoder
    from hstap.speculative.latency import round_model

    n, target, prompts = args.new_tokens, ctx["target"], ctx["prompts"]
    if variant not in ctx:
        longest = max(map(len, prompts)) + n + max([args.k] + args.chains + [t[2] for t in args.trees]) + 8
        ctx[variant] = (FastDecoder(target, ctx["drafter"], max_len=longest,
                                    compile=False if args.no_compile else None, **variant_kw(variant)), {})
    fd, outs = ctx[variant]
    res = store.setdefault(variant, {})
    first = variant == args.spec_variants[0] if first is None else first
    for name, (fn, depth) in spec_methods(fd, args, full, first).items():
        if name in res:
            continue
        job = f"{variant}/{name}" if kind == "spec" else f"{kind}:{variant}/{name}"
        if "target" not in res and name != "target" or not budget.allows(job, kind):
            continue  # no speedup without the variant's own target-only run
        outs[name], r = run_method(fd, fn, depth, prompts, n, ctx["bw"], args.peak_bw)
        budget.done(kind)
        base = r if name == "target" else res["target"]
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        if name != "target":
            r["predicted_refined"] = round_model(r, base)
            for key in ("predicted_speedup", "predicted_refined"):
                if r.get(key):
                    r[key.replace("predicted", "error")] = r[key] / r["speedup"] - 1
        bad = [] if name == "target" else check_lossless(target, list(enumerate(prompts)), outs["target"],
                                                         outs[name], name, ctx.get("tie_tol", args.tie_tol))
        r["lossless"] = not bad
        r["near_ties"] = sum(b["near_tie"] for b in bad)
        r["violations"] = len(bad) - r["near_ties"]
        res[name] = r  # complete rows only: a run stopped by SIGTERM prints what it finished
        print(f"bench_decode: {variant}/{name}: tau {r['tau']:.3f}, {r['tokens_per_s']:.1f} tok/s, "
              f"{r['speedup']:.2f}x ({time.perf_counter() - budget.t0:.0f} s)", file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="target model directory (the reference target)")
    p.add_argument("--drafter", help="drafter checkpoint (hstap drafter dir, RUN, or an SGLang/vLLM export)")
    p.add_argument("--random-drafter", action="store_true", help="a random drafter (smoke run: tau ~ 1)")
    p.add_argument("--data", help="conversations JSONL or prepared dir for the speculative prompts")
    p.add_argument("--no-big", action="store_true", help="skip the Llama-3.1-8B-shaped target")
    p.add_argument("--tiny", action="store_true", help="CPU: a tiny random Llama and a random drafter, a minute")
    p.add_argument("--no-compile", action="store_true", help="capture the steps uncompiled (default: torch.compile "
                   "each decoding step before capturing it, on CUDA)")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding only")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--eager-tokens", type=int, default=32, help="tokens of the eager target-only baseline")
    p.add_argument("--prompt-len", type=int, default=64, help="target-only prompt length")
    p.add_argument("--prompts", type=int, default=8, help="prompts for the speculative methods")
    p.add_argument("--k", type=int, default=5, help="the headline chain length")
    p.add_argument("--chains", default="3,4,5", help="chain lengths of the sweep (first spec variant)")
    p.add_argument("--trees", default="8x6x60,4x5x24,4x4x16,2x5x12",
                   help="tree shapes TOPKxDEPTHxTOKENS of the sweep; the first is the headline tree")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="target-only decoding dtype")
    p.add_argument("--spec-dtype", default="fp32", choices=["bf16", "fp32"],
                   help="dtype of the speculative runs (fp32: exact losslessness)")
    p.add_argument("--tie-tol", type=float, default=None, help="near-tie logit gap (unset: 1e-3 fp32, 0.5 bf16)")
    p.add_argument("--variants", default="base,cdt", help=f"reference target-only variants ({', '.join(VARIANTS)})")
    p.add_argument("--big-variants", default="base,cdt", help="8B-shape target-only variants (in this order)")
    p.add_argument("--spec-variants", default="lean+cdt,base", help="speculative variants; the first runs the sweep")
    p.add_argument("--big-spec", action="store_true", help="the 8B-shaped target's speculative loop too: target-only "
                   "and the headline chain with a random drafter (bf16), per round against the bound")
    p.add_argument("--big-spec-variants", default="cdt", help="variants of --big-spec (in this order)")
    p.add_argument("--big-prompts", type=int, default=2, help="random prompts (--prompt-len tokens) of --big-spec")
    p.add_argument("--peak-gb-s", type=float, default=None,
                   help="HBM bandwidth of the datasheet for the second bound (default: by device name, H200 4800)")
    p.add_argument("--budget-s", type=float, default=None, help="skip jobs that would end past this many seconds")
    p.add_argument("--est-spec-s", type=float, default=20.0, help="least budget estimate of a speculative method")
    p.add_argument("--est-target-s", type=float, default=15.0, help="least budget estimate of a reference variant")
    p.add_argument("--est-big-s", type=float, default=45.0, help="least budget estimate of one 8B variant")
    p.add_argument("--est-big-spec-s", type=float, default=90.0, help="least budget estimate of one --big-spec method")
    a = p.parse_args(argv)
    a.chains = [int(x) for x in a.chains.split(",") if x]
    a.trees = parse_trees(a.trees)
    a.variants, a.spec_variants = [v for v in a.variants.split(",") if v], [v for v in a.spec_variants.split(",") if v]
    a.big_variants = [v for v in a.big_variants.split(",") if v]
    a.big_spec_variants = [v for v in a.big_spec_variants.split(",") if v]
    for v in a.variants + a.spec_variants + a.big_variants + a.big_spec_variants:
        variant_kw(v)
    if a.tie_tol is None:
        a.tie_tol = 1e-3 if a.spec_dtype == "fp32" else 0.5
    return run(a)


def run(a) -> dict:
    budget = Budget(a.budget_s, {"spec": a.est_spec_s, "ref": a.est_target_s, "big": a.est_big_s,
                                 "bigspec": a.est_big_spec_s})
    dev = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    if a.tiny:
        torch.set_num_threads(1)  # tiny models are per-op-overhead bound: one thread is faster, and steadier
        a.new_tokens, a.prompts, a.prompt_len = min(a.new_tokens, 32), min(a.prompts, 2), 16
        a.no_big, a.big_variants = not a.big_spec, a.big_variants[:1]  # --big-spec: the tiny Llama stands in
        a.trees = [(3, 4, 12), (2, 4, 8)]
        a.chains = a.chains[:2]
        a.spec_dtype, a.tie_tol = "fp32", 1e-3
    bw = copy_bandwidth(dev)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    a.peak_bw = a.peak_gb_s * 1e9 if a.peak_gb_s else SB.datasheet_bw(name)
    out: dict = {"bench": "decode", "device": name, "datasheet_gb_s": a.peak_bw / 1e9 if a.peak_bw else None,
                 "torch": torch.__version__, "copy_gb_s": bw / 1e9, "new_tokens": a.new_tokens,
                 "compile": not a.no_compile and dev.type == "cuda", "spec_dtype": a.spec_dtype, "targets": [],
                 "speculative": {}, "spec_variants": a.spec_variants}
    if a.tiny:
        import tempfile

        path = tempfile.mkdtemp()
        tiny_target(Path(path))
    else:
        path = a.target
    signal.signal(signal.SIGTERM, _stop)  # a `timeout` around the run: print what was measured, marked "stopped"
    try:
        _jobs(a, out, budget, bw, dev, path)
    except Stopped as e:
        out["stopped"] = str(e)
        print(f"bench_decode: stopped ({e}): the results so far", file=sys.stderr)
    out["skipped"] = budget.skipped
    out["wall_s"] = time.perf_counter() - budget.t0
    out["checks"] = checks(out)
    _print(out)
    return out


class Stopped(Exception):
    """SIGTERM during the jobs."""


def _stop(signum, frame):
    raise Stopped(f"signal {signum}")


def _jobs(a, out: dict, budget: Budget, bw: float, dev: torch.device, path) -> None:
    """The measurements in priority order, into `out`."""
    from hstap.artifacts.model_dir import load_target
    from hstap.speculative.evaluate import load_any_drafter

    spec = []  # the speculative variants, in priority order
    if path and not a.no_spec and (a.drafter or a.random_drafter or a.tiny):
        starget, tok = load_target(path, device=dev, dtype=a.spec_dtype)
        drafter = load_any_drafter(a.drafter, starget)[0] if a.drafter else random_drafter(starget)
        ctx = {"target": starget, "drafter": drafter, "prompts": prompts_for(starget, tok, a.data, a.prompts),
               "bw": bw}
        spec = a.spec_variants
        for v in spec:  # headline methods of every variant first (the sweep of the first one comes later)
            speculative(ctx, a, budget, v, False, out["speculative"])
            if v == spec[0] and not a.no_big:
                big(a, bw, budget, out)  # the 8B check right after the headline
        speculative(ctx, a, budget, spec[0], True, out["speculative"])
        del starget, drafter, ctx
    elif not a.no_big:
        big(a, bw, budget, out)
    if path:
        target = load_target(path, device=dev, dtype=a.dtype)[0]
        for i, v in enumerate(a.variants):
            if budget.allows(f"reference/{v}", "ref"):
                out["targets"].append(target_only(Path(a.target).name if a.target else "tiny", target, a, bw, v,
                                                  eager=i == 0))
                budget.done("ref")
    if not any(t["target"] == big_name(a) for t in out["targets"]) and not a.no_big and not spec:
        big(a, bw, budget, out)


def big_name(a) -> str:
    return "tiny-llama-shape" if a.tiny else "llama-3.1-8b-shape"


def big(a, bw: float, budget: Budget, out: dict) -> None:
    """The Llama-3.1-8B-shaped target (bf16; --tiny: a tiny Llama in fp32 on the CPU), every --big-variants variant
    (the first also eagerly); with --big-spec, right after the first variant, target-only and the headline chain
    (k = --k) of every --big-spec-variants variant on it with a random drafter (tau ~ 1: the round's costs, not a
    speedup), their outputs checked against target-only decoding (bf16: near-ties classified)."""
    name = big_name(a)
    if any(t["target"] == name for t in out["targets"]):
        return
    dev, dtype = (torch.device("cpu"), torch.float32) if a.tiny else (torch.device("cuda"), torch.bfloat16)
    target = None
    for i, v in enumerate(a.big_variants):
        if i == 1:
            target = big_spec(a, bw, budget, out, target, dev, dtype)
        if not budget.allows(f"{name}/{v}", "big"):
            continue
        if target is None:
            empty_cache(dev)
            target = big_target(dev, dtype, a.tiny)
        out["targets"].append(target_only(name, target, a, bw, v, eager=i == 0))
        budget.done("big")
    if len(a.big_variants) < 2:
        target = big_spec(a, bw, budget, out, target, dev, dtype)
    del target
    empty_cache(dev)


def big_spec(a, bw: float, budget: Budget, out: dict, target, dev, dtype):
    """--big-spec's runs (see `big`) on `target` (built when None); returns the target."""
    if a.big_spec and budget.allows(f"{big_name(a)}/spec", "bigspec"):
        target = target if target is not None else big_target(dev, dtype, a.tiny)
        g = torch.Generator().manual_seed(1)
        ctx = {"target": target, "drafter": random_drafter(target), "bw": bw,
               "prompts": [torch.randint(3, target.vocab_size, (a.prompt_len,), generator=g).tolist()
                           for _ in range(a.big_prompts)], "tie_tol": 0.5 if dtype == torch.bfloat16 else 1e-3}
        for v in a.big_spec_variants:
            speculative(ctx, a, budget, v, False, out.setdefault("speculative_big", {}), first=False, kind="bigspec")
        del ctx
    return target


def empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def checks(out: dict) -> dict:
    """The goals (H200; meaningful with the reference target and its trained drafter), on the best target-only
    variant and on the first spec variant's headline rows (chain k=--k, the first tree)."""
    c: dict = {}
    big_rows = [t for t in out["targets"] if t["target"] == "llama-3.1-8b-shape"]
    for rows in (out.get("speculative_big") or {}).values():  # the goal: >= 75% of the datasheet's bound
        for name, r in rows.items():
            if name.startswith("chain") and (r.get("round") or {}).get("of_datasheet_bound") is not None:
                c[f"8b_spec_round_ge_75pct_of_datasheet_bound_read_bytes ({name})"] = \
                    r["round"]["of_datasheet_bound"] >= 0.75
    ref_rows = [t for t in out["targets"] if t["target"] not in ("llama-3.1-8b-shape", "tiny", "tiny-llama-shape")]
    if big_rows:
        best = max(big_rows, key=lambda t: t["fast_tok_s"])
        c[f"8b_fast_ge_180_tok_s ({best['variant']})"] = best["fast_tok_s"] >= 180
        c["8b_fast_ge_60pct_of_bound"] = best["fast_of_bound"] >= 0.6
        if best.get("fast_of_datasheet_bound") is not None:  # 299 tok/s on an H200: 224 tok/s
            c["8b_fast_ge_75pct_of_datasheet_bound"] = best["fast_of_datasheet_bound"] >= 0.75
    if ref_rows:
        c["reference_fast_ge_1500_tok_s"] = max(t["fast_tok_s"] for t in ref_rows) >= 1500
    variants = out.get("spec_variants") or []
    s = out["speculative"].get(variants[0]) if variants else None
    if s:
        chain = next((r for n, r in s.items() if n.startswith("chain")), None)
        tree = next((r for n, r in s.items() if n.startswith("tree")), None)
        ngram = s.get("ngram")
        if chain:
            c["chain_speedup_ge_1.5"] = chain["speedup"] >= 1.5
        if chain and tree:
            c["tree_ge_chain"] = tree["speedup"] >= chain["speedup"]
        if chain and tree and ngram:
            c["both_above_ngram"] = min(chain["speedup"], tree["speedup"]) > ngram["speedup"]
        rows = [r for n, r in s.items() if n != "target"]
        c["latency_model_within_10pct"] = all(abs(r.get("error_refined", 1.0)) <= 0.10 for r in rows)
        c["naive_formula_within_10pct"] = all(abs(r.get("error_speedup", 1.0)) <= 0.10 for r in rows)
    c["lossless"] = all(r["lossless"] for v in out["speculative"].values() for r in v.values())
    if out.get("speculative_big"):  # bf16: near-ties allowed, no other mismatch
        c["big_spec_no_violations"] = all(r["violations"] == 0 for v in out["speculative_big"].values()
                                          for r in v.values())
    return c


def _f(v, fmt: str, width: int) -> str:
    return format(v, fmt) if v is not None else "-".rjust(width)


def _print_spec(title: str, store: dict, err) -> None:
    print(f"{title}: model = tau/(1+D c_draft/c_verify), model+ = tau c_token/(D c_draft + c_verify + c_host); "
          f"kernels: per draft step (D per round) / per verify", file=err)
    print(f"{'variant':8s} {'method':12s} {'tau':>5s} {'tok/s':>8s} {'speedup':>7s} {'model':>6s} {'model+':>6s} "
          f"{'draft ms':>8s} {'ms/step':>7s} {'verify':>7s} {'host':>6s} {'k/step':>6s} {'k/ver':>5s} "
          f"{'cap s':>5s} lossless", file=err)
    for v, rows in store.items():
        for name, r in rows.items():
            ok = "exact" if r["lossless"] else f"{r['near_ties']} near-ties, {r['violations']} VIOLATIONS"
            print(f"{v:8s} {name:12s} {r['tau']:5.2f} {r['tokens_per_s']:8.1f} {r['speedup']:6.2f}x "
                  f"{_f(r.get('predicted_speedup'), '6.2f', 6)} {_f(r.get('predicted_refined'), '6.2f', 6)} "
                  f"{r.get('draft_ms_per_round', 0):8.3f} {_f(r.get('draft_ms_per_step'), '7.3f', 7)} "
                  f"{r.get('verify_ms_per_round', 0):7.3f} {r.get('host_ms_per_round', 0):6.3f} "
                  f"{_f(r.get('kernels_per_draft_step'), '6.1f', 6)} {_f(r.get('verify_kernels'), '5d', 5)} "
                  f"{r['capture_s']:5.1f} {ok}", file=err)


def _print_budgets(out: dict, err) -> None:
    """Where each step's time goes against the bound (step_budget): target-only steps, then speculative rounds."""
    print("where a step's time goes (ms): = bound (bytes read / copy bw) + gemm + other kernels + gaps + host, each "
          "over its floor", file=err)
    for t in out["targets"]:
        print(f"  {t['target'][:20]} {t['variant']}: {SB.line(t['step'])}", file=err)
    for title, store in (("", out["speculative"]), ("big shape: ", out.get("speculative_big") or {})):
        for v, rows in store.items():
            for name, r in rows.items():
                rb = r.get("round")
                if not rb or name == "target":
                    continue
                ds = f", {100 * rb['of_datasheet_bound']:.1f}% of the datasheet's" if "of_datasheet_bound" in rb else ""
                print(f"  {title}{v}/{name} round {rb['ms']:.3f} ms, bound {rb['bound_ms']:.3f} "
                      f"({100 * rb['of_bound']:.1f}%{ds}), host {rb['host_ms']:.3f}", file=err)
                for role in ("draft", "verify"):
                    if role in rb:
                        print(f"    {role}: {SB.line(rb[role])}", file=err)


def _print(out: dict) -> None:
    err = sys.stderr
    ds = f", datasheet {out['datasheet_gb_s']:.0f} GB/s" if out.get("datasheet_gb_s") else ""
    print(f"copy bandwidth {out['copy_gb_s']:.0f} GB/s on {out['device']}{ds}", file=err)
    print(f"{'target':20s} {'variant':8s} {'GB':>6s} {'bound':>8s} {'fast':>8s} {'ms/tok':>7s} {'eager':>7s} "
          f"{'of bound':>8s} {'kernels':>7s} {'capture s':>9s}", file=err)
    for t in out["targets"]:
        print(f"{t['target'][:20]:20s} {t['variant']:8s} {t['weight_gb']:6.2f} {t['bound_tok_s']:8.1f} "
              f"{t['fast_tok_s']:8.1f} {t['ms_per_token']:7.3f} {_f(t['eager_tok_s'], '7.1f', 7)} "
              f"{100 * t['fast_of_bound']:7.1f}% {_f(t['kernels_per_token'], '7d', 7)} {t['capture_s']:9.1f}", file=err)
    if any(out["speculative"].values()):
        _print_spec(f"speculative ({out['spec_dtype']})", out["speculative"], err)
    if any((out.get("speculative_big") or {}).values()):
        _print_spec("speculative, big shape (random drafter: costs, not speedups)", out["speculative_big"], err)
    _print_budgets(out, err)
    if out["skipped"]:
        print("skipped (budget): " + ", ".join(out["skipped"]), file=err)
    print(f"wall {out['wall_s']:.0f} s; checks: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}"
                                                           for k, v in out["checks"].items()), file=err)
    print(json.dumps(out, default=float))


if __name__ == "__main__":
    main()
