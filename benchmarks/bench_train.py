"""Training throughput of EAGLE-3 drafter steps, one GPU: the 8B-shaped drafter and the reference target's.

    python benchmarks/bench_train.py                       # H200: both shapes, one JSON line ("shapes": {"8b", "ref"})
    python benchmarks/bench_train.py --shape 8b            # the 8B shape alone, + the causal-only baseline
    python benchmarks/bench_train.py --shape ref --profile # the reference shape, + top-15 CUDA/CPU ops per config
    python benchmarks/bench_train.py --tiny                # CPU smoke test of the same code paths (seconds)

One step is exactly `hstap train`'s: `hstap.train.data.Feed` (batch to the device, the target distribution in chunks
under no_grad, every TTT step's counted rows) and `hstap.train.trainer.Trainer.step` (forward of the unrolled TTT steps under
bf16 autocast with fp32 master weights, the fused chunked lm_head + objective, backward, clipping, fused AdamW), with a
HyperParams of train's defaults; the step's figures are read (a host sync) once per 10 steps, as --log-every 10 does.

Shapes.
- 8b: hidden 4096, 32/8 heads of 128, intermediate 14336, target vocab 128256, draft vocab 32000, 3 aux layers,
  sequences of 2048 (--seq), 16384 tokens per step (--batch-tokens), batch tensors made on the device once. The frozen
  target lm_head is a random bf16 [128256, 4096] whose draft rows are scaled x2, so the target argmax lies in the
  draft vocabulary for almost every position, as with real data. In-run baseline (--shape 8b): causal-only attention
  (each step attends causally to its own keys; SDPA; no TTT diagonal).
- ref: the reference target's drafter (hidden 384, 6/2 heads of 64, intermediate 1024, vocab = draft vocab 8192, 3 aux
  layers), 32768 tokens per step, 8 batches cycled whose lengths look like the regenerated corpus (most samples a ~40
  token prompt + a 256-token answer, some shorter; B * max_len <= batch tokens, loss mask 0 on the prompt), held in
  pinned host memory and copied per step as train's DataLoader batches are. Run once per --ref-configs entry: eager
  (train's defaults), eager-chunk16k (--ce-chunk 16384), compiled (--compile), compiled-chunk16k.

Figures per run: ms/step, tok/s (real tokens), MFU (`hstap.train.ttt.ttt_flops` / time / --peak-tflops, 790 for an H200 in
bf16), peak memory and host syncs per timed step (CUDA: torch.cuda.set_sync_debug_mode("warn") warnings counted).
Warm-up steps (compilation) are excluded; timed steps are synchronised at both ends. --profile adds torch.profiler's
top-15 ops by self CUDA time and by self CPU time over 3 more steps (to stderr, and to
OUT_DIR/profile_<shape>_<config>.txt with --out-dir OUT_DIR; the JSON keeps the top 5 of each). The last line of stdout is
one JSON object.

The store's checksum check (`hstap train` hashes every shard once against its recorded checksum before the
first step, `hstap.store.reader.Store.check`), on against off, through train's own data path:

    python benchmarks/bench_train.py --store-checks                 # H200: the ref shape, an 8 GB bf16 store
    python benchmarks/bench_train.py --store-checks --shape 8b      # the 8B shape's states (32 KB a token)
    python benchmarks/bench_train.py --tiny --store-checks          # CPU smoke test (seconds)

writes a store of --store-gb GB of random states in capture's --shard-mb 1024 shards (`StoreWriter`, corpus-like
lengths as above; --store-dir, else a temp dir removed at the end), then runs whole epochs over it as
`hstap train` does (`Store` -> `Rows` -> `TrainBatches` with train's DataLoader workers -> `Feed` -> `Trainer.step`,
compiled on CUDA, after an untimed epoch that compiles every padded length: --warmup N steps instead), alternately with
the check off and on (--store-passes each). Per
pass: the check's seconds, the epoch's seconds and tokens, tok/s over both (what a run of one epoch sees) and over the
epoch alone; with the hashing rate (GB/s) and the on/off ratio of tok/s. The store was just written: its pages are
likely in the page cache (the JSON says how much memory the machine has), so the hashing is CPU-bound as training's
reads are; a store larger than memory makes both disk-bound.

Several GPUs (weak scaling: --batch-tokens per rank; 8b shape), wrapped by Trainer exactly as `hstap train` wraps:

    torchrun --nproc-per-node 2 benchmarks/bench_train.py --shape 8b --no-baseline --dist ddp
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --shape 8b --no-baseline --dist fsdp
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --tiny --shape 8b --dist ddp     # CPU, gloo

Every rank builds the same drafter and head (same seed) and its own random batch (seed 1 + rank); timed steps start
after a barrier and end with one; the step time is the slowest rank's; `tok_s` is the aggregate, `mfu` over world x
--peak-tflops; rank 0 prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from hstap import dist as D
from hstap.models.drafter import DrafterConfig, Eagle3Drafter
from hstap.train.data import Feed
from hstap.train.config import Devices, HyperParams
from hstap.train.trainer import Trainer
from hstap.train.ttt import ttt_flops

TRAIN_DEFAULTS = HyperParams()  # train's defaults

REF_CONFIGS = {"eager": (False, 4096), "eager-chunk16k": (False, 16384), "compiled": (True, 4096),
               "compiled-chunk16k": (True, 16384)}
"""--ref-configs name -> (--compile, --ce-chunk)."""


def drafter_config(shape: str, tiny: bool) -> DrafterConfig:
    if tiny:
        return DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, vocab_size=512, draft_vocab_size=512 if shape == "ref" else 128,
                             target_hidden_size=64, num_aux=3, aux_layers=[1, 2, 3])
    if shape == "ref":
        return DrafterConfig(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                             intermediate_size=1024, vocab_size=8192, draft_vocab_size=8192, target_hidden_size=384,
                             num_aux=3, aux_layers=[1, 3, 4])
    return DrafterConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                         num_aux=3, rope_theta=500000.0, max_position_embeddings=131072, aux_layers=[1, 15, 28])


def build_drafter(cfg: DrafterConfig, dev):
    """The drafter with a random draft vocabulary, and a random bf16 target head whose draft rows are scaled x2."""
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
    return d, head, cd


def batches_8b(a, cfg, dev, cd) -> list[dict]:
    """One batch of B sequences of --seq tokens on the device, loss mask all 1."""
    B = max(1, a.batch_tokens // a.seq)
    g = torch.Generator(device=dev).manual_seed(1 + D.get_rank())  # each rank its own batch; rank 0's = 1 process
    return [{"input_ids": torch.randint(0, cfg.vocab_size, (B, a.seq), device=dev, generator=g),
             "loss_mask": torch.ones(B, a.seq, dtype=torch.long, device=dev),
             "lengths": torch.full((B,), a.seq, dtype=torch.long),
             "aux": torch.randn(B, a.seq, 3, cfg.hidden_size, device=dev, dtype=cd, generator=g),
             "final": torch.randn(B, a.seq, cfg.hidden_size, device=dev, dtype=cd, generator=g)}]


def batches_ref(a, cfg, dev, cd, n: int = 8) -> list[dict]:
    """n right-padded batches of corpus-like lengths in (pinned) host memory: T = the batch's longest sample."""
    g = torch.Generator().manual_seed(1)
    out = []
    scale = a.seq / 296  # --seq: the typical length (a ~40-token prompt + a 256-token answer)
    for _ in range(n):
        T = int(scale * int(torch.randint(270, 330, (1,), generator=g)))
        B = max(1, a.batch_tokens // T)
        full = (torch.rand(B, generator=g) < 0.85)  # most answers hit the 256-token cap
        lengths = torch.where(full, T - torch.randint(0, max(2, T // 8), (B,), generator=g),
                              torch.randint(max(8, T // 5), T, (B,), generator=g))
        lengths[0] = T
        prompt = torch.randint(max(2, T // 12), max(3, T // 6), (B,), generator=g)
        pos = torch.arange(T)[None]
        b = {"input_ids": torch.randint(0, cfg.vocab_size, (B, T), generator=g) * (pos < lengths[:, None]),
             "loss_mask": ((pos >= prompt[:, None]) & (pos < lengths[:, None])).long(), "lengths": lengths,
             "aux": torch.randn(B, T, 3, cfg.hidden_size, generator=g).to(cd),
             "final": torch.randn(B, T, cfg.hidden_size, generator=g).to(cd)}
        out.append({k: (v.pin_memory() if dev.type == "cuda" else v) for k, v in b.items()})
    return out


def make_trainer(drafter, dev, attn: str, compile_: bool, ce_chunk: int, ttt: int, fsdp: bool,
                 loss: str = TRAIN_DEFAULTS.loss) -> Trainer:
    """train's Trainer, with train's default hyper-parameters but for ttt and loss, over a drafter already on dev."""
    hyper = HyperParams(ttt=ttt, loss=loss)
    devices = Devices(ce_chunk=ce_chunk, compile=compile_ and dev.type == "cuda", fsdp=fsdp)
    return Trainer(hyper, devices, drafter, D.get_world(), dev, attn, dev.type == "cuda", ce_chunk)


def _syncs(run, cuda: bool) -> tuple[object, int | None]:
    """run() under the CUDA sync debug mode ("warn"): (its result, synchronising calls counted); None on CPU."""
    if not cuda:
        return run(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            res = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return res, sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def bench(a, dev, trainer, feed, batches, exact: bool, label: str) -> dict:
    """Time a.steps steps cycling through `batches` (after a.warmup untimed ones) -> the figures of one run."""
    cuda, world = dev.type == "cuda", D.get_world()
    state = {"i": 0, "flops": 0.0, "tokens": 0.0}

    def step(count: bool, read: bool):
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        micro = [feed(b)]
        stats, gn = trainer.step(micro, 1e-4)
        if count:
            _, _, tb, counted, lengths = micro[0]
            state["flops"] += ttt_flops(trainer.drafter.config, lengths, counted, float(tb["s"].numel()), a.ttt, exact)
            state["tokens"] += float(lengths.sum())
        if read:  # what train's metrics line reads, once per --log-every steps
            state["last"] = (stats.tolist(), float(D.full_tensor(gn)))

    t0 = time.perf_counter()
    for _ in range(a.warmup):
        step(False, True)
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    D.barrier()
    warm_s = time.perf_counter() - t0

    def timed():
        t = time.perf_counter()
        for j in range(a.steps):
            step(True, (j + 1) % 10 == 0 or j + 1 == a.steps)
        if cuda:
            torch.cuda.synchronize(dev)
        D.barrier()
        return time.perf_counter() - t

    el, syncs = _syncs(timed, cuda)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else 0.0
    tokens, flops = state["tokens"], state["flops"]
    if world > 1:  # slowest rank's time; tokens and FLOPs summed over ranks (gloo: CPU tensors, NCCL: device)
        rdev = dev if cuda else torch.device("cpu")
        t = torch.tensor([el, warm_s, peak], dtype=torch.float64, device=rdev)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        el, warm_s, peak = t.tolist()
        tokens, flops = D.all_reduce_sum(torch.tensor([tokens, flops], dtype=torch.float64, device=rdev)).tolist()
    res = {"config": label, "attn": trainer.model.attn, "step_s": el / a.steps, "ms_per_step": 1e3 * el / a.steps,
           "tok_s": tokens / el, "tflops": flops / el / 1e12, "mfu": flops / el / (a.peak_tflops * 1e12 * world),
           "flops_per_step": flops / a.steps, "warmup_s": warm_s, "peak_gb": peak if cuda else None,
           "host_syncs_per_step": syncs / a.steps if syncs is not None else None, "world": world,
           "tok_s_per_rank": tokens / el / world, "tokens_per_step": tokens / a.steps / world}
    if a.profile and D.get_rank() == 0:
        top = profile(a, dev, lambda: step(False, True), label)  # compact in the JSON: the top 5 of each
        res["profile_top5"] = {k: [[e["op"][:50], round(e["ms_per_step"], 3)] for e in v[:5]] for k, v in top.items()}
    return res


def profile(a, dev, step, label: str) -> dict:
    """torch.profiler over 3 steps: the top-15 ops by self CUDA time and by self CPU time (printed and returned)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with prof(activities=acts) as p:
        for _ in range(3):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    ka = p.key_averages()
    out, text = {}, []
    for key, attrs in (("cuda", ("self_device_time_total", "self_cuda_time_total")), ("cpu", ("self_cpu_time_total",))):
        if key == "cuda" and dev.type != "cuda":
            continue
        us = lambda e: next((getattr(e, x) for x in attrs if hasattr(e, x)), 0) or 0  # noqa: E731 -- torch renamed it
        rows = sorted(ka, key=us, reverse=True)[:15]
        out[key] = [{"op": e.key, "ms_per_step": us(e) / 3e3, "calls_per_step": e.count / 3} for e in rows]
        text.append(f"top-15 ops by self {key.upper()} time ({label}, per step):")
        text += [f"  {r['ms_per_step']:9.3f} ms  {r['calls_per_step']:8.1f} calls  {r['op'][:90]}" for r in out[key]]
    print("\n".join(text), file=sys.stderr)
    if a.out_dir:
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.out_dir) / f"profile_{label}.txt").write_text("\n".join(text) + "\n")
    return out


def _line(label: str, r: dict) -> str:
    s = r["host_syncs_per_step"]
    return (f"{label:24s} {r['ms_per_step']:8.1f} ms/step  {r['tok_s']:>10,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"peak {r['peak_gb'] or 0:5.1f} GB  syncs/step {'-' if s is None else f'{s:.1f}'}  "
            f"(warm-up {r['warmup_s']:.0f} s)")


def run_shape(a, dev, shape: str) -> dict:
    cfg = drafter_config(shape, a.tiny)
    out = {"drafter": {"hidden": cfg.hidden_size, "heads": [cfg.num_attention_heads, cfg.num_key_value_heads],
                       "head_dim": cfg.head_dim, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
                       "draft_vocab": cfg.draft_vocab_size}, "batch_tokens": a.batch_tokens, "seq": a.seq,
           "ttt": a.ttt, "loss": a.loss, "runs": {}}
    cuda = dev.type == "cuda"
    configs = ([(n, *REF_CONFIGS[n]) for n in a.ref_configs.split(",")] if shape == "ref"
               else [("compiled" if cuda and not a.no_compile else "eager", cuda and not a.no_compile, a.ce_chunk)])
    for name, comp, chunk in configs:
        d, head, cd = build_drafter(cfg, dev)  # a fresh drafter per config: compile wraps its layers in place
        tr = make_trainer(d, dev, "flex" if cuda else "sdpa", comp, chunk, a.ttt, a.dist == "fsdp", a.loss)
        data = SimpleNamespace(target=None, layers=list(cfg.aux_layers), sel=[0, 1, 2], d2t=d.d2t.cpu(),
                               t2d=d.t2d.cpu())
        feed = Feed(data, head, dev, cd, chunk, a.ttt, pad_to=16 if cuda else 1)  # as train pads on CUDA
        batches = batches_ref(a, cfg, dev, cd) if shape == "ref" else batches_8b(a, cfg, dev, cd)
        label = f"{shape}_{name}"
        r = bench(a, dev, tr, feed, batches, True, label)
        out["runs"][name] = r
        if D.get_rank() == 0:
            print(_line(label, r), file=sys.stderr)
        if shape == "8b" and not a.no_baseline and D.get_world() == 1 and a.shape == "8b":
            base = make_trainer(d, dev, "causal", False, chunk, a.ttt, False)
            base.model.ce_core = tr.model.ce_core  # the same (compiled) objective; the layers' compiled parts shared
            b = bench(a, dev, base, feed, batches, False, f"{shape}_causal")
            out["runs"]["baseline_causal"] = b
            out["exact_vs_causal_time"] = r["step_s"] / b["step_s"]
            print(_line(f"{shape}_causal", b), file=sys.stderr)
        del tr, feed, batches, d, head
        if cuda:
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------------------------------
# --store-checks: train's data path over a real store, its checksum check on against off


def write_store(a, cfg: DrafterConfig, path: Path) -> dict:
    """A bf16 store of about --store-gb GB: corpus-like sample lengths (as `batches_ref`), random states drawn from a
    pool (the values do not matter to hashing or training speed), --shard-mb shards. Returns its size figures."""
    from hstap.store.format import store_bytes_per_token
    from hstap.store.writer import StoreWriter

    K, H = len(cfg.aux_layers), cfg.target_hidden_size
    header = {"target": {"path": "bench_train", "model_type": "llama", "num_layers": 8, "hidden_size": H},
              "engine": {"name": "bench_train"}, "dtype": "bf16", "layers": list(cfg.aux_layers), "hidden_size": H}
    per_token = store_bytes_per_token(K, H, "bf16")
    want = int(a.store_gb * 1e9 / per_token)
    g = torch.Generator().manual_seed(2)
    pool = 4 * a.seq + 64
    aux = torch.randn(pool, K, H, generator=g).to(torch.bfloat16)  # (P, K, H)
    final = torch.randn(pool, H, generator=g).to(torch.bfloat16)  # (P, H)
    t0, tokens, i = time.perf_counter(), 0, 0
    with StoreWriter(path, header, shard_tokens=1 << 40, shard_bytes=a.shard_mb << 20, new=True) as w:
        while tokens < want:
            full = bool(torch.rand(1, generator=g) < 0.85)  # most answers hit the cap
            T = int(a.seq * (0.9 + 0.2 * float(torch.rand(1, generator=g)))) if full else \
                int(torch.randint(max(8, a.seq // 5), a.seq, (1,), generator=g))
            at = int(torch.randint(0, pool - T, (1,), generator=g))
            prompt = max(1, T // 8)
            w.add(f"s{i:08d}", torch.randint(0, cfg.vocab_size, (T,), generator=g),
                  (torch.arange(T) >= prompt).long(), aux[at:at + T], final[at:at + T])
            tokens, i = tokens + T, i + 1
    return {"store_gb": tokens * per_token / 1e9, "samples": i, "tokens": tokens, "bytes_per_token": per_token,
            "write_s": time.perf_counter() - t0}


def store_pass(a, dev, trainer, feed, path: Path, checks: bool, workers: int, steps: int | None = None) -> dict:
    """One pass as `hstap train` runs it: the store opened, `Store.check` (hashing on or off), then an epoch (or
    `steps` steps) of train's batches through the trainer."""
    from hstap.batching import Rows, TrainBatches
    from hstap.store import reader

    cuda = dev.type == "cuda"
    reader.CHECK_CHECKSUMS = checks
    try:
        st = reader.open_store(path)
        t0 = time.perf_counter()
        info = st.check()
        check_s = time.perf_counter() - t0
    finally:
        reader.CHECK_CHECKSUMS = True
    batches = TrainBatches(Rows(st, list(range(len(st))), prepared=False), list(st.lengths), a.batch_tokens, 0, 0, 1,
                           0, 0, cuda, workers)
    n = min(steps or len(batches.sampler), len(batches.sampler))
    it = iter(batches)
    tokens, t1 = 0, time.perf_counter()
    for j in range(n):
        b = next(it)
        stats, _ = trainer.step([feed(b)], 1e-4)
        tokens += int(b["lengths"].sum())
        if (j + 1) % 10 == 0 or j + 1 == n:
            stats.tolist()  # train's metrics line: a host read once per --log-every 10 steps
    if cuda:
        torch.cuda.synchronize(dev)
    train_s = time.perf_counter() - t1
    it.close()  # the DataLoader's workers end with it
    return {"checks": "on" if checks else "off", "check_s": check_s, "hashed_gb": info["gb"], "steps": n,
            "tokens": tokens, "train_s": train_s, "tok_s": tokens / (check_s + train_s), "tok_s_epoch": tokens / train_s}


def run_store_checks(a, dev) -> dict:
    """--store-checks (module docstring): the passes, off and on alternately, and their summary."""
    import shutil
    import tempfile

    cuda = dev.type == "cuda"
    cfg = drafter_config(a.shape, a.tiny)
    root = Path(a.store_dir) if a.store_dir else Path(tempfile.mkdtemp(prefix="bench-store-"))  # not --out-dir: GBs
    try:
        made = write_store(a, cfg, root / "store")
        d, head, cd = build_drafter(cfg, dev)
        chunk = 16384 if 16384 * cfg.vocab_size <= 1 << 28 else 4096  # train's --ce-chunk 0 (auto)
        tr = make_trainer(d, dev, "flex" if cuda else "sdpa", cuda and not a.no_compile, chunk, a.ttt, False, a.loss)
        data = SimpleNamespace(target=None, layers=list(cfg.aux_layers), sel=list(range(len(cfg.aux_layers))),
                               d2t=d.d2t.cpu(), t2d=d.t2d.cpu())
        feed = Feed(data, head, dev, cd, chunk, a.ttt, pad_to=16 if cuda else 1)
        workers = 4 if cuda else 0  # train's --workers -1
        t0 = time.perf_counter()
        # compilation, for every padded length the epoch holds (--warmup 0: a whole epoch), and first reads
        store_pass(a, dev, tr, feed, root / "store", False, workers, steps=a.warmup or None)
        warm_s = time.perf_counter() - t0
        passes = [store_pass(a, dev, tr, feed, root / "store", checks, workers, steps=a.steps)
                  for _ in range(a.store_passes) for checks in (False, True)]
        for r in passes:
            print(f"checks {r['checks']:3s}  check {r['check_s']:6.2f} s  epoch {r['train_s']:7.2f} s "
                  f"({r['steps']} steps)  {r['tok_s']:>10,.0f} tok/s  (epoch alone {r['tok_s_epoch']:>10,.0f})",
                  file=sys.stderr)
    finally:
        if not a.store_dir:
            shutil.rmtree(root, ignore_errors=True)
    mean = lambda key, c: sum(r[key] for r in passes if r["checks"] == c) / a.store_passes  # noqa: E731
    on = [r for r in passes if r["checks"] == "on"]
    return {**made, "shard_mb": a.shard_mb, "batch_tokens": a.batch_tokens, "seq": a.seq, "workers": workers,
            "warmup_s": warm_s, "mem_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
            "cpus": os.cpu_count(), "passes": passes,
            "hash_gb_s": sum(r["hashed_gb"] for r in on) / max(1e-9, sum(r["check_s"] for r in on)),
            "check_s": mean("check_s", "on"), "tok_s_off": mean("tok_s", "off"), "tok_s_on": mean("tok_s", "on"),
            "on_vs_off": mean("tok_s", "on") / mean("tok_s", "off"),
            "epoch_tok_s_on_vs_off": mean("tok_s_epoch", "on") / mean("tok_s_epoch", "off")}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["ref", "8b", "both"], default="both", help="drafter shape(s) (default both)")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke test)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps (default 10; 2 with --tiny); --store-checks: at most this many a pass (an epoch)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 4 for ref, 3 for 8b; 1 tiny; --store-checks: 0 = an epoch)")
    p.add_argument("--seq", type=int, default=None, help="8b: sequence length (2048); ref: typical length (296)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (8b 16384, ref 32768)")
    p.add_argument("--ttt", type=int, default=None,
                   help=f"TTT steps (default train's, {TRAIN_DEFAULTS.ttt}; 3 with --tiny)")
    p.add_argument("--loss", default=TRAIN_DEFAULTS.loss, help=f"train's --loss (default {TRAIN_DEFAULTS.loss})")
    p.add_argument("--ce-chunk", type=int, default=4096, help="8b: rows per chunk of the target head and fused CE")
    p.add_argument("--ref-configs", default="eager,eager-chunk16k,compiled-chunk16k",
                   help=f"ref: comma list of {', '.join(REF_CONFIGS)}")
    p.add_argument("--no-compile", action="store_true", help="8b: no torch.compile of dense parts / CE")
    p.add_argument("--no-baseline", action="store_true", help="8b: skip the causal-only baseline")
    p.add_argument("--profile", action="store_true", help="top-15 CUDA/CPU ops of 3 more steps per run")
    p.add_argument("--out-dir", default=None, help="--profile: also write each run's table to OUT_DIR/profile_*.txt")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="peak bf16 TFLOP/s for MFU (H200: 790)")
    p.add_argument("--dist", choices=["ddp", "fsdp"], default=None,
                   help="under torchrun: wrap with DDP or FSDP2 as hstap train does (--batch-tokens per rank)")
    p.add_argument("--store-checks", action="store_true",
                   help="train's data path over a real store, its checksum check on against off (--shape ref default)")
    p.add_argument("--store-gb", type=float, default=None, help="--store-checks: store size (8 GB; 0.002 with --tiny)")
    p.add_argument("--shard-mb", type=int, default=None, help="--store-checks: shard size (capture's 1024; 1 --tiny)")
    p.add_argument("--store-passes", type=int, default=2, help="--store-checks: passes with the check off, and on")
    p.add_argument("--store-dir", default=None, help="--store-checks: where the store goes (kept; default: a temp dir)")
    a = p.parse_args(argv)
    bad = [c for c in a.ref_configs.split(",") if c not in REF_CONFIGS]
    if bad:
        p.error(f"--ref-configs: unknown {bad}")
    if a.dist:
        _, world, _, dev = D.init_dist("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
        try:
            return _main(a, dev)
        finally:
            D.destroy()
    return _main(a, torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda"))


def _main(a, dev) -> dict:
    if dev.type == "cpu" and not a.tiny:
        print("no CUDA device: use --tiny for the CPU smoke test", file=sys.stderr)
        sys.exit(2)
    out = {"bench": "train", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "tiny": a.tiny, "peak_tflops": a.peak_tflops, "world": D.get_world(),
           "dist": a.dist if D.get_world() > 1 else None, "shapes": {}}
    given = {k: getattr(a, k) for k in ("steps", "warmup", "seq", "batch_tokens", "ttt")}
    if a.store_checks:
        shape = "ref" if a.shape == "both" else a.shape
        full = {"warmup": 0, "seq": 296 if shape == "ref" else 2048, "batch_tokens": 32768 if shape == "ref" else 16384,
                "ttt": TRAIN_DEFAULTS.ttt, "store_gb": 8.0, "shard_mb": 1024}
        tiny = {"warmup": 1, "seq": 48, "batch_tokens": 256, "ttt": 3, "store_gb": 0.002, "shard_mb": 1}
        for k, v in (full if not a.tiny else tiny).items():
            if getattr(a, k, None) is None:
                setattr(a, k, v)
        a.shape = shape
        out["store_checks"] = {"shape": shape, **run_store_checks(a, dev)}
        if D.get_rank() == 0:
            r = out["store_checks"]
            print(f"store checks ({shape}, {r['store_gb']:.2f} GB in {r['shard_mb']} MiB shards): hashing "
                  f"{r['hash_gb_s']:.2f} GB/s, {r['check_s']:.2f} s a run; tok/s over check + one epoch: off "
                  f"{r['tok_s_off']:,.0f}, on {r['tok_s_on']:,.0f} ({r['on_vs_off']:.3f}x); epoch alone "
                  f"{r['epoch_tok_s_on_vs_off']:.3f}x")
            print(json.dumps(out))
        return out
    for shape in (["8b", "ref"] if a.shape == "both" else [a.shape]):
        full = {"steps": 10, "warmup": 4 if shape == "ref" else 3, "seq": 296 if shape == "ref" else 2048,
                "batch_tokens": 32768 if shape == "ref" else 16384, "ttt": TRAIN_DEFAULTS.ttt}
        tiny = {"steps": 2, "warmup": 1, "seq": 48 if shape == "ref" else 64, "batch_tokens": 256, "ttt": 3}
        for k, v in given.items():
            setattr(a, k, v if v is not None else (tiny if a.tiny else full)[k])
        out["shapes"][shape] = run_shape(a, dev, shape)
    if D.get_rank() == 0:
        rows = [(f"{s}_{n}", r) for s, o in out["shapes"].items() for n, r in o["runs"].items()]
        print(f"{'run':24s} {'ms/step':>8s}  {'tok/s':>10s}  {'MFU':>6s}  host syncs/step")
        for label, r in rows:
            s = r["host_syncs_per_step"]
            print(f"{label:24s} {r['ms_per_step']:8.1f}  {r['tok_s']:10,.0f}  {r['mfu']:6.1%}  "
                  f"{'-' if s is None else f'{s:.1f}'}")
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
