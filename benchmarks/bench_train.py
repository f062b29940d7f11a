"""Training throughput of one EAGLE-3 drafter step (TTT 7) on a Llama-3.1-8B-shaped drafter, random data, one GPU.

    python benchmarks/bench_train.py                 # H200: exact TTT mask (flex_attention) + causal-only baseline
    python benchmarks/bench_train.py --tiny          # CPU smoke test of the same code path (seconds)

Shapes: hidden 4096, 32/8 heads of 128, intermediate 14336, target vocab 128256, draft vocab 32000, 3 aux layers of
4096, sequences of 2048, --batch-tokens per step (default 16384 = 8 sequences), TTT 7. Data are random tensors made on
the device once (ids, loss mask all 1, aux and final states in bf16); the frozen target lm_head is a random bf16
[128256, 4096] whose draft-vocabulary rows are scaled x2, so that the target argmax lies in the draft vocabulary for
almost every position, as with real data (a purely random head would put it there for 25% of positions only and the
drafter lm_head would run on a quarter of the rows).

One step = exactly what `hstap train` does per micro-batch: target distribution in chunks under no_grad (bf16 head,
argmax over 128256, softmax over the 32000 hot columns), counted positions per TTT step, forward of the 7 unrolled steps
under bf16 autocast (fp32 master weights) with the fused chunked lm_head + soft cross-entropy, backward, gradient
clipping, fused AdamW. The step runs with the exact TTT mask (flex_attention, compiled) and then, as the in-run
baseline, with causal-only attention (each step attends causally to its own keys; SDPA/flash; no TTT diagonal).

FLOPs (hstap.ttt.ttt_flops, per step; N = real tokens): fc 4*N*3*4096*4096 + 6*7*N*P_mid (P_mid = q,k,v,o,gate,
up,down = 218.1M) + 6*sum_k counted_k*4096*32000 (drafter lm_head) + 12*32*128*sum_k sum_t (t+1+k) (attention, exact
mask; the baseline counts sum_t (t+1)) + 2*rows*4096*128256 (target head, forward only). MFU = FLOPs / time / peak
(--peak-tflops, 790 for an H200 in bf16). Warm-up steps (compilation) are excluded; the timed steps are synchronised.
The last line of stdout is one JSON object.

Several GPUs (weak scaling: --batch-tokens per rank), wrapped exactly as `hstap train` wraps its TTTModel:

    torchrun --nproc-per-node 2 benchmarks/bench_train.py --no-baseline --dist ddp     # hstap.dist.wrap_ddp
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --no-baseline --dist fsdp    # hstap.dist.apply_fsdp, bf16
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --tiny --dist ddp            # CPU, gloo

Every rank builds the same drafter and head (same seed) and its own random batch (seed 1 + rank: rank 0's is the
one-process batch); the counted positions are summed over ranks and the loss carries the world factor, as in
hstap.train. Timed steps start after a barrier and end with one; the step time is the slowest rank's. `tok_s` is then
the aggregate (world x per-rank tokens / step time; `tok_s_per_rank` the per-rank share) and `mfu` is over world x
--peak-tflops; rank 0 prints the JSON. The causal-only baseline is not run with --dist (a second wrapper over the same
parameters).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from hstap import dist as D
from hstap.drafter import DrafterConfig, Eagle3Drafter
from hstap.ttt import TTTModel, step_rows, target_distribution, ttt_flops


def build(a, dev):
    if a.tiny:
        cfg = DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=128, vocab_size=512, draft_vocab_size=128, target_hidden_size=64,
                            num_aux=3)
    else:
        cfg = DrafterConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                            num_aux=3, rope_theta=500000.0, max_position_embeddings=131072, aux_layers=[1, 15, 28])
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    hot = torch.sort(torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    d.set_vocab_map(hot - torch.arange(cfg.draft_vocab_size), t2d)
    d.to(dev)
    cd = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=cd) / math.sqrt(cfg.hidden_size)
    head[hot.to(dev)] *= 2.0
    B = max(1, a.batch_tokens // a.seq)
    g = torch.Generator(device=dev).manual_seed(1 + D.get_rank())  # each rank its own batch; rank 0's = 1 process
    data = {"ids": torch.randint(0, cfg.vocab_size, (B, a.seq), device=dev, generator=g),
            "lm": torch.ones(B, a.seq, dtype=torch.long, device=dev),
            "lengths": torch.full((B,), a.seq, dtype=torch.long, device=dev),
            "aux": torch.randn(B, a.seq, 3, cfg.hidden_size, device=dev, dtype=cd, generator=g),
            "final": torch.randn(B, a.seq, cfg.hidden_size, device=dev, dtype=cd, generator=g)}
    return d, head, hot.to(dev), t2d.to(dev), data, cd


def bench(a, dev, model, params, opt, head, hot, t2d, data, cd, exact: bool, wrapped=None) -> dict:
    """Time a.steps steps of `model` (a TTTModel; `wrapped` = its DDP/FSDP wrapper when distributed)."""
    cuda = dev.type == "cuda"
    T = a.seq
    world = D.get_world()
    fwd = wrapped if wrapped is not None else model

    def step():
        tb = target_distribution(data["final"], data["lm"], data["lengths"], head, hot, t2d, a.ce_chunk, cd)
        counted = [float(step_rows(tb, T, k)[0].numel()) for k in range(a.ttt)]
        denom = D.all_reduce_sum(torch.tensor(counted, device=dev))  # (K,) counted positions of the global batch
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            if world > 1:  # as hstap.train: the world factor undoes DDP/FSDP's gradient averaging
                loss, _ = fwd(data["ids"], data["aux"], tb, denom.float(), float(world))
            else:
                loss, _ = fwd(data["ids"], data["aux"], tb, denom)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return counted, float(tb["s"].numel())

    t0 = time.perf_counter()
    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    D.barrier()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    flops = 0.0
    for _ in range(a.steps):
        counted, rows = step()
        flops += ttt_flops(model.drafter.config, data["lengths"].cpu(), counted, rows, a.ttt, exact)
    if cuda:
        torch.cuda.synchronize(dev)
    D.barrier()
    el = time.perf_counter() - t0
    tokens = float(data["lengths"].sum()) * a.steps
    if world == 1:
        return {"attn": model.attn, "step_s": el / a.steps, "tok_s": tokens / el, "tflops": flops / el / 1e12,
                "mfu": flops / el / (a.peak_tflops * 1e12), "flops_per_step": flops / a.steps, "warmup_s": warm_s,
                "peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None, "world": 1,
                "tok_s_per_rank": tokens / el}
    # slowest rank's time; tokens and FLOPs summed over ranks (gloo reduces CPU tensors, NCCL device tensors)
    rdev = dev if cuda else torch.device("cpu")
    t = torch.tensor([el, warm_s, torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else 0.0], dtype=torch.float64,
                     device=rdev)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    el, warm_s, peak = t.tolist()
    tf = D.all_reduce_sum(torch.tensor([tokens, flops], dtype=torch.float64, device=rdev)).tolist()
    return {"attn": model.attn, "step_s": el / a.steps, "tok_s": tf[0] / el, "tflops": tf[1] / el / 1e12,
            "mfu": tf[1] / el / (a.peak_tflops * 1e12 * world), "flops_per_step": tf[1] / a.steps, "warmup_s": warm_s,
            "peak_gb": peak if cuda else None, "world": world, "tok_s_per_rank": tf[0] / el / world}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; 64 with --tiny)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 16384; 256 with --tiny)")
    p.add_argument("--ttt", type=int, default=None, help="TTT steps (default 7; 3 with --tiny)")
    p.add_argument("--ce-chunk", type=int, default=4096, help="rows per chunk of the target head and the fused CE")
    p.add_argument("--no-compile", action="store_true", help="no torch.compile of dense parts / CE")
    p.add_argument("--no-baseline", action="store_true", help="skip the causal-only baseline")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="peak bf16 TFLOP/s for MFU (H200: 790)")
    p.add_argument("--dist", choices=["ddp", "fsdp"], default=None,
                   help="under torchrun: wrap with DDP or FSDP2 as hstap train does (--batch-tokens per rank)")
    a = p.parse_args(argv)
    defaults = (("steps", 10, 2), ("warmup", 3, 1), ("seq", 2048, 64), ("batch_tokens", 16384, 256), ("ttt", 7, 3))
    for k, full, tiny in defaults:
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)
    if a.dist:
        _, world, _, dev = D.init_dist("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
        try:
            return _main(a, dev, world)
        finally:
            D.destroy()
    dev = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    return _main(a, dev, 1)


def _main(a, dev, world: int) -> dict:
    if dev.type == "cpu" and not a.tiny:
        print("no CUDA device: use --tiny for the CPU smoke test", file=sys.stderr)
        sys.exit(2)
    d, head, hot, t2d, data, cd = build(a, dev)
    compile_ = dev.type == "cuda" and not a.no_compile  # TTTModel gives its compiled regions their recompile budget
    exact = TTTModel(d, ttt=a.ttt, attn="flex" if dev.type == "cuda" else "sdpa", ce_chunk=a.ce_chunk, compile=compile_)
    wrapped, fsdp = None, a.dist == "fsdp" and world > 1
    if world > 1:  # as hstap.train: FSDP2 shards in place (before the optimizer sees the parameters), DDP wraps
        if fsdp:
            D.apply_fsdp(exact, bf16=dev.type == "cuda")
            wrapped = exact
        else:
            wrapped = D.wrap_ddp(exact, dev)
    params = [q for q in exact.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=None if fsdp else dev.type == "cuda")  # train.py: fused AdamW only without FSDP
    res = bench(a, dev, exact, params, opt, head, hot, t2d, data, cd, exact=True, wrapped=wrapped)
    out = {"bench": "train", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "tiny": a.tiny, "compile": compile_, "seq": a.seq,
           "batch_tokens": int(data["lengths"].sum()), "ttt": a.ttt, "hidden": d.config.hidden_size,
           "vocab": d.config.vocab_size, "draft_vocab": d.config.draft_vocab_size, "peak_tflops": a.peak_tflops,
           "exact": res, "dist": a.dist if world > 1 else None, "world": world,
           "global_batch_tokens": int(data["lengths"].sum()) * world}
    if D.get_rank() == 0:
        print(f"exact TTT ({res['attn']}{', ' + a.dist + ' x' + str(world) if world > 1 else ''}): "
              f"{res['step_s'] * 1e3:.1f} ms/step  {res['tok_s']:,.0f} tok/s  "
              f"{res['tflops']:.1f} TFLOP/s  MFU {res['mfu']:.1%}  peak {res['peak_gb'] or 0:.1f} GB  "
              f"(warm-up {res['warmup_s']:.0f} s)", file=sys.stderr)
    if not a.no_baseline and world == 1:
        base = TTTModel(d, ttt=a.ttt, attn="causal", ce_chunk=a.ce_chunk)
        base.ce_core = exact.ce_core  # same (possibly compiled) cross-entropy; the midlayer's compiled parts are shared
        b = bench(a, dev, base, params, opt, head, hot, t2d, data, cd, exact=False)
        out["baseline_causal"] = b
        out["exact_vs_causal_time"] = res["step_s"] / b["step_s"]
        print(f"causal-only baseline: {b['step_s'] * 1e3:.1f} ms/step  {b['tok_s']:,.0f} tok/s  MFU {b['mfu']:.1%}  "
              f"peak {b['peak_gb'] or 0:.1f} GB", file=sys.stderr)
    if D.get_rank() == 0:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
