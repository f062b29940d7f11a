"""The embedded engine's pipeline (`CaptureRunner`): batches in, through the forward (`hstap.capture.hf.forward`), into
a store by a writer thread, keeping the GPU busy while storage works:

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
capture/staging.py's (the SGLang hook stages its copies the same way); the queue and its back-pressure are
capture/writer_queue.py's. On the CPU the same pipeline runs with plain tensors: the writer thread still overlaps disk
writes with compute. An error in the writer thread (e.g. ENOSPC) stops it and is raised in the main thread at its next
call.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from hstap.capture.hf.forward import demux, right_pad
from hstap.capture.profile import NO_PROFILE, CaptureProfile
from hstap.capture.staging import (PinnedPool, staging_layout, staging_nbytes, staging_pack, staging_views,
                                   to_store_dtype)
from hstap.capture.writer_queue import WriterQueue
from hstap.common import HstapError
from hstap.models.target import Target

ZERO_COPY_MAX_SHARD = 4 << 30  # larger shards: copy batches out of pinned memory rather than pin a whole shard


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
        self.queue = WriterQueue(queue_size, self._writer_loop, "hstap-capture-writer", poll_s=0.5)
        self._error: BaseException | None = None
        self._abort = False
        self._closed = False
        self.queue.start()

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
            ids, rows = right_pad(seqs, self.device)
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
        if not self.queue.put(item, check=self._raise_if_failed):  # back-pressure: waits while the writer is behind
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
            self.queue.close()
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop without writing what is still queued (an exception in the main thread); never raises."""
        self._abort = True
        if not self._closed:
            self._closed = True
            self.queue.close()  # the writer drains (and discards) the queue, so this cannot block for long

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
            item = self.queue.items.get()
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
