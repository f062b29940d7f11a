"""Capture throughput of the embedded engine against its own baselines, measured in one run, and where each pass's
time goes.

    python benchmarks/bench_capture.py --disk-dir /mnt/local/hstap-bench      # H200: Llama-3.1-8B-shaped, random bf16
    python benchmarks/bench_capture.py --disk-dir D --cli --disk-dtypes bf16,fp8 --trace-batches 4 --out-dir OUT
    python benchmarks/bench_capture.py --tiny [--cli --trace-batches 2]        # CPU smoke test (seconds)

What is measured (same random target, same batches of 8 x 2048 tokens, warm-up excluded, CUDA synchronised):
  (a) plain prefill: the base model's forward over the batches, no hooks, nothing copied or stored (the ceiling);
  (b) capture into a store on /dev/shm (RAM: the pipeline without a disk), bf16 and fp8;
  (c) capture into a store in --disk-dir (a real local disk); --disk-variants adds passes without the writer's
      end-of-run shard shrinking (StoreWriter.expect) and/or its early writeback (hstap.store.shard_file.START_WRITEBACK);
  (d) the sink's sequential write bandwidth (large writes + fsync) in /dev/shm and --disk-dir: what (b)/(c) can reach;
  (e) the per-sample cost of SGLang's return_hidden_states transport, `t.cpu().tolist()` + `json.dumps`, for one
      2048-token sample of 3 x 7168 bf16 (Kimi-K2/DeepSeek-V3 width), against our binary path for the same tensor
      (D2H into pinned memory + StoreWriter.add + shard commit): the speedup factor;
  (f) bytes per token of each store against `store_bytes_per_token`;
  (g) --cli: `hstap capture` itself (hstap.capture.hf.driver.capture_hf, in this process) on the same samples, written as a
      prepared set and the same target saved as a model directory (in --shm-dir): model load, cold start (first batch,
      pinned buffers allocated as it goes) and the CLI's own rate, into --disk-dir (or --shm-dir without one);
  (h) --trace-batches N: torch.profiler over N batches of one more capture into --shm-dir, its chrome trace written to
      --out-dir/capture_trace.json and its costliest ops in the JSON.
  (i) bytes: the first 3 batches captured into bf16 and fp8 stores by this tree and by the gather that an unpadded batch
      went through before (hstap.capture.hf.forward.demux), their shard checksums compared (`bytes_check`).
Every pass is profiled (hstap.capture.profile, --no-profile turns it off): seconds per pipeline stage on each thread
(inputs, forward, demux, convert, copy, queue on the launching thread; wait_copy, store on the writer thread), the
store writer's own split (StoreWriter.stats: checks, write, hash, fsync, commit), the pinned pool's allocation time,
the host reads and syncs by thread, stage and call site (benchmarks/sync_counter.py: the launching thread's syncs inside
the capture stages are `main_syncs`) and, on CUDA, device seconds per stage from events (forward, demux, convert, the
side stream's copy, the compute stream's idle time between batches). The plain prefill is profiled the same way, so a
capture pass's loss against it splits into: forward slower, demux + convert (extra device work), more idle (the GPU
waiting for the host), drain (the writer after the GPU's last forward) and the rest (`loss_vs_prefill`, CUDA).
Each capture pass reports its end-to-end rate (timer stopped once the last shard is committed: the goal's figure) and,
beside it, the rate until the GPU finished its last forward (`*_until_gpu_done`; the difference is the writer
draining what was still queued). Pinned staging buffers are allocated before the timer starts, as a long capture
allocates them in its first batches and then only reuses them.
Prints a table, then ONE JSON line with every number. Sample counts and sizes are flags; the default run (512 x 2048
tokens per pass, ~30 s each on an H200) fits in ~5 minutes (model init ~10 s, the JSON baseline ~20 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hstap.capture.hf.driver as driver_mod  # noqa: E402
import hstap.capture.hf.runner as runner_mod  # noqa: E402
import hstap.store.shard_file as shard_file  # noqa: E402
from hstap.batching import pack_by_tokens  # noqa: E402
from hstap.capture.hf.runner import run_capture  # noqa: E402
from hstap.capture.profile import CaptureProfile, spread  # noqa: E402
from hstap.capture.staging import PinnedPool, staging_layout, to_store_dtype  # noqa: E402
from hstap.layers import default_aux_layers  # noqa: E402
from hstap.device import auto_device  # noqa: E402
from hstap.models.target import Target  # noqa: E402
from hstap.store.format import store_bytes_per_token  # noqa: E402
from hstap.store.reader import open_store  # noqa: E402
from hstap.store.writer import StoreWriter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_counter import SyncCounter  # noqa: E402

LLAMA_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(num_hidden_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            vocab_size=1000, max_position_embeddings=2048)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_target(shape: dict, dev: torch.device, dtype: torch.dtype, seed: int) -> Target:
    """A random Llama built directly on `dev` in `dtype` (HF's init runs there: no CPU init, nothing saved to disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa" and next(model.parameters()).device.type == dev.type
    model.eval().requires_grad_(False)
    return Target(model)


def make_batches(n: int, seq: int, batch_tokens: int, vocab: int, seed: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    samples = [{"id": f"s{i:06d}", "input_ids": torch.randint(0, vocab, (seq,), generator=g),
                "loss_mask": torch.ones(seq, dtype=torch.uint8)} for i in range(n)]
    return [[samples[i] for i in b] for b in pack_by_tokens([seq] * n, batch_tokens)]


def header(target: Target, layers: list[int], dtype: str, shape: dict) -> dict:
    return {"target": {"path": "random-llama (in memory)", "model_type": "llama", "num_layers": target.num_layers,
                       "hidden_size": target.hidden_size, "config_sha256": json.dumps(shape, sort_keys=True),
                       "weights_fingerprint": "random", "tokenizer_sha256": None, "chat_template_sha256": None},
            "engine": {"name": "hf", "version": "bench", "device": str(target.device),
                       "compute_dtype": str(target.dtype)},
            "dtype": dtype, "layers": layers, "hidden_size": target.hidden_size, "capture_config": {"bench": True}}


@torch.no_grad()
def bench_prefill(target: Target, batches, dev, profile: bool = True) -> dict:
    """The plain prefill's rate; profiled like a capture pass (its forward's host and device seconds, the compute
    stream's idle time between batches, the host syncs it makes) unless profile is False."""
    prof = CaptureProfile(dev) if profile else None
    marks: list = []

    def run(bs, timed: bool):
        for b in bs:
            ids = torch.stack([s["input_ids"] for s in b]).to(dev, non_blocking=True)  # (B, T)
            f0 = prof.event() if timed and prof else None
            with prof.stage("forward") if timed and prof else contextlib.nullcontext():
                target.base(input_ids=ids, use_cache=False)  # like Target.capture: no KV cache kept
            if f0 is not None:
                marks.append((f0, prof.event()))

    run(batches[:1], False)  # warm-up (kernels, allocator)
    sync(dev)
    with SyncCounter(prof.current_stage, dev.type == "cuda") if prof else contextlib.nullcontext() as syncs:
        t0 = time.perf_counter()
        run(batches, True)
        sync(dev)
        dt = time.perf_counter() - t0
    tok = sum(len(s["input_ids"]) for b in batches for s in b)
    out = {"tokens": tok, "seconds": round(dt, 3), "tok_per_s": round(tok / dt, 1)}
    if prof:
        fw = [a.elapsed_time(b) / 1e3 for a, b in marks]
        idle = [marks[i - 1][1].elapsed_time(marks[i][0]) / 1e3 for i in range(1, len(marks))]
        out["profile"] = {"batches": len(batches), "host_s": {"forward": round(prof.host_s["forward"], 4)},
                          "syncs": syncs.as_dict()}
        if marks:
            out["profile"]["device_s"] = {"forward": round(sum(fw), 4), "idle": round(sum(idle), 4)}
            out["profile"]["batch_device_s"] = spread(fw, idle)
    return out


def fit_batches(batches, bytes_per_sample: int, directory: Path, keep: float = 0.7):
    """As many batches as fit in `keep` of the free space of `directory` (a small /dev/shm must not end the run)."""
    free = shutil.disk_usage(directory).free * keep
    out, used = [], 0
    for b in batches:
        need = bytes_per_sample * len(b)
        if used + need > free:
            break
        out.append(b)
        used += need
    return out


def staging_bytes(tokens: int, num_aux: int, hidden: int, dtype: str) -> int:
    """Bytes of the pinned staging buffer a batch of `tokens` real tokens needs (what CaptureRunner acquires)."""
    x = torch.empty(tokens, num_aux, hidden, device="meta")
    return staging_layout(to_store_dtype(x, x[:, 0], dtype))[1]


def pass_profile(prof: CaptureProfile | None, syncs: SyncCounter | None, writer: StoreWriter,
                 pool: PinnedPool | None) -> dict | None:
    """A capture pass's profile: the runner's stages, the store writer's split, the pinned pool, the host syncs."""
    if prof is None:
        return None
    out = prof.as_dict()
    out["store"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in writer.stats.items()}
    if pool is not None:
        out["pool"] = {"allocations": pool.allocated, "alloc_s": round(pool.alloc_s, 4),
                       "allocated_gb": round(pool.allocated_bytes / 1e9, 3)}
    out["syncs"] = syncs.as_dict()
    return out


def bench_capture(target: Target, layers, batches, directory: Path, dtype: str, shape: dict, shard_tokens: int,
                  queue_size: int, dev, tail: bool = True, writeback: bool = True, profile: bool = True,
                  split_last: bool = False) -> dict:
    """One timed capture pass. `tail`: tell the writer how many tokens are coming (StoreWriter.expect, what `hstap
    capture` does), so the shards shrink toward the end; False measures fixed-size shards. `writeback`: the writer
    starts each piece's writeback as soon as it is written (hstap.store.shard_file.START_WRITEBACK, the default).
    `profile`: where the pass's time goes (the module docstring). `split_last`: the last batch runs one sample at a
    time, so that the writer writes each while the GPU computes the next (what is left after the last forward: one
    sample's bytes instead of a batch's)."""
    directory.mkdir(parents=True, exist_ok=True)
    seq = len(batches[0][0]["input_ids"])
    bps = store_bytes_per_token(len(layers), target.hidden_size, dtype) * seq
    use = fit_batches(batches, bps, directory)
    if len(use) < 2:
        return {"skipped": f"not enough free space in {directory} ({shutil.disk_usage(directory).free / 1e9:.1f} GB)"}
    use = split_tail(use) if split_last else use
    out = Path(tempfile.mkdtemp(prefix="hstap-bench-store-", dir=directory))
    pool = PinnedPool() if dev.type == "cuda" else None
    prev, shard_file.START_WRITEBACK = shard_file.START_WRITEBACK, writeback
    try:
        w = StoreWriter(out / "warm", header(target, layers, dtype, shape), shard_tokens=shard_tokens)
        run_capture(target, layers, w, use[:1] + use[-1:], dtype=dtype, queue_size=queue_size, pool=pool)  # warm-up
        w.close()
        if pool is not None:
            # the staging buffers a long capture allocates in its first batches and then reuses: queue + copy + writer
            # + those held by the open shard (the store keeps views of them until the shard is committed), each of
            # the size a batch asks for
            batch_bytes = staging_bytes(max(map(_tokens, use)), len(layers), target.hidden_size, dtype)
            pool.reserve(batch_bytes, queue_size + 3 + -(-shard_tokens * bps // seq // batch_bytes))
        w = StoreWriter(out / "store", header(target, layers, dtype, shape), shard_tokens=shard_tokens)
        if tail:
            w.expect(sum(map(_tokens, use)))
        pinned_before = pool.allocated if pool is not None else 0
        prof = CaptureProfile(dev) if profile else None
        last = use[-1]
        marks = {}

        def progress(run, batch):
            if batch is last:  # when the GPU finished its last forward (the rest is the writer draining)
                sync(dev)
                marks["gpu_done"] = time.perf_counter()

        sync(dev)
        with SyncCounter(prof.current_stage, dev.type == "cuda") if prof else contextlib.nullcontext() as syncs:
            t0 = time.perf_counter()
            st = run_capture(target, layers, w, use, dtype=dtype, queue_size=queue_size, progress=progress,
                             pool=pool, profile=prof)
            w.close()  # the last shard is committed: every byte is on the sink
            dt = time.perf_counter() - t0
        gpu_s = marks["gpu_done"] - t0
        s = open_store(out / "store")
        tok = sum(int(e["tokens"]) for e in s.manifest["shards"])
        nbytes = sum(int(e["bytes"]) for e in s.manifest["shards"])
        return {"dir": str(directory), "dtype": dtype, "samples": len(s), "tokens": tok, "seconds": round(dt, 3),
                "tok_per_s": round(tok / dt, 1), "gb": round(nbytes / 1e9, 3), "gb_per_s": round(nbytes / 1e9 / dt, 3),
                "gpu_done_s": round(gpu_s, 3), "tok_per_s_until_gpu_done": round(tok / gpu_s, 1),
                "drain_s": round(dt - gpu_s, 3), "tail": tail, "writeback": writeback, "split_last": split_last,
                "shards": len(s.manifest["shards"]), "last_shard_tokens": int(s.manifest["shards"][-1]["tokens"]),
                "bytes_per_token": round(nbytes / tok, 2),
                "bytes_per_token_formula": store_bytes_per_token(len(layers), target.hidden_size, dtype),
                "gpu_waited_for_storage_s": round(st["writer_wait_s"], 3),
                "pinned_allocations_in_timed_run": st["pinned_allocations"] - pinned_before,
                "profile": pass_profile(prof, syncs, w, pool)}
    finally:
        shard_file.START_WRITEBACK = prev
        shutil.rmtree(out, ignore_errors=True)


def _tokens(batch) -> int:
    return sum(len(s["input_ids"]) for s in batch)


def split_tail(batches: list[list[dict]]) -> list[list[dict]]:
    """The same samples in the same order, the last batch split into one-sample batches."""
    return batches[:-1] + [[s] for s in batches[-1]]


def loss_vs_prefill(cap: dict, pre: dict) -> dict | None:
    """Where a capture pass lost time against the plain prefill (seconds; the prefill scaled to the pass's tokens):
    its forward ran slower, it ran extra device work (demux, convert), the compute stream sat idle longer between
    batches (the GPU waiting for the host), the writer drained after the GPU's last forward, and the rest (the start,
    the last batch's copy, clock noise). CUDA passes with a profile only."""
    dc = ((cap.get("profile") or {}).get("device_s"))
    dp = ((pre.get("profile") or {}).get("device_s"))
    if not dc or not dp or "seconds" not in cap:
        return None
    k = cap["tokens"] / pre["tokens"]
    parts = {"forward_slower": dc["forward"] - k * dp["forward"], "demux_convert": dc["demux"] + dc["convert"],
             "idle_more": dc["idle"] - k * dp["idle"], "drain": cap.get("drain_s", 0.0)}  # the CLI's clock: none
    lost = cap["seconds"] - k * pre["seconds"]
    parts["rest"] = lost - sum(parts.values())
    return {"lost_s": round(lost, 3), **{key: round(v, 3) for key, v in parts.items()},
            "of_prefill": {key: round(v / (k * pre["seconds"]), 4) for key, v in parts.items()}}


def batches_from_prepared(path: Path, batch_tokens: int) -> list[list[dict]]:
    """The samples of a prepared set (make_random_target.make_prepared's), packed like `hstap capture` packs them."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    rows = ds[:]
    samples = [{"id": i, "input_ids": torch.tensor(x, dtype=torch.long), "loss_mask": torch.tensor(m, dtype=torch.uint8)}
               for i, x, m in zip(rows["id"], rows["input_ids"], rows["loss_mask"])]
    return [[samples[i] for i in b] for b in pack_by_tokens([len(s["input_ids"]) for s in samples], batch_tokens)]


def bench_cli(target: Target, prepared: Path, work: Path, out: Path, dtype: str, batch_tokens: int, dev,
              profile: bool = True) -> dict:
    """`hstap capture` itself (capture_hf, in this process) of the prepared set, the target saved to `work` first:
    the CLI's own rate (its clock: first batch and pinned allocations included, the last shard's commit not), the
    whole call and the model load; profiled through the runner and the store writer it builds."""
    from hstap.capture.config import CaptureConfig

    tdir = work / "target"
    t0 = time.perf_counter()
    target.model.save_pretrained(str(tdir))
    save_s = time.perf_counter() - t0
    prof = CaptureProfile(dev) if profile else None
    made: dict = {}

    class Runner(runner_mod.CaptureRunner):  # the CLI's runner, with this pass's profile
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "profile": prof})
            made["pool"] = self.pool

    class Writer(driver_mod.StoreWriter):  # the CLI's store writer, kept for its stats
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["writer"] = self

    cfg = CaptureConfig(target=str(tdir), data=str(prepared), out=str(out), dtype=dtype, batch_tokens=batch_tokens,
                        device="cuda" if dev.type == "cuda" else "cpu", new=True)
    saved = runner_mod.CaptureRunner, driver_mod.StoreWriter
    runner_mod.CaptureRunner, driver_mod.StoreWriter = Runner, Writer
    try:
        with SyncCounter(prof.current_stage, dev.type == "cuda") if prof else contextlib.nullcontext() as syncs:
            t1 = time.perf_counter()
            summary = driver_mod.capture_hf(cfg)
            call_s = time.perf_counter() - t1
    finally:
        runner_mod.CaptureRunner, driver_mod.StoreWriter = saved
        shutil.rmtree(tdir, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return {"dir": str(out.parent), "dtype": dtype, "samples": summary["samples"], "tokens": summary["tokens"],
            "seconds": summary["seconds"], "tok_per_s": summary["tokens_per_s"], "load_s": summary["load_s"],
            "call_s": round(call_s, 3), "save_target_s": round(save_s, 3), "gb": summary["gb_written"],
            "bytes_per_token": round(summary["bytes_per_token"], 2),
            "gpu_waited_for_storage_s": summary["writer_wait_s"],
            "profile": pass_profile(prof, syncs, made["writer"], made.get("pool"))}


def bytes_check(target: Target, layers, batches, directory: Path, shape: dict, dev) -> dict:
    """The stores of `batches` (bf16 and fp8) written by this tree's capture, by the gather it replaced (demux always
    index_select'ing the real rows, also of a batch without padding) and with the last batch split into one-sample
    batches (split_tail): shard checksums equal to this tree's, per dtype."""
    real_demux = runner_mod.demux

    def gather(aux, final, rows):  # the old path: the real rows gathered even when they are all the rows
        B, T = aux.shape[:2]
        return real_demux(aux, final, torch.arange(B * T, device=aux.device) if rows is None else rows)

    directory.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="hstap-bench-bytes-", dir=directory))
    res = {}
    try:
        for dtype in ("bf16", "fp8"):
            sums = []
            for name, fn, bs in (("now", real_demux, batches), ("gather", gather, batches),
                                 ("split", real_demux, split_tail(batches))):
                runner_mod.demux = fn
                try:
                    with StoreWriter(out / f"{dtype}-{name}", header(target, layers, dtype, shape),
                                     shard_tokens=_tokens(batches[0])) as w:
                        run_capture(target, layers, w, bs, dtype=dtype)
                finally:
                    runner_mod.demux = real_demux
                sums.append([e["sha256"] for e in open_store(out / f"{dtype}-{name}").manifest["shards"]])
            res[dtype] = {"shards": len(sums[0]), "equal": sums[0] == sums[1], "split_last_equal": sums[0] == sums[2]}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return res


def bench_trace(target: Target, layers, batches, directory: Path, dtype: str, shape: dict, dev, out_dir: Path) -> dict:
    """torch.profiler over a capture of `batches` (after one warm-up batch): the chrome trace written to out_dir and
    the costliest ops (GPU time on CUDA, CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    directory.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="hstap-bench-trace-", dir=directory))
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        w = StoreWriter(store / "warm", header(target, layers, dtype, shape), shard_tokens=1 << 30)
        run_capture(target, layers, w, batches[:1], dtype=dtype)
        w.close()
        w = StoreWriter(store / "store", header(target, layers, dtype, shape), shard_tokens=1 << 30)
        sync(dev)
        with profile(activities=acts) as prof:
            run_capture(target, layers, w, batches, dtype=dtype)
            w.close()
            sync(dev)
        trace = out_dir / "capture_trace.json"
        prof.export_chrome_trace(str(trace))
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        ops = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0.0))[:15]
        return {"batches": len(batches), "trace": str(trace), "sort": key,
                "top_ops": [[e.key[:80], e.count, round(getattr(e, key, 0.0) / 1e3, 3)] for e in ops]}
    finally:
        shutil.rmtree(store, ignore_errors=True)


def bench_sink(directory: Path, gb: float, block_mb: int = 64) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(gb * 1e9)
    if shutil.disk_usage(directory).free * 0.7 < nbytes:
        nbytes = int(shutil.disk_usage(directory).free * 0.5)
    block = os.urandom(block_mb << 20)
    fd, path = tempfile.mkstemp(prefix="hstap-bench-sink-", dir=directory)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, block)
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return {"dir": str(directory), "gb": round(written / 1e9, 3), "seconds": round(dt, 3),
            "gb_per_s": round(written / 1e9 / dt, 3)}


def bench_json_vs_binary(tokens: int, hidden: int, dev: torch.device, directory: Path) -> dict:
    """SGLang's return_hidden_states transport for one sample vs ours, for the same (T, 3*H) bf16 tensor."""
    x = torch.randn(tokens, 3, hidden, device=dev, dtype=torch.bfloat16)  # (T, 3, H): 2 aux layers + final
    sync(dev)
    t0 = time.perf_counter()
    lst = x.reshape(tokens, 3 * hidden).cpu().tolist()  # what the scheduler does per request
    t_list = time.perf_counter() - t0
    body = json.dumps({"meta_info": {"hidden_states": [lst]}})  # what the HTTP response carries
    t_json = time.perf_counter() - t0
    json_bytes = len(body)
    del lst, body

    hdr = {"target": {}, "engine": {}, "dtype": "bf16", "layers": [0, 1], "hidden_size": hidden}
    out = Path(tempfile.mkdtemp(prefix="hstap-bench-bin-", dir=directory))
    pin = dev.type == "cuda"
    try:
        aux_h = torch.empty(tokens, 2, hidden, dtype=torch.bfloat16, pin_memory=pin)  # (T, 2, H): pooled in capture
        final_h = torch.empty(tokens, hidden, dtype=torch.bfloat16, pin_memory=pin)  # (T, H)
        times = []
        for rep in range(3):  # best of 3 (first includes page faults of the fresh buffers)
            w = StoreWriter(out / f"s{rep}", hdr, shard_tokens=1 << 30)
            sync(dev)
            t0 = time.perf_counter()
            aux_h.copy_(x[:, :2], non_blocking=pin)
            final_h.copy_(x[:, 2], non_blocking=pin)
            sync(dev)
            w.add("one", torch.zeros(tokens, dtype=torch.int32), torch.ones(tokens, dtype=torch.uint8), aux_h, final_h)
            w.flush()  # shard written, fsynced, committed
            times.append(time.perf_counter() - t0)
            w.close()
        t_bin = min(times)
        bin_bytes = sum(int(e["bytes"]) for e in open_store(out / "s0").manifest["shards"])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"tokens": tokens, "width": 3 * hidden, "tolist_s": round(t_list, 3), "tolist_json_s": round(t_json, 3),
            "json_mb": round(json_bytes / 1e6, 1), "binary_s": round(t_bin, 4), "binary_mb": round(bin_bytes / 1e6, 1),
            "binary_dir": str(directory), "speedup": round(t_json / t_bin, 1)}


VARIANTS = {"default": (True, True, False), "fixed": (False, True, False), "nowb": (True, False, False),
            "old": (False, False, False), "tailsplit": (True, True, True)}
"""--disk-variants: (tail shards, early writeback, the last batch one sample at a time) of each disk pass."""


def run_passes(a, res: dict, target, layers, batches, shape, dev, variants, disk_dtypes, sink_gb, work) -> None:
    """The measurements (a) to (h) into `res`, in this order: prefill, /dev/shm passes, /dev/shm sink, disk passes,
    disk sink, the trace, the CLI, the prefill again."""
    prof, shm = not a.no_profile, Path(a.shm_dir)
    res["prefill"] = bench_prefill(target, batches, dev, prof)
    res["bytes_check"] = bytes_check(target, layers, batches[:3], shm, shape, dev)
    common = dict(shape=shape, shard_tokens=a.shard_tokens, queue_size=a.queue_size, dev=dev, profile=prof)
    res["capture_shm_bf16"] = bench_capture(target, layers, batches, shm, "bf16", **common)
    if not a.no_fp8:
        res["capture_shm_fp8"] = bench_capture(target, layers, batches, shm, "fp8", **common)
    res["sink_shm"] = bench_sink(shm, sink_gb)
    disk = Path(a.disk_dir) if a.disk_dir else None
    if disk is not None:
        for dtype in disk_dtypes:
            for v in variants if dtype == "bf16" else ["default"]:
                tail, wb, split = VARIANTS[v]
                res[f"capture_disk_{dtype}" + ("" if v == "default" else f"_{v}")] = bench_capture(
                    target, layers, batches, disk, dtype, tail=tail, writeback=wb, split_last=split, **common)
        res["sink_disk"] = bench_sink(disk, sink_gb)
    if a.trace_batches > 0:
        res["trace"] = bench_trace(target, layers, batches[1:1 + a.trace_batches], shm, "bf16", shape, dev,
                                   Path(a.out_dir or a.shm_dir))
    if work is not None:
        res["cli"] = bench_cli(target, work / "prepared", work, (disk or shm) / f"hstap-bench-cli-store-{os.getpid()}",
                               "bf16", batches_tokens(batches), dev, prof)
    if a.repeat_prefill:
        res["prefill_again"] = bench_prefill(target, batches, dev, prof)
    if a.ab_mask_sync:
        with no_mask_sync():
            res["prefill_no_mask_sync"] = bench_prefill(target, batches, dev, prof)
            res["capture_shm_bf16_no_mask_sync"] = bench_capture(target, layers, batches, shm, "bf16", **common)


@contextlib.contextmanager
def no_mask_sync():
    """transformers' causal-mask construction without its packed-sequence check, the one host sync a forward makes
    (masking_utils.find_packed_sequence_indices reads `.all()` of a device tensor when neither a mask nor a cache is
    given). Exact here: the model builds its position ids with arange, never packed, so the check always answers
    None. A measurement only (--ab-mask-sync): what that sync costs a pass."""
    from transformers import masking_utils

    saved = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


def batches_tokens(batches) -> int:
    """The --batch-tokens budget that packs these (equal-length) samples the same way: the largest batch's tokens."""
    return max(map(_tokens, batches))


class Stopped(Exception):
    """SIGTERM during the passes."""


def _stop(signum, frame):
    raise Stopped(f"signal {signum}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    ap.add_argument("--device", default="auto", help="cuda | cpu | auto")
    ap.add_argument("--samples", type=int, default=None, help="samples per capture pass (default 512; tiny 16)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default 2048; tiny 128)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="tokens per batch (default 16384 = 8 x 2048)")
    ap.add_argument("--shard-tokens", type=int, default=32768, help="tokens per shard (32768 = 1 GiB for 8B bf16)")
    ap.add_argument("--queue-size", type=int, default=4)
    ap.add_argument("--shm-dir", default="/dev/shm", help="RAM-backed directory for (b)")
    ap.add_argument("--disk-dir", default=None, help="directory on a local disk for (c) and (d); skipped without it")
    ap.add_argument("--sink-gb", type=float, default=None, help="GB written for (d) (default 8; tiny 0.05)")
    ap.add_argument("--json-tokens", type=int, default=None, help="tokens of the JSON baseline sample (default 2048)")
    ap.add_argument("--json-hidden", type=int, default=None, help="hidden size of the JSON baseline (default 7168)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 capture pass")
    ap.add_argument("--disk-variants", default="default",
                    help="comma list of disk passes, run in this order: default (shards shrink at the end + early "
                         "writeback), fixed (fixed-size shards), nowb (no early writeback), old (neither), tailsplit "
                         "(default + the last batch one sample at a time)")
    ap.add_argument("--disk-dtypes", default="bf16",
                    help="store dtypes of the disk passes: bf16 (every --disk-variants pass) and/or fp8 (the default "
                         "writer), e.g. bf16,fp8: the fp8 store's half-size writes beside bf16's")
    ap.add_argument("--cli", action="store_true", help="(g): `hstap capture` itself on the same samples (a prepared "
                    "set written to --shm-dir; the target saved there before the pass)")
    ap.add_argument("--trace-batches", type=int, default=0, help="(h): torch.profiler over this many batches")
    ap.add_argument("--out-dir", default=None, help="where the trace goes (default: --shm-dir)")
    ap.add_argument("--repeat-prefill", action="store_true",
                    help="measure the plain prefill again after the capture passes (the baseline's own spread)")
    ap.add_argument("--no-profile", action="store_true", help="no per-stage profile, no sync counting")
    ap.add_argument("--no-json-baseline", action="store_true", help="skip (e), the return_hidden_states baseline")
    ap.add_argument("--ab-mask-sync", action="store_true",
                    help="the plain prefill and the bf16 /dev/shm capture again without the host sync transformers' "
                         "mask construction makes in every forward (no_mask_sync): what that sync costs")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    variants = a.disk_variants.split(",")
    bad = [v for v in variants if v not in VARIANTS] + [v for v in set(variants) if variants.count(v) > 1]
    if bad:
        ap.error(f"--disk-variants: unknown or repeated {bad} (choose from {', '.join(VARIANTS)})")
    disk_dtypes = a.disk_dtypes.split(",")
    if not disk_dtypes or any(d not in ("bf16", "fp8") for d in disk_dtypes):
        ap.error(f"--disk-dtypes: expected bf16 and/or fp8, got {a.disk_dtypes!r}")

    dev = torch.device(auto_device(a.device))
    shape = TINY if a.tiny else LLAMA_8B
    samples = a.samples or (16 if a.tiny else 512)
    seq = a.seq or (128 if a.tiny else 2048)
    batch_tokens = a.batch_tokens or 8 * seq
    sink_gb = a.sink_gb if a.sink_gb is not None else (0.05 if a.tiny else 8.0)
    json_tokens = a.json_tokens or (128 if a.tiny else 2048)
    json_hidden = a.json_hidden or (256 if a.tiny else 7168)
    # bf16 on the GPU (what serving runs); fp32 on the CPU, where bf16 matmuls are slow and the smoke test checks flow
    cdtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":  # --tiny: one thread (per-op overhead bound; OpenMP's spinning threads lose on a busy box)
        torch.set_num_threads(1 if a.tiny else max(1, min(4, os.cpu_count() or 1)))

    t_all = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                 "torch": torch.__version__, "compute_dtype": str(cdtype).replace("torch.", ""), "tiny": a.tiny,
                 "model": {k: shape[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                 "vocab_size")},
                 "samples": samples, "seq": seq, "batch_tokens": batch_tokens, "shard_tokens": a.shard_tokens}
    t0 = time.perf_counter()
    target = build_target(shape, dev, cdtype, a.seed)
    sync(dev)
    res["init_s"] = round(time.perf_counter() - t0, 2)
    layers = default_aux_layers(target.num_layers)
    res["layers"] = layers
    shm = Path(a.shm_dir)
    work = Path(tempfile.mkdtemp(prefix="hstap-bench-cli-", dir=shm)) if a.cli else None
    try:
        if work is not None:  # one prepared set: the CLI pass reads it, every other pass runs its samples
            from make_random_target import make_prepared

            res["prepared"] = make_prepared(work / "prepared", shape["vocab_size"], samples, seq,
                                            min(32000, shape["vocab_size"] // 2), a.seed, force=False)
            batches = batches_from_prepared(work / "prepared", batch_tokens)
        else:
            batches = make_batches(samples, seq, batch_tokens, shape["vocab_size"], a.seed)
        signal.signal(signal.SIGTERM, _stop)  # a `timeout` around the run: report what was measured
        run_passes(a, res, target, layers, batches, shape, dev, variants, disk_dtypes, sink_gb, work)
    except Stopped as e:
        res["stopped"] = str(e)
        print(f"bench_capture: stopped ({e}): the results so far", file=sys.stderr)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    del target, batches
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        res["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
    if "stopped" not in res and not a.no_json_baseline:
        res["json_vs_binary"] = bench_json_vs_binary(json_tokens, json_hidden, dev, shm)
    if "prefill" not in res:
        print(json.dumps(res, separators=(",", ":")))
        return res
    pre = res["prefill"]["tok_per_s"]
    for k in [k for k in res if k.startswith("capture_") or k == "cli"]:
        if "tok_per_s" in res[k]:
            base = res["prefill_no_mask_sync" if k.endswith("_no_mask_sync") else "prefill"]  # its own baseline
            res[k]["vs_prefill"] = round(res[k]["tok_per_s"] / base["tok_per_s"], 3)
            if "tok_per_s_until_gpu_done" in res[k]:
                res[k]["vs_prefill_until_gpu_done"] = round(res[k]["tok_per_s_until_gpu_done"] / base["tok_per_s"], 3)
            res[k]["loss_vs_prefill"] = loss_vs_prefill(res[k], base)
    if "prefill_no_mask_sync" in res:
        res["prefill_no_mask_sync"]["vs_prefill"] = round(res["prefill_no_mask_sync"]["tok_per_s"] / pre, 4)
    if "prefill_again" in res:
        res["prefill_spread"] = round(res["prefill_again"]["tok_per_s"] / pre - 1, 4)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    report(res)
    print(json.dumps(res, separators=(",", ":")))
    return res


def report(r: dict) -> None:
    m = r["model"]
    print(f"# hstap capture bench: {r['device']}, torch {r['torch']}, {r['compute_dtype']}; Llama shape "
          f"L{m['num_hidden_layers']} H{m['hidden_size']} I{m['intermediate_size']} V{m['vocab_size']}; "
          f"{r['samples']} x {r['seq']} tokens, batches of {r['batch_tokens']} tokens, layers {r['layers']}")
    print(f"{'measurement':40s} {'tok/s':>12s} {'vs prefill':>10s} {'GB/s':>8s} {'bytes/tok':>10s} {'formula':>8s}")
    p = r["prefill"]
    print(f"{'(a) plain prefill (no hooks)':40s} {p['tok_per_s']:12,.0f} {'1.000':>10s}")
    for key, label in (("capture_shm_bf16", "(b) capture bf16 -> /dev/shm"),
                       ("capture_shm_fp8", "(b) capture fp8 -> /dev/shm"),
                       ("capture_disk_bf16_old", "(c) capture bf16 -> disk, old writer"),
                       ("capture_disk_bf16_fixed", "(c) capture bf16 -> disk, fixed shards"),
                       ("capture_disk_bf16_nowb", "(c) capture bf16 -> disk, no writeback"),
                       ("capture_disk_bf16", "(c) capture bf16 -> disk"),
                       ("capture_disk_bf16_tailsplit", "(c) capture bf16 -> disk, last batch split"),
                       ("capture_disk_fp8", "(c) capture fp8 -> disk")):
        c = r.get(key)
        if c is None:
            continue
        if "skipped" in c:
            print(f"{label:40s} skipped: {c['skipped']}")
            continue
        print(f"{label:40s} {c['tok_per_s']:12,.0f} {c['vs_prefill']:10.3f} {c['gb_per_s']:8.2f} "
              f"{c['bytes_per_token']:10.1f} {c['bytes_per_token_formula']:8d}  drain {c['drain_s']:.2f} s, "
              f"{c['shards']} shards")
    for key, label in (("sink_shm", "(d) sequential write /dev/shm"), ("sink_disk", "(d) sequential write disk")):
        if key in r:
            print(f"{label:40s} {'':12s} {'':10s} {r[key]['gb_per_s']:8.2f}")
    if "cli" in r:
        c = r["cli"]
        print(f"{'(g) hstap capture (CLI), ' + c['dtype']:40s} {c['tok_per_s']:12,.0f} {c['vs_prefill']:10.3f} "
              f"{'':8s} {c['bytes_per_token']:10.1f} {'':8s}  its own clock; load {c['load_s']:.1f} s, whole call "
              f"{c['call_s']:.1f} s")
    if "prefill_again" in r:
        print(f"{'(a) plain prefill again':40s} {r['prefill_again']['tok_per_s']:12,.0f} "
              f"{1 + r['prefill_spread']:10.3f}")
    if "prefill_no_mask_sync" in r:
        c = r["capture_shm_bf16_no_mask_sync"]
        print(f"{'(a) plain prefill, no mask sync':40s} {r['prefill_no_mask_sync']['tok_per_s']:12,.0f} "
              f"{r['prefill_no_mask_sync']['vs_prefill']:10.3f}")
        print(f"{'(b) capture bf16 -> shm, no mask sync':40s} {c['tok_per_s']:12,.0f} {c['vs_prefill']:10.3f}  (vs "
              f"the prefill without it)")
    b = r.get("bytes_check") or {}
    print("stores of 3 batches, this tree's capture vs the gather it replaced / vs the last batch split: " + ", ".join(
        f"{d} {'bitwise equal' if v['equal'] else 'DIFFERENT'} / {'bitwise equal' if v['split_last_equal'] else 'DIFFERENT'}"
        f" ({v['shards']} shards)" for d, v in b.items()))
    report_profiles(r)
    if "trace" in r:
        t = r["trace"]
        print(f"(h) trace of {t['batches']} batches: {t['trace']}; by {t['sort']}: "
              + "; ".join(f"{n} {ms:.1f} ms" for n, _, ms in t["top_ops"][:5]))
    j = r.get("json_vs_binary")
    if j:
        print(f"(e) one {j['tokens']} x {j['width']} bf16 sample: .cpu().tolist() {j['tolist_s']:.2f} s, + json.dumps "
              f"{j['tolist_json_s']:.2f} s ({j['json_mb']:.0f} MB); binary D2H + store {j['binary_s'] * 1e3:.1f} ms "
              f"({j['binary_mb']:.0f} MB) -> {j['speedup']:,.0f}x")
    print(f"total {r['total_s']} s (model init {r['init_s']} s)")


def report_profiles(r: dict) -> None:
    """Where each pass's time goes (seconds): device stages (CUDA), host stages per thread, the store writer, syncs."""
    rows = [(k, r[k]) for k in r if (k.startswith("capture_") or k in ("prefill", "cli")) and isinstance(r[k], dict)
            and r[k].get("profile")]
    if not rows:
        return
    print("where the time goes (s): device = GPU time per stage (events); main/writer = host time per stage; store ="
          " the writer's flush, of which write / fsync / commit, hash in CPU s beside; syncs = launching thread's")
    for key, c in rows:
        pr = c["profile"]
        dev = " ".join(f"{k} {v:.3f}" for k, v in pr.get("device_s", {}).items())
        host = " ".join(f"{k} {v:.3f}" for k, v in pr["host_s"].items() if v)
        st = pr.get("store")
        store = (f" | store flush {st['flush_s']:.3f}: write {st['write_s']:.3f} fsync {st['fsync_s']:.3f} commit "
                 f"{st['commit_s']:.3f} (hash {st['hash_s']:.3f}, checks {st['prepare_s']:.3f})") if st else ""
        pool = f" | pin {pr['pool']['alloc_s']:.3f} s x{pr['pool']['allocations']}" if pr.get("pool") else ""
        print(f"  {key:26s} {('device ' + dev + ' | ') if dev else ''}host {host}{store}{pool} | syncs "
              f"{pr['syncs']['main_syncs']}")
        loss = c.get("loss_vs_prefill")
        if loss:
            print(f"  {'':26s} lost {loss['lost_s']:.3f} s vs prefill: " + ", ".join(
                f"{k} {v:+.3f} ({100 * loss['of_prefill'][k]:+.2f}%)" for k, v in loss.items()
                if k not in ("lost_s", "of_prefill")))


if __name__ == "__main__":
    main()
