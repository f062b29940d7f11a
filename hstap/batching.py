"""Batching: the one greedy token-budget packing (`pack_by_tokens`, used by capture and training), and over a `Store`
(or a prepared set) the length-bucketed batch sampler (rank-aware, resumable), collate, and the trainer's endless batch
stream and eval batches.

    sampler = BucketBatchSampler(store.lengths, batch_tokens=16384, seed=0, rank=rank, world_size=world)
    loader = DataLoader(store, batch_sampler=sampler, collate_fn=collate)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from hstap.common import HstapError


def pack_by_tokens(lengths: Sequence[int], batch_tokens: int, order: Iterable[int] | None = None) -> list[list[int]]:
    """Indices cut greedily, in `order`, into batches with len(batch) * max_len <= batch_tokens; a sample longer than
    batch_tokens goes alone.

    order None: by length descending, ties by index (capture's order: an out-of-memory shows up in the first batch)."""
    if batch_tokens < 1:
        raise HstapError(f"--batch-tokens: must be >= 1, got {batch_tokens}")
    if order is None:
        order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        L = int(lengths[i])
        if cur and (len(cur) + 1) * max(cur_max, L) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    return batches


class BucketBatchSampler(torch.utils.data.Sampler):
    """Yields lists of indices of similar length with B * max_len <= batch_tokens (a longer sample goes alone).

    Per epoch: sort by length (ties broken by a permutation seeded by (seed, epoch)), cut greedily into batches, shuffle
    the batch order (shuffle=True), then deal batches round-robin to ranks. Every rank gets the same number of batches:
    the list is padded by repeating batches from its start (drop_last=True drops the remainder instead). The batch
    partition of lengths does not depend on the epoch, so `len()` is fixed.

    Resuming mid-epoch: save your own count of batches trained and call `set_epoch(e); skip(n)` (what the trainer
    does). A count kept by the sampler would not do: with a DataLoader that prefetches (num_workers > 0) the sampler
    runs ahead of training.
    """

    def __init__(self, lengths: Sequence[int], batch_tokens: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if batch_tokens < 1:
            raise HstapError(f"batch_tokens: must be >= 1, got {batch_tokens}")
        if not 0 <= rank < world_size:
            raise HstapError(f"sampler: rank {rank} is out of range for world_size {world_size}")
        self.batch_tokens, self.shuffle, self.seed = batch_tokens, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch, self._skip = 0, 0
        self._len = len(self._rank_batches(0))

    def _batches(self, epoch: int) -> list[list[int]]:
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, epoch])
        if self.shuffle:
            order = np.lexsort((rng.permutation(n), self.lengths))  # by length, random among equal lengths
        else:
            order = np.argsort(self.lengths, kind="stable")
        batches = pack_by_tokens(self.lengths, self.batch_tokens, order.tolist())
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return batches

    def _rank_batches(self, epoch: int) -> list[list[int]]:
        b, ws = self._batches(epoch), self.world_size
        if self.drop_last:
            b = b[: len(b) // ws * ws]
        elif b and len(b) % ws:
            b = b + [b[j % len(b)] for j in range(ws - len(b) % ws)]
        return b[self.rank::ws]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._rank_batches(self.epoch)
        start, self._skip = self._skip, 0
        yield from batches[start:]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def skip(self, n: int) -> None:
        """The next `__iter__` (of the current epoch) starts after this rank's first n batches."""
        self._skip = int(n)


def collate(samples: list[dict]) -> dict:
    """Right-pad a list of `Store` samples with 0 into batch tensors (plus `lengths` (B,) and `ids`). Samples without
    "aux"/"final" (prepared rows, for online training) give input_ids and loss_mask only."""
    B = len(samples)
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    T = max(lengths)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long),  # (B, T)
           "loss_mask": torch.zeros(B, T, dtype=torch.long)}  # (B, T)
    if "aux" in samples[0]:
        _, K, H = samples[0]["aux"].shape
        out["aux"] = torch.zeros(B, T, K, H, dtype=samples[0]["aux"].dtype)  # (B, T, K, H)
        out["final"] = torch.zeros(B, T, H, dtype=samples[0]["final"].dtype)  # (B, T, H)
    for b, (s, n) in enumerate(zip(samples, lengths)):
        for k in out:
            out[k][b, :n] = s[k]
    out["lengths"] = torch.tensor(lengths, dtype=torch.long)  # (B,)
    out["ids"] = [s["id"] for s in samples]
    return out


class Rows(torch.utils.data.Dataset):
    """A subset of a store (samples with aux/final) or of a prepared set (ids and loss mask only), as tensors."""

    def __init__(self, src, indices: list[int], prepared: bool):
        self.src, self.indices, self.prepared = src, indices, prepared

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, j):
        r = self.src[self.indices[j]]
        if self.prepared:
            return {"id": r["id"], "input_ids": torch.tensor(r["input_ids"], dtype=torch.long),
                    "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.long)}
        return r


class TrainBatches:
    """Endless micro-batches of this rank, epoch after epoch; `epoch`/`done` give the position after the last one."""

    def __init__(self, rows: Rows, lengths: list[int], batch_tokens: int, seed: int, rank: int, world: int,
                 epoch: int, done: int, pin: bool, workers: int, collate_fn=collate):
        self.rows, self.pin, self.workers, self.collate_fn = rows, pin, workers, collate_fn
        self.sampler = BucketBatchSampler(lengths, batch_tokens, shuffle=True, seed=seed, rank=rank, world_size=world)
        if len(self.sampler) == 0:
            raise HstapError(f"train: the training split is empty ({len(lengths)} samples)")
        self.epoch, self.done = epoch, done

    def __iter__(self):
        while True:
            if self.done >= len(self.sampler):
                self.epoch, self.done = self.epoch + 1, 0
            self.sampler.set_epoch(self.epoch)
            self.sampler.skip(self.done)
            loader = torch.utils.data.DataLoader(self.rows, batch_sampler=self.sampler, collate_fn=self.collate_fn,
                                                 num_workers=self.workers, pin_memory=self.pin)
            for batch in loader:
                self.done += 1
                yield batch


def eval_batches(lengths: list[int], batch_tokens: int, rank: int, world: int) -> list[tuple[list[int], bool]]:
    """This rank's eval batches and whether each is real: every rank runs the same number (FSDP needs it), the padding
    repeats are run but not counted."""
    if not lengths:
        return []
    n = len(BucketBatchSampler(lengths, batch_tokens, shuffle=False))
    mine = list(BucketBatchSampler(lengths, batch_tokens, shuffle=False, rank=rank, world_size=world))
    return [(b, j * world + rank < n) for j, b in enumerate(mine)]
