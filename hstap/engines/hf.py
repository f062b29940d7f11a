"""The embedded engine: run a HF causal LM in this process and stream its hidden states into a store.

Capture is plain batched prefill. Samples are sorted by length and packed so that B * max_len <= batch_tokens,
right-padded, and run with causal attention and no mask: causality already keeps every real token from seeing the
padding after it, so the real rows equal those of the sample run alone (tests/test_capture_hf.py checks it against
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
pinned memory stays bounded. On the CPU the same pipeline runs with
plain tensors: the writer thread still overlaps disk writes with compute. An error in the writer thread (e.g. ENOSPC)
stops it and is raised in the main thread at its next call.

    from hstap.engines.hf import capture_batch
    from hstap.model_dir import load_target
    target, tok = load_target("models/Llama-3.1-8B-Instruct", device="cuda", dtype="bf16")
    [(aux, final)] = capture_batch(target, [ids], layers=[1, 15, 28])  # (T, K, H), (T, H)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence

import torch

from hstap.common import HstapError
from hstap.target import Target

_ALIGN = 512  # byte alignment of each tensor inside a pinned buffer (any dtype view stays aligned)
ZERO_COPY_MAX_SHARD = 4 << 30  # larger shards: copy batches out of pinned memory rather than pin a whole shard


# ---------------------------------------------------------------------------------------------------------------------
# Batching and demultiplexing


def batches_by_tokens(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length (descending, ties by index) and packed so that len(batch) * max_len <= batch_tokens.

    A sample longer than batch_tokens runs alone. Longest first: an out-of-memory shows up in the first batch."""
    if batch_tokens < 1:
        raise HstapError(f"--batch-tokens: must be >= 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # descending order: the first sample of `cur` is its longest
        if cur and (len(cur) + 1) * int(lengths[cur[0]]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _pad(seqs: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad with 0 -> (input_ids (B, T), rows (S,) flat indices b*T+t of the real tokens), both on `device`."""
    lens = [int(s.shape[0]) for s in seqs]
    B, T = len(seqs), max(lens)
    ids = torch.zeros(B, T, dtype=torch.long)  # (B, T); the pad id is irrelevant: causal attention hides it
    for b, s in enumerate(seqs):
        ids[b, : lens[b]] = s
    rows = torch.cat([torch.arange(L, dtype=torch.long) + b * T for b, L in enumerate(lens)])  # (S,)
    if device.type == "cuda":  # pinned + non_blocking: the host does not wait for the GPU to drain before each batch
        return ids.pin_memory().to(device, non_blocking=True), rows.pin_memory().to(device, non_blocking=True)
    return ids, rows


def forward_packed(target: Target, seqs: Sequence[torch.Tensor | Sequence[int]], layers: list[int]):
    """One right-padded batch -> (aux (S, K, H), final (S, H), lengths) with S = sum(lengths): real rows only, sample
    after sample, in the target's dtype and on its device."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if any(s.shape[0] == 0 for s in seqs):
        raise HstapError("capture: a sample has no tokens")
    ids, rows = _pad(seqs, target.device)
    aux, final, _ = target.capture(ids, layers)  # (B, T, K, H), (B, T, H)
    B, T, K, H = aux.shape
    aux = aux.reshape(B * T, K, H).index_select(0, rows)  # (S, K, H): padding rows dropped before any copy
    final = final.reshape(B * T, H).index_select(0, rows)  # (S, H)
    return aux, final, [int(s.shape[0]) for s in seqs]


@torch.no_grad()
def capture_batch(target: Target, samples: Sequence[torch.Tensor | Sequence[int]], layers: list[int],
                  batch_tokens: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synchronous capture for online training: per sample (aux (T, K, H), final (T, H)) on the target's device and
    dtype, in input order. With batch_tokens, the samples are split into length-sorted batches like offline capture."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in samples]
    groups = batches_by_tokens([s.shape[0] for s in seqs], batch_tokens) if batch_tokens else [list(range(len(seqs)))]
    out: list = [None] * len(seqs)
    for g in groups:
        if not g:
            continue
        aux, final, lens = forward_packed(target, [seqs[i] for i in g], layers)  # (S, K, H), (S, H)
        for i, a, f in zip(g, aux.split(lens), final.split(lens)):
            out[i] = (a, f)  # (T, K, H), (T, H) views of the packed batch
    return out


def to_store_dtype(aux: torch.Tensor, final: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """Packed (S, K, H), (S, H) -> the store's tensors, converted where they are (on the GPU, fp8 halves the D2H)."""
    if dtype == "fp8":
        from hstap.store import quantize_fp8

        aux_q, aux_scale = quantize_fp8(aux)  # (S, K, H) float8, (S, K) float32
        final_q, final_scale = quantize_fp8(final)  # (S, H) float8, (S,) float32
        return {"aux": aux_q, "final": final_q, "aux_scale": aux_scale.contiguous(),
                "final_scale": final_scale.contiguous()}
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if dt is None:
        raise HstapError(f"--dtype: expected bf16, fp8 or fp32, got {dtype!r}")
    return {"aux": aux.to(dt).contiguous(), "final": final.to(dt).contiguous()}


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline


class PinnedPool:
    """Pinned host buffers (uint8), reused: `acquire` hands out the smallest free buffer that is large enough, else
    allocates one rounded up to 1/16 of its power of two (pinning is slow: a long capture allocates its few buffers in
    the first batches and then only reuses them). Released buffers are kept until a request larger than all of them
    comes (then the free ones are dropped), so growing requests do not pile up pinned memory. Thread-safe."""

    def __init__(self, pin: bool = True):
        self.pin = pin  # False: plain host memory (the same reuse policy, testable without a GPU)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0  # pinned allocations made (a reuse costs nothing)

    @staticmethod
    def capacity(nbytes: int) -> int:
        step = max(1 << 20, 1 << max(0, max(1, nbytes).bit_length() - 4))
        return -(-max(1, nbytes) // step) * step

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            # requests grew past every free buffer: let the smaller ones go (unpinned) rather than keep them forever
            self._free.clear()
            self.allocated += 1
        return torch.empty(self.capacity(nbytes), dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def reserve(self, nbytes: int, count: int) -> None:
        """Make sure `count` free buffers of >= nbytes exist (allocate them ahead of a timed or latency-bound run)."""
        bufs = [self.acquire(nbytes) for _ in range(count)]
        for b in bufs:
            self.release(b)


def staging_layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[int, int, torch.dtype, tuple]], int]:
    """Byte offsets of each tensor in one buffer (aligned), and the total size."""
    out, off = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        out[name] = (off, n, t.dtype, tuple(t.shape))
        off += -(-n // _ALIGN) * _ALIGN
    return out, off


def staging_pack(buf: torch.Tensor, tensors: dict[str, torch.Tensor], layout: dict, non_blocking: bool = False) -> None:
    """Copy each tensor's raw bytes (any dtype, fp8 included) to its place in the uint8 buffer `buf`."""
    for name, t in tensors.items():
        o, n, _, _ = layout[name]
        buf[o: o + n].copy_(t.view(torch.uint8).reshape(-1), non_blocking=non_blocking)


def staging_views(buf: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    return {name: buf[o: o + n].view(dt).view(shape) for name, (o, n, dt, shape) in layout.items()}


class CaptureRunner:
    """Batches in, samples committed to a `StoreWriter` by a writer thread (see the module docstring).

        with CaptureRunner(target, layers, writer, dtype="bf16") as run:
            for batch in batches:            # batch: list of {"id", "input_ids", "loss_mask"}
                run.submit(batch)
        # leaving the block waits for the writer thread; the caller then closes the StoreWriter

    `submit` returns once the batch's forward pass is queued (CUDA) or done (CPU); the writer thread owns the
    StoreWriter until `close()`. `samples`, `tokens`, `bytes` count what the writer thread has handed to the store."""

    def __init__(self, target: Target, layers: list[int], writer, dtype: str = "bf16", queue_size: int = 4,
                 pool: PinnedPool | None = None):
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
        aux, final, _ = forward_packed(self.target, seqs, self.layers)  # (S, K, H), (S, H)
        payload = to_store_dtype(aux, final, self.dtype)  # name -> (S, ...) on the device
        del aux, final
        if self.cuda:
            item = self._copy_to_host(payload, metas)
        else:
            item = (None, None, payload, metas)
        self.submitted_tokens += sum(m["len"] for m in metas)
        self._put(item)

    def _copy_to_host(self, payload: dict[str, torch.Tensor], metas: list[dict]):
        layout, nbytes = staging_layout(payload)
        buf = self.pool.acquire(nbytes)  # (cap,) uint8, pinned
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)  # payload is complete on the compute stream once this fires
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)  # the side stream waits; the compute stream goes on with the next batch
            staging_pack(buf, payload, layout, non_blocking=True)  # D2H into pinned memory: truly asynchronous
            for t in payload.values():
                t.record_stream(self.side)  # the allocator must not reuse t's memory before this copy has run
            done = torch.cuda.Event(blocking=True)  # blocking: the writer thread sleeps instead of spinning a core
            done.record(self.side)
        return (done, buf, layout, metas)

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
            done, buf, tensors, metas = item
            try:
                if done is not None:
                    done.synchronize()  # the D2H copy into buf has landed (also before a discard: buf is reused)
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
                        nbytes = max(o + n for o, n, _, _ in tensors.values())
                        tensors = staging_views(buf[:nbytes].clone(), tensors)  # (nbytes,) pageable copy
                        self.pool.release(buf)
                        buf = None
                        self._write(tensors, metas)
                elif self._error is None and not self._abort:
                    self._write(tensors, metas)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                if self._error is None:
                    self._error = e
                if buf is not None:
                    self.pool.release(buf)  # only when it never reached the store (synchronize failed)

    def _write(self, t: dict[str, torch.Tensor], metas: list[dict]) -> None:
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
                queue_size: int = 4, progress=None, pool: PinnedPool | None = None) -> dict:
    """Drive a CaptureRunner over `batches` (lists of sample dicts) into `writer`; returns counts and timings.

    `progress(runner, batch)` is called after each submitted batch. The caller closes the writer (which commits the
    last shard)."""
    t0 = time.perf_counter()
    with CaptureRunner(target, layers, writer, dtype=dtype, queue_size=queue_size, pool=pool) as run:
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
