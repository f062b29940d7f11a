"""Few-row products and selections on the GPU, by row count: what a verify of R tree nodes (or a draft level of R
nodes) pays per kernel on a small target, and where `fuse_rows` (hstap.models.lean_target.linear) should stop.

    python benchmarks/bench_rows.py --target DIR          # the target's own matrix shapes; CUDA only; ~3 min

Products x (R, K) @ w (N, K)^T in fp32 for the target's matrices (fused q/k/v, o, fused gate/up, down, lm_head):
    cublas   F.linear (the baseline: what a GEMM library call costs, captured in a CUDA graph)
    bsum     (x[:, None, :] * w).sum(-1) under torch.compile with gpt-fast's inductor settings (coordinate descent):
             lean_target.linear's broadcast sum, which inductor emits as one reduction
    tsum     (x[:, :, None] * w.t()).sum(-2), compiled the same way: the form inductor itself gives a one-row mm
Selections over (f, V) fp32 draft logits, V = the target's vocabulary, the log-probs of the top k: log_softmax +
torch.topk (the baseline) against device_tree.top_k in one stage (k max-with-index passes over the row, after
log_softmax) and in two (over blocks of ids, then over the blocks' best, minus logsumexp: what the device tree
runs), all compiled the same way.
Each op is captured REP times back to back in one CUDA graph (the shape a decoding step has: dependent kernels on one
stream); the figure is the graph's replay time / REP, median of 5 timed batches after warm-up. Every shape compiles
once (~3 s each with coordinate descent): the defaults take ~3 minutes. Prints a table, then one JSON line (also
when stopped by SIGTERM, e.g. by `timeout`: the rows measured so far, marked "stopped").
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hstap.speculative.device_tree import top_k  # noqa: E402
from hstap.speculative.fast import INDUCTOR_CDT  # noqa: E402

REP = 20


def graph_us(fn, args) -> float:
    """Replay time per call (us) of REP calls of fn(*args) captured in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REP):
            fn(*args)
    for _ in range(10):
        g.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (20 * REP))
    return statistics.median(times)


def bsum(x, w):
    return (x.unsqueeze(-2) * w).sum(-1)  # (R, N, K) summed over K, the last dimension


def tsum(x, w):
    return (x.unsqueeze(-1) * w.t()).sum(-2)  # (R, K, N) summed over K: inductor's own one-row decomposition of mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="HF model directory (its config's shapes are used)")
    ap.add_argument("--rows", default="1,2,4,6,8,12,16,20,24,32")
    ap.add_argument("--topk-rows", default="1,2,3,4,8")
    ap.add_argument("--matrices", default="qkv,o,gate_up,down,lm_head")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rows.py: needs CUDA")
    cfg = json.loads((Path(a.target) / "config.json").read_text())
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or H // nh
    shapes = {"qkv": ((nh + 2 * nkv) * hd, H), "o": (H, nh * hd), "gate_up": (2 * I, H), "down": (H, I),
              "lm_head": (V, H)}
    dev = torch.device("cuda")
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 1000  # one compilation per shape, on purpose
    torch._dynamo.config.accumulated_recompile_limit = 10000
    comp = torch.compile(bsum, options=INDUCTOR_CDT, dynamic=False)
    tcomp = torch.compile(tsum, options=INDUCTOR_CDT, dynamic=False)
    rows = [int(r) for r in a.rows.split(",")]
    res: dict = {"products": {}, "topk": {}}

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        measure(a, shapes, rows, res, comp, tcomp, V, dev)
    except KeyboardInterrupt as e:
        res["stopped"] = str(e)
    print(json.dumps({"bench": "rows", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "rep": REP, "shapes": {k: list(v) for k, v in shapes.items()}, **res}))


def measure(a, shapes: dict, rows: list[int], res: dict, comp, tcomp, V: int, dev) -> None:
    print(f"{'matrix':8} {'N x K':>11} " + " ".join(f"{'R=' + str(r):>17}" for r in rows) + "   (us: cublas/bsum/tsum)")
    for name in a.matrices.split(","):
        N, K = shapes[name]
        w = torch.randn(N, K, device=dev) / K ** 0.5
        res["products"][name] = {}
        cells = []
        for r in rows:
            x = torch.randn(r, K, device=dev)
            c = graph_us(F.linear, (x, w))
            b = graph_us(comp, (x, w))
            t = graph_us(tcomp, (x, w))
            err = max((fn(x, w) - F.linear(x, w)).abs().max().item() for fn in (comp, tcomp))
            res["products"][name][r] = {"cublas_us": round(c, 2), "bsum_us": round(b, 2), "tsum_us": round(t, 2),
                                        "max_abs_diff": err}
            cells.append(f"{c:5.1f}/{b:5.1f}/{t:5.1f}")
        print(f"{name:8} {f'{N}x{K}':>11} " + " ".join(f"{s:>17}" for s in cells), flush=True)
    tk = torch.compile(lambda x, k: torch.log_softmax(x, -1).topk(k, -1), options=INDUCTOR_CDT, dynamic=False)
    one = torch.compile(lambda x, k: top_k(torch.log_softmax(x, -1), k, chunk=0), options=INDUCTOR_CDT, dynamic=False)
    mk = torch.compile(lambda x, k: (lambda v, i: (v - torch.logsumexp(x, -1, keepdim=True), i))(*top_k(x, k)),
                       options=INDUCTOR_CDT, dynamic=False)
    print("selections over (f, V), log-probs of the top k: us, torch.topk / one-stage top_k / two-stage top_k")
    for f in [int(r) for r in a.topk_rows.split(",")]:
        x = torch.randn(f, V, device=dev) * 3
        k = max(f, 2)
        t, o, m = graph_us(tk, (x, k)), graph_us(one, (x, k)), graph_us(mk, (x, k))
        same = torch.equal(tk(x, k)[1], mk(x, k)[1])
        res["topk"][f"{f}x{k}"] = {"topk_us": round(t, 2), "one_stage_us": round(o, 2), "two_stage_us": round(m, 2),
                                   "same_ids": same}
        print(f"  f={f} k={k}: {t:6.2f} / {o:6.2f} / {m:6.2f}  same ids: {same}", flush=True)


if __name__ == "__main__":
    main()
