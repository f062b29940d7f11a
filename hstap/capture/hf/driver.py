"""`hstap capture --engine hf` (the default): the embedded engine, a HF causal LM run in this process, its hidden
states streamed into a store by `hstap.capture.hf.runner`.

`capture_hf(cfg)`: under torchrun each rank takes the rows rank::world_size of the prepared set that the store does not
hold yet, runs its own copy of the model (hstap/dist.py reads torchrun's environment and picks cuda:LOCAL_RANK) and
writes its own shards; rank 0 prints the totals.
"""

from __future__ import annotations

import time

import torch

from hstap import dist as D
from hstap.artifacts.model_dir import load_target
from hstap.batching import pack_by_tokens
from hstap.capture.config import CaptureConfig
from hstap.capture.hf.runner import run_capture
from hstap.capture.inputs import check_out, copy_vocab_map, progress_bar, resolve, store_totals
from hstap.common import write_run_config
from hstap.data.prepare import prepared_columns
from hstap.device import resolve_dtype
from hstap.models.target import Target
from hstap.store.manifest import committed_ids_of
from hstap.store.writer import StoreWriter


def capture_hf(cfg: CaptureConfig) -> dict:
    """The embedded engine's capture (cfg: a CaptureConfig): this rank's share of the prepared set through the HF model
    in this process into cfg.out. Prints and returns the summary (rank 0's has the totals of all ranks).

    Everything is checked before the store is created or touched: the data against the target, the store to resume
    (its header, its shards' checksums), and the target itself, loaded first when there is anything to capture (a
    target that does not load leaves no store behind to refuse the next, correct run)."""
    t_start = time.perf_counter()
    rank, world, local_rank = D.torchrun_env()
    inputs = resolve(cfg, rank, world, scan=True, check_store=False)
    ds, target_block, layers = inputs.ds, inputs.target, list(inputs.layers)
    dev = D.local_device(cfg.device, world, local_rank)
    engine = _engine_block(dev, resolve_dtype(cfg.compute_dtype, dev))
    header = inputs.header(engine, cfg)
    committed = committed_ids_of(cfg.out) if check_out(cfg.out, cfg.new, rank, world, header) else set()
    plan = _plan_share(cfg, ds, inputs.n, rank, world, committed)
    t_load = time.perf_counter()
    # nothing left (a finished resume, or a rank with no share): no need to load the weights
    target = load_target(cfg.target, dev, engine["compute_dtype"])[0] if plan["batches"] else None
    plan["load_s"] = time.perf_counter() - t_load

    dist = D.init_barrier(world)
    try:
        with StoreWriter(cfg.out, header, rank=rank, world_size=world, shard_tokens=cfg.shard_tokens, new=cfg.new,
                         shard_bytes=cfg.shard_mb << 20,
                         barrier=dist.barrier if dist else None) as writer:
            if rank == 0:
                copy_vocab_map(cfg.data, cfg.out)
            share = _capture_share(cfg, ds, plan, rank, writer, target, layers)
        # leaving the block closed the writer: last shard committed, barrier, rank 0 merged the manifest
        counts = _total_counts(dist, share)
    finally:
        if dist is not None:
            D.destroy()

    summary = {"samples": counts["samples"], "tokens": counts["tokens"], "skipped_committed": counts["skipped"],
               "skipped_empty": counts["empty"], "seconds": round(counts["seconds"], 3),
               "load_s": round(share["load_s"], 3),
               "tokens_per_s": round(counts["tokens"] / counts["seconds"], 1) if counts["seconds"] > 0 else 0.0,
               "gb_written": round(counts["bytes"] / 1e9, 4), "world_size": world, "layers": layers,
               "dtype": cfg.dtype, "writer_wait_s": round(share["writer_wait_s"], 3), "out": cfg.out}
    if rank == 0:
        summary.update(store_totals(cfg.out, len(layers), target_block["hidden_size"], cfg.dtype))
        write_run_config(cfg.out, "capture", cfg)
        _print_summary(summary, engine, world, share["load_s"], time.perf_counter() - t_start)
    return summary


def _engine_block(dev: torch.device, compute_dtype: torch.dtype) -> dict:
    """The `engine` block of the store header."""
    import transformers

    return {"name": "hf", "version": f"transformers {transformers.__version__}", "torch": torch.__version__,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "compute_dtype": {torch.float32: "fp32", torch.bfloat16: "bf16"}[compute_dtype]}


def _plan_share(cfg: CaptureConfig, ds, n: int, rank: int, world: int, committed: set[str]) -> dict:
    """This rank's share: rows rank::world of the first n that the store lacks (and that have tokens), in batches."""
    ids, lens = prepared_columns(ds, n)
    mine = [i for i in range(rank, n, world) if ids[i] not in committed and lens[i] > 0]
    return {"mine": mine, "lens": lens, "tokens": sum(lens[i] for i in mine),
            "empty": sum(1 for i in range(rank, n, world) if lens[i] == 0),
            "skipped": sum(1 for i in range(rank, n, world) if ids[i] in committed),
            "batches": [[mine[j] for j in b] for b in pack_by_tokens([lens[i] for i in mine], cfg.batch_tokens)]}


def _capture_share(cfg: CaptureConfig, ds, plan: dict, rank: int, writer, target: Target | None,
                   layers: list[int]) -> dict:
    """Capture this rank's share (`_plan_share`) into `writer`; returns this rank's counts and timings."""
    writer.expect(plan["tokens"])  # shards shrink toward the end: little is left to write after the last forward
    batches, mine = plan["batches"], plan["mine"]

    def fetch():
        for b in batches:
            rows = ds[b]  # column dict for these rows
            yield [{"id": str(i), "input_ids": x, "loss_mask": m}
                   for i, x, m in zip(rows["id"], rows["input_ids"], rows["loss_mask"])]

    bar = progress_bar(rank, plan["tokens"])

    def progress(run, batch):
        if bar is not None:
            bar.update(sum(len(s["input_ids"]) for s in batch))
            bar.set_postfix_str(f"{run.samples}/{len(mine)} samples, {run.bytes / 1e9:.2f} GB out", refresh=False)

    stats = {"samples": 0, "tokens": 0, "bytes": 0, "seconds": 0.0, "writer_wait_s": 0.0}
    if batches:
        stats = run_capture(target, layers, writer, fetch(), dtype=cfg.dtype, queue_size=cfg.queue_size,
                            progress=progress)
    if bar is not None:
        bar.close()
    return {**stats, "skipped": plan["skipped"], "empty": plan["empty"], "load_s": plan["load_s"]}


def _total_counts(dist, share: dict) -> dict:
    """This rank's counts summed over all ranks (seconds: the slowest rank's); this rank's alone without a group."""
    names = ("samples", "tokens", "bytes", "skipped", "empty")
    counts = {k: share[k] for k in names}
    seconds = share["seconds"]
    if dist is not None:
        t = torch.tensor([counts[k] for k in names], dtype=torch.float64)  # (5,)
        dist.all_reduce(t)
        sec = torch.tensor([seconds], dtype=torch.float64)  # (1,)
        dist.all_reduce(sec, op=dist.ReduceOp.MAX)
        counts, seconds = {k: int(x) for k, x in zip(names, t.tolist())}, float(sec.item())
    return {**counts, "seconds": seconds}


def _print_summary(summary: dict, engine: dict, world: int, load_s: float, total_s: float) -> None:
    s = summary
    print(f"capture: {s['samples']} samples, {s['tokens']} tokens in {s['seconds']:.1f} s on {world} process(es) "
          f"({engine['device']}, {engine['compute_dtype']}): {s['tokens_per_s']:,.0f} tok/s; "
          f"{s['skipped_committed']} already in the store")
    print(f"capture: store {s['store_samples']} samples, {s['store_tokens']} tokens, "
          f"{s['store_bytes'] / 1e9:.3f} GB, {s['bytes_per_token']:.1f} bytes/token "
          f"(formula {s['bytes_per_token_formula']}); layers {s['layers']}, {s['dtype']}")
    print(f"capture: wrote {s['out']} (model load {load_s:.1f} s, total {total_s:.1f} s)")
