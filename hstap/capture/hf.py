"""The embedded engine: run a HF causal LM in this process and stream its hidden states into a store.

`capture_hf(cfg)` is `hstap capture --engine hf` (the default): under torchrun each rank takes the rows
rank::world_size of the prepared set that the store does not hold yet, runs its own copy of the model (hstap/dist.py
reads torchrun's environment and picks cuda:LOCAL_RANK) and writes its own shards; rank 0 prints the totals.

Capture is plain batched prefill. Samples are sorted by length and packed so that B * max_len <= batch_tokens,
right-padded, and run with causal attention and no mask: causality already keeps every real token from seeing the
padding after it, so the real rows equal those of the sample run alone (tests/capture/test_hf.py checks it against
`output_hidden_states`).
Hooks (`Target.capture`) keep only the K tapped layers instead of all N+1 hidden states; padding rows are dropped on the
device before anything is copied, so nothing padded is ever stored.

The pipeline (`CaptureRunner`) keeps the GPU busy while storage works:

    main thread:  forward(batch i) -> demux real rows -> convert to the store dtype on the GPU (fp8: half the D2H)
                  -> event on the compute stream -> side stream waits on it, copies into a pinned buffer -> done event
                  -> queue.put((done, buffer, samples))           (blocks only when `queue_size` batches are waiting)
    writer thread: done.synchronize() -> StoreWriter.add() per sample, views of the pinned buffer (commits shards)
                   -> the buffer goes back to the pool once the shard holding its last sample is committed

The compute stream never waits for the copy (the side stream does). The store keeps added tensors by reference until
their shard is written, so handing it views of the pinned buffer saves a host copy of every byte; the pool then holds
about queue_size + 2 + shard_bytes / batch_bytes buffers, allocated in the first batches and reused (pinning is slow).
With shards larger than `ZERO_COPY_MAX_SHARD` bytes the writer copies each batch out of its pinned buffer instead, so
pinned memory stays bounded. The pool, the byte layout of a buffer and the store-dtype conversion are
capture/staging.py's (the SGLang hook stages its copies the same way). On the CPU the same pipeline runs with plain
tensors: the writer thread still overlaps disk writes with compute. An error in the writer thread (e.g. ENOSPC) stops
it and is raised in the main thread at its next call.

    from hstap.capture.hf import capture_batch
    from hstap.artifacts.model_dir import load_target
    target, tok = load_target("models/Llama-3.1-8B-Instruct", device="cuda", dtype="bf16")
    [(aux, final)] = capture_batch(target, [ids], layers=[1, 15, 28])  # (T, K, H), (T, H)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence

import torch

from hstap import dist as D
from hstap.batching import pack_by_tokens
from hstap.capture.config import CaptureConfig
from hstap.capture.inputs import check_out, copy_vocab_map, progress_bar, resolve, store_totals
from hstap.capture.profile import NO_PROFILE, CaptureProfile
from hstap.capture.staging import (PinnedPool, staging_layout, staging_nbytes, staging_pack, staging_views,
                                   to_store_dtype)
from hstap.common import HstapError, write_run_config
from hstap.data.prepare import prepared_columns
from hstap.artifacts.model_dir import load_target
from hstap.device import resolve_dtype
from hstap.models.target import Target
from hstap.store.manifest import committed_ids_of
from hstap.store.writer import StoreWriter

ZERO_COPY_MAX_SHARD = 4 << 30  # larger shards: copy batches out of pinned memory rather than pin a whole shard


# ---------------------------------------------------------------------------------------------------------------------
# Batching and demultiplexing


def _pad(seqs: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad with 0 -> (input_ids (B, T), rows (S,) flat indices b*T+t of the real tokens, or None when every
    sample has T tokens), both on `device`."""
    lens = [int(s.shape[0]) for s in seqs]
    B, T = len(seqs), max(lens)
    ids = torch.zeros(B, T, dtype=torch.long)  # (B, T); the pad id is irrelevant: causal attention hides it
    for b, s in enumerate(seqs):
        ids[b, : lens[b]] = s
    rows = None
    if sum(lens) < B * T:
        rows = torch.cat([torch.arange(L, dtype=torch.long) + b * T for b, L in enumerate(lens)])  # (S,)
    if device.type == "cuda":  # pinned + non_blocking: the host does not wait for the GPU to drain before each batch
        ids = ids.pin_memory().to(device, non_blocking=True)
        rows = rows.pin_memory().to(device, non_blocking=True) if rows is not None else None
    return ids, rows


def demux(aux: torch.Tensor, final: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, K, H), (B, T, H) -> the real rows, sample after sample: (S, K, H), (S, H). Padding rows are dropped on
    the device before anything is copied; a batch without padding (rows None) is only reshaped (no copy)."""
    B, T, K, H = aux.shape
    aux, final = aux.reshape(B * T, K, H), final.reshape(B * T, H)
    if rows is None:
        return aux, final
    return aux.index_select(0, rows), final.index_select(0, rows)


def forward_packed(target: Target, seqs: Sequence[torch.Tensor | Sequence[int]], layers: list[int]):
    """One right-padded batch -> (aux (S, K, H), final (S, H), lengths) with S = sum(lengths): real rows only, sample
    after sample, in the target's dtype and on its device."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if any(s.shape[0] == 0 for s in seqs):
        raise HstapError("capture: a sample has no tokens")
    ids, rows = _pad(seqs, target.device)
    aux, final, _ = target.capture(ids, layers)  # (B, T, K, H), (B, T, H)
    aux, final = demux(aux, final, rows)  # (S, K, H), (S, H)
    return aux, final, [int(s.shape[0]) for s in seqs]


@torch.no_grad()
def capture_batch(target: Target, samples: Sequence[torch.Tensor | Sequence[int]], layers: list[int],
                  batch_tokens: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synchronous capture for online training: per sample (aux (T, K, H), final (T, H)) on the target's device and
    dtype, in input order. With batch_tokens, the samples are split into length-sorted batches like offline capture."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in samples]
    groups = pack_by_tokens([s.shape[0] for s in seqs], batch_tokens) if batch_tokens else [list(range(len(seqs)))]
    out: list = [None] * len(seqs)
    for g in groups:
        if not g:
            continue
        aux, final, lens = forward_packed(target, [seqs[i] for i in g], layers)  # (S, K, H), (S, H)
        for i, a, f in zip(g, aux.split(lens), final.split(lens)):
            out[i] = (a, f)  # (T, K, H), (T, H) views of the packed batch
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline


class CaptureRunner:
    """Batches in, samples committed to a `StoreWriter` by a writer thread (see the module docstring).

        with CaptureRunner(target, layers, writer, dtype="bf16") as run:
            for batch in batches:            # batch: list of {"id", "input_ids", "loss_mask"}
                run.submit(batch)
        # leaving the block waits for the writer thread; the caller then closes the StoreWriter

    `submit` returns once the batch's forward pass is queued (CUDA) or done (CPU); the writer thread owns the
    StoreWriter until `close()`. `samples`, `tokens`, `bytes` count what the writer thread has handed to the store."""

    def __init__(self, target: Target, layers: list[int], writer, dtype: str = "bf16", queue_size: int = 4,
                 pool: PinnedPool | None = None, profile: CaptureProfile | None = None):
        if queue_size < 1:
            raise HstapError(f"--queue-size: must be >= 1, got {queue_size}")
        self.target, self.layers, self.writer, self.dtype = target, list(layers), writer, dtype
        self.device = target.device
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.vocab_size = int(target.vocab_size)
        self.pool = (pool or PinnedPool()) if self.cuda else None
        # the CPU path hands the store its own tensors: nothing to copy either way
        self.zero_copy = self.cuda and zero_copy_ok(writer)
        self.side = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.prof = profile or NO_PROFILE  # where the time goes, stage by stage (capture/profile.py)
        self.samples = self.tokens = self.bytes = 0
        self.submitted_tokens = 0
        self.writer_wait_s = 0.0  # time the main thread spent blocked on a full queue (the GPU waiting for storage)
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._abort = False
        self._closed = False
        self._thread = threading.Thread(target=self._writer_loop, name="hstap-capture-writer", daemon=True)
        self._thread.start()

    # -- main thread ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def submit(self, samples: list[dict]) -> None:
        """Capture one batch: samples are dicts with "id", "input_ids" (list/1-D tensor), "loss_mask" (same length)."""
        self._raise_if_failed()
        if not samples:
            return
        prof = self.prof
        with prof.stage("inputs"):
            seqs, metas = self._inputs(samples)
        f0 = prof.event()
        with prof.stage("forward"):
            ids, rows = _pad(seqs, self.device)
            aux, final, _ = self.target.capture(ids, self.layers)  # (B, T, K, H), (B, T, H)
        f1 = prof.event()
        with prof.stage("demux"):
            aux, final = demux(aux, final, rows)  # (S, K, H), (S, H)
        dm = prof.event()
        with prof.stage("convert"):
            payload = to_store_dtype(aux, final, self.dtype)  # name -> (S, ...) on the device
        del aux, final
        with prof.stage("copy"):
            item = self._copy_to_host(payload, metas, (f0, f1, dm)) if self.cuda else (None, None, payload, metas, None)
        self.submitted_tokens += sum(m["len"] for m in metas)
        with prof.stage("queue"):
            self._put(item)

    def _inputs(self, samples: list[dict]) -> tuple[list[torch.Tensor], list[dict]]:
        """The batch's token ids (T,) each and the metadata the store gets, after checking every sample."""
        seqs, metas = [], []
        for s in samples:
            ids = torch.as_tensor(s["input_ids"], dtype=torch.long).reshape(-1)  # (T,)
            mask = torch.as_tensor(s["loss_mask"], dtype=torch.uint8).reshape(-1)  # (T,)
            if ids.numel() == 0:
                raise HstapError(f"sample {s['id']!r}: no tokens")
            if mask.shape != ids.shape:
                raise HstapError(f"sample {s['id']!r}: loss_mask has {mask.numel()} entries for {ids.numel()} tokens")
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:  # out of range is a device assert on CUDA: say it here instead
                bad = hi if hi >= self.vocab_size else lo
                raise HstapError(f"sample {s['id']!r}: token id {bad} is outside the target's vocabulary "
                                 f"(0..{self.vocab_size - 1}); was the data prepared with another tokenizer?")
            seqs.append(ids)
            metas.append({"id": str(s["id"]), "input_ids": ids.to(torch.int32), "loss_mask": mask,
                          "len": int(ids.numel())})
        return seqs, metas

    def _copy_to_host(self, payload: dict[str, torch.Tensor], metas: list[dict], marks: tuple):
        """Queue item of a batch on CUDA: (done event, pinned buffer, its layout, metas, profile marks or None)."""
        layout, nbytes = staging_layout(payload)
        buf = self.pool.acquire(nbytes)  # (cap,) uint8, pinned
        compute = torch.cuda.current_stream(self.device)
        timing = self.prof.cuda  # profiling: timing events (capture/profile.py reads them in the writer thread)
        ready = torch.cuda.Event(enable_timing=timing)
        ready.record(compute)  # payload is complete on the compute stream once this fires
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)  # the side stream waits; the compute stream goes on with the next batch
            c0 = self.prof.event()
            staging_pack(buf, payload, layout, non_blocking=True)  # D2H into pinned memory: truly asynchronous
            for t in payload.values():
                t.record_stream(self.side)  # the allocator must not reuse t's memory before this copy has run
            done = torch.cuda.Event(enable_timing=timing, blocking=True)  # blocking: the writer thread sleeps
            done.record(self.side)
        return (done, buf, layout, metas, (*marks, ready, c0, done) if timing else None)

    def _put(self, item) -> None:
        t0 = time.perf_counter()
        while True:
            try:
                self._q.put(item, timeout=0.5)
                break
            except queue.Full:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise HstapError("capture: the writer thread stopped unexpectedly")
        self.writer_wait_s += time.perf_counter() - t0
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            if isinstance(err, HstapError):
                raise HstapError(str(err)) from err
            if isinstance(err, OSError):
                raise HstapError(f"{getattr(self.writer, 'path', 'store')}: writing failed: {err}") from err
            raise RuntimeError(f"capture writer thread failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Wait until every submitted batch is handed to the store; re-raise a writer error."""
        if not self._closed:
            self._closed = True
            self._q.put(None)
            self._thread.join()
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop without writing what is still queued (an exception in the main thread); never raises."""
        self._abort = True
        if not self._closed:
            self._closed = True
            self._q.put(None)  # the writer drains (and discards) the queue, so this cannot block for long
            self._thread.join()

    def __enter__(self) -> CaptureRunner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- writer thread -------------------------------------------------------------------------------------------------

    def _writer_loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            done, buf, tensors, metas, marks = item
            try:
                if done is not None:
                    with self.prof.stage("wait_copy"):
                        done.synchronize()  # the D2H copy into buf has landed (also before a discard: buf is reused)
                    self.prof.batch_done(marks)
                    if self._error is not None or self._abort:
                        self.pool.release(buf)
                        continue
                    if self.zero_copy:
                        # the store keeps what it is given until the shard is written: hand it views of the pinned
                        # buffer itself (no host copy) and take the buffer back once that shard is committed
                        tensors, owned, buf = staging_views(buf, tensors), buf, None
                        self._write(tensors, metas)
                        self.writer.when_written(lambda b=owned: self.pool.release(b))
                    else:
                        nbytes = staging_nbytes(tensors)
                        tensors = staging_views(buf[:nbytes].clone(), tensors)  # (nbytes,) pageable copy
                        self.pool.release(buf)
                        buf = None
                        self._write(tensors, metas)
                elif self._error is None and not self._abort:
                    self.prof.batch_done(None)
                    self._write(tensors, metas)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                if self._error is None:
                    self._error = e
                if buf is not None:
                    self.pool.release(buf)  # only when it never reached the store (synchronize failed)

    def _write(self, t: dict[str, torch.Tensor], metas: list[dict]) -> None:
        with self.prof.stage("store"):
            self._add_samples(t, metas)

    def _add_samples(self, t: dict[str, torch.Tensor], metas: list[dict]) -> None:
        off = 0
        fp8 = "aux_scale" in t
        for m in metas:
            L = m["len"]
            sl = slice(off, off + L)
            self.writer.add(m["id"], m["input_ids"], m["loss_mask"], t["aux"][sl], t["final"][sl],  # (T, K, H), (T, H)
                            aux_scale=t["aux_scale"][sl] if fp8 else None,  # (T, K)
                            final_scale=t["final_scale"][sl] if fp8 else None)  # (T,)
            off += L
            self.samples += 1
            self.tokens += L
            self.bytes += sum(x[sl].numel() * x.element_size() for x in t.values()) + 5 * L  # + int32 ids, u8 mask


def zero_copy_ok(writer) -> bool:
    """Whether the CUDA path may hand `writer` views of its pinned buffers (held until the shard commits): only when a
    full shard fits in ZERO_COPY_MAX_SHARD bytes. A writer without `shard_limit_bytes` / `when_written` gets copies."""
    shard = getattr(writer, "shard_limit_bytes", None)
    return shard is not None and shard <= ZERO_COPY_MAX_SHARD and hasattr(writer, "when_written")


def run_capture(target: Target, layers: list[int], writer, batches: Iterable[list[dict]], dtype: str = "bf16",
                queue_size: int = 4, progress=None, pool: PinnedPool | None = None,
                profile: CaptureProfile | None = None) -> dict:
    """Drive a CaptureRunner over `batches` (lists of sample dicts) into `writer`; returns counts and timings.

    `progress(runner, batch)` is called after each submitted batch. The caller closes the writer (which commits the
    last shard). `profile`: where the time goes (hstap.capture.profile)."""
    t0 = time.perf_counter()
    with CaptureRunner(target, layers, writer, dtype=dtype, queue_size=queue_size, pool=pool, profile=profile) as run:
        for batch in batches:
            run.submit(batch)
            if progress is not None:
                progress(run, batch)
    if run.cuda:
        torch.cuda.synchronize(run.device)
    dt = time.perf_counter() - t0
    return {"samples": run.samples, "tokens": run.tokens, "bytes": run.bytes, "seconds": dt,
            "writer_wait_s": run.writer_wait_s, "pinned_allocations": run.pool.allocated if run.pool else 0,
            "zero_copy": run.zero_copy}


# ---------------------------------------------------------------------------------------------------------------------
# `hstap capture --engine hf`


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
