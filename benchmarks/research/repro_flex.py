"""Which first shapes make compiling TTT's flex_attention fail, each in a fresh process.

    python benchmarks/research/repro_flex.py         # CUDA: every case, forward + backward, bf16 autocast (~1-2 min, H200)
    python benchmarks/research/repro_flex.py --tiny  # CPU: two cases through the same harness (eager flex, forward only)

The recorded failure: a run resumed after SIGKILL died compiling flex_attention (inductor NoValidChoicesError, query
(7, 4, 79, 16)). Every case runs the real code path in a new interpreter with its own inductor cache (one case shares a
cache on purpose): `hstap.train.ttt.TTTModel(attn="flex")` on a random drafter, batches (B, T) in the given order, 2 TTT
steps, forward + backward. Knobs: head_dim, query heads per kv head (G), bf16 autocast or fp32, the flex region's
`dynamic` (None = dynamo's default, True, or `maybe_mark_dynamic` on the batch and length dims), and
`hstap.models.drafter.FLEX_KERNEL_OPTIONS` as shipped (the fix: the main kernel always) or {} (torch's default choice).

`predicted` is the cause under test, computed here without a GPU: inductor lowers a call whose batch (and head count)
is static and whose query is shorter than 128 to its flex-decoding kernel with BLOCK_M = next_pow2(T * G), and drops
every config when BLOCK_M exceeds the BlockMask's 128-row query block. dynamic=None compiles the first batch static and
keeps the batch dim static until a batch of another size came; a batch of one is always static. When a compile fails,
TTTModel recomputes the batch with SDPA (the guarded fallback): `fallback` says whether that worked.

Prints a table, then one JSON line {"cases": [...], "predicted_all": bool, "fix_ok": bool (head_dim >= 16),
"narrow_head_fix": {case: status} (head_dim 8: decides whether train's up-front SDPA rule for head_dim < 16 is
needed), "fallback_ok": bool}. With --out-dir DIR, every case's log goes to DIR/repro_flex_logs.txt.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESUMED = [(7, 79)]  # the recorded failure's first batch: what a resumed run saw first
UNINTERRUPTED = [(4, 160), (7, 79)]  # a long batch first, then (7, 79) with another batch size
SAME_B = [(7, 160), (7, 79)]  # a long batch first, but of the same batch size
ONE = [(1, 79)]
MIX = [(4, 160), (7, 79), (1, 100), (3, 40), (7, 79)]


def cases(tiny: bool) -> list[dict]:
    base = {"hd": 16, "nh": 4, "G": 2, "dtype": "bf16", "dynamic": None, "force": False, "batches": RESUMED}
    if tiny:
        return [dict(base, name="tiny-resumed", dtype="fp32", device="cpu"),
                dict(base, name="tiny-fix", dtype="fp32", device="cpu", force=True, batches=MIX)]
    c = [
        dict(base, name="resumed-first"),  # (a) the recorded failure
        dict(base, name="uninterrupted-order", batches=UNINTERRUPTED),
        dict(base, name="same-B-after-long", batches=SAME_B),  # (a) it is the static batch, not the static length
        dict(base, name="dynamic-True", dynamic=True),
        dict(base, name="mark-dynamic", dynamic="mark"),
        dict(base, name="dynamic-True-B1", dynamic=True, batches=ONE),  # dynamic shapes alone do not fix it
        dict(base, name="fp32-no-autocast", dtype="fp32"),  # (b) not bf16 autocast
        dict(base, name="G1-no-gqa", G=1),
        dict(base, name="hd8", hd=8),
        dict(base, name="hd32", hd=32),
        dict(base, name="hd64", hd=64),
        dict(base, name="warm-cache-resumed", cache="warm"),  # (c) a cache written by an 'uninterrupted' process
        dict(base, name="FIX-resumed", force=True),
        dict(base, name="FIX-B1-first", force=True, batches=ONE + RESUMED),
        dict(base, name="FIX-mix", force=True, batches=MIX),
        dict(base, name="FIX-dynamic-True-mix", force=True, dynamic=True, batches=MIX),
        dict(base, name="FIX-fp32", force=True, dtype="fp32"),
        dict(base, name="FIX-hd8", force=True, hd=8),
        dict(base, name="FIX-hd32", force=True, hd=32),
        dict(base, name="FIX-hd64-G4", force=True, hd=64, nh=8, G=4),
    ]
    return [dict(x, device="cuda") for x in c]


def predicted(case: dict) -> str:
    """The outcome the decode-kernel cause predicts (see the module docstring)."""
    if case["device"] == "cpu":
        return "ok"  # eager flex_attention: nothing is lowered by inductor
    if case["hd"] < 16:
        return "?"  # flex's Triton kernels may refuse a head this narrow for reasons of their own (tl.dot K >= 16)
    if case["force"]:
        return "ok"
    G = case["G"]
    b_dynamic, seen = case["dynamic"] in (True, "mark"), None
    for B, T in case["batches"]:
        if case["dynamic"] is None and seen is not None and B != seen:
            b_dynamic = True
        seen = B if seen is None else seen
        static_b = not b_dynamic or B == 1
        block_m = 1 << max(4, (T * G - 1).bit_length())  # max(16, next_pow2(T * G))
        if static_b and T < 128 and G & (G - 1) == 0 and block_m > 128:
            return f"NoValidChoices@{B}x{T}"
    return "ok"


# ---------------------------------------------------------------------------------------------------------------------
# One case, in its own process


def run_case(case: dict) -> dict:
    import torch

    import hstap.models.drafter as dr
    from hstap.models.drafter import DrafterConfig, Eagle3Drafter
    from hstap.train.ttt import TTTModel, step_rows, target_distribution

    if not case["force"]:
        dr.FLEX_KERNEL_OPTIONS = {}  # torch's own kernel choice (before the fix)
    dr.FLEX_DYNAMIC = True if case["dynamic"] is True else None
    dev = torch.device(case["device"])
    cuda = dev.type == "cuda"
    if case["dynamic"] == "mark":
        region = dr._flex(True)  # the shipped region; marks go on its inputs, outside the compiled code

        def marked(q, k, v, **kw):
            for t in (q, k, v):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 2)
            return region(q, k, v, **kw)
        dr._FLEX[True] = marked
    nh, G, hd, H, V, Vd, Ht = case["nh"], case["G"], case["hd"], 64, 96, 48, 32
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=nh, num_key_value_heads=nh // G, head_dim=hd,
                        intermediate_size=96, vocab_size=V, draft_vocab_size=Vd, target_hidden_size=Ht, num_aux=1)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg).to(dev)
    hot = torch.randperm(V)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    d.set_vocab_map((hot - torch.arange(Vd)).to(dev), t2d.to(dev))
    W = torch.randn(V, Ht, device=dev)
    K = 2
    models = {a: TTTModel(d, ttt=K, attn=a) for a in ("flex", "sdpa")}
    out = {"name": case["name"], "status": "ok", "fallback": None, "at": None, "max_rel_vs_sdpa": 0.0}
    bf16 = case["dtype"] == "bf16" and cuda
    for i, (B, T) in enumerate(case["batches"]):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, V, (B, T), generator=g).to(dev)
        lm = torch.ones(B, T, dtype=torch.long, device=dev)
        L = torch.full((B,), T, device=dev)
        feats = torch.randn(B, T, 1, Ht, generator=g).to(dev)
        final = torch.randn(B, T, Ht, generator=g).to(dev)
        tb = target_distribution(final, lm, L, W, hot.to(dev), t2d.to(dev))
        denom = torch.tensor([float(step_rows(tb, T, k)[0].numel()) for k in range(K)], device=dev)
        loss = {}
        for a, m in models.items():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                if cuda:
                    val, _ = m(ids, feats, tb, denom)
                else:  # eager flex on CPU: forward only
                    with torch.no_grad():
                        val, _ = m(ids, feats, tb, denom)
            if cuda:
                val.backward()
                torch.cuda.synchronize()
            loss[a] = float(val)
        m = models["flex"]
        if m.attn_fallback and out["status"] == "ok":
            msg = m.attn_fallback
            out.update(status=("NoValidChoices" if "NoValidChoicesError" in msg else "compile error"), at=f"{B}x{T}",
                       error=msg[:400], fallback="ok" if loss["flex"] == loss["flex"] else "nan")
        elif out["status"] == "ok":
            out["max_rel_vs_sdpa"] = max(out["max_rel_vs_sdpa"], abs(loss["flex"] - loss["sdpa"]) / abs(loss["sdpa"]))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The driver


def _spawn(case: dict, cache: Path, log: list, timeout: float) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                           env=env, timeout=timeout, cwd=REPO)
        out, text, code = p.stdout, p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, text, code = "", f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s", -1
    log.append(f"===== {case['name']} (exit {code}, {time.time() - t0:.1f} s)\n{text[-6000:]}\n")
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")] if code == 0 else []
    if not lines:
        tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return {"name": case["name"], "status": "crashed", "error": tail[0][:300]}
    return {**json.loads(lines[-1][7:]), "seconds": round(time.time() - t0, 1)}


def _one(case: dict, root: Path, log: list, timeout: float) -> dict:
    cache = root / case["name"]
    if case.get("cache") == "warm":  # an 'uninterrupted' process fills the cache, the 'resumed' one reuses it
        warm = _spawn({**case, "name": case["name"] + "-warmup", "batches": UNINTERRUPTED}, cache, log, timeout)
        res = _spawn(case, cache, log, timeout)
        res["warmup"] = warm["status"]
        return res
    return _spawn(case, cache, log, timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU: two cases, eager flex, forward only (a harness check)")
    ap.add_argument("--jobs", type=int, default=min(10, os.cpu_count() or 1), help="cases run at once")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per case process")
    ap.add_argument("--out-dir", default=None, help="write every case's log to OUT_DIR/repro_flex_logs.txt")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_case(json.loads(a.case))), flush=True)
        return 0
    t0 = time.time()
    todo, log = cases(a.tiny), []
    with tempfile.TemporaryDirectory(prefix="repro_flex_") as tmp, cf.ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(lambda c: _one(c, Path(tmp), log, a.timeout), todo))
    for c, r in zip(todo, results):
        r["predicted"] = predicted(c)
        r["matches"] = None if r["predicted"] == "?" else (r["status"] == "ok") == (r["predicted"] == "ok") and (
            r["predicted"] == "ok" or r.get("at") == r["predicted"].split("@")[1])
    if a.out_dir:
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.out_dir) / "repro_flex_logs.txt").write_text("".join(log))
    print(f"{'case':24s} {'hd':>3s} {'G':>2s} {'dtype':5s} {'dynamic':7s} {'kernel':6s} {'batches':30s} "
          f"{'result':16s} {'at':7s} {'fallback':8s} {'predicted':18s} match")
    for c, r in zip(todo, results):
        print(f"{c['name']:24s} {c['hd']:3d} {c['G']:2d} {c['dtype']:5s} {str(c['dynamic']):7s} "
              f"{'main' if c['force'] else 'auto':6s} {' '.join(f'{b}x{t}' for b, t in c['batches']):30s} "
              f"{r['status']:16s} {str(r.get('at') or ''):7s} {str(r.get('fallback') or ''):8s} "
              f"{r['predicted']:18s} {({True: 'yes', False: 'NO', None: '-'})[r['matches']]}")
    fix = [r for c, r in zip(todo, results) if c["force"] and c["hd"] >= 16]
    summary = {"bench": "repro_flex", "device": "cpu" if a.tiny else "cuda", "seconds": round(time.time() - t0, 1),
               "predicted_all": all(r["matches"] is not False for r in results),
               "fix_ok": all(r["status"] == "ok" for r in fix),
               "narrow_head_fix": {r["name"]: r["status"] for c, r in zip(todo, results) if c["force"] and c["hd"] < 16},
               "fallback_ok": all(r.get("fallback") in (None, "ok") for r in results),
               "cases": [{k: r.get(k) for k in ("name", "status", "at", "fallback", "predicted", "max_rel_vs_sdpa",
                                                "seconds", "error", "warmup") if r.get(k) is not None}
                         for r in results]}
    try:
        import torch
        summary["torch"] = torch.__version__
    except ImportError:
        pass
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
