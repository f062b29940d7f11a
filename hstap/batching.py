"""Training-side batching over a `Store`: length-bucketed batch sampler (rank-aware, resumable) and collate.

    sampler = BucketBatchSampler(store.lengths, batch_tokens=16384, seed=0, rank=rank, world_size=world)
    loader = DataLoader(store, batch_sampler=sampler, collate_fn=collate)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from hstap.common import HstapError


class BucketBatchSampler(torch.utils.data.Sampler):
    """Yields lists of indices of similar length with B * max_len <= batch_tokens (a longer sample goes alone).

    Per epoch: sort by length (ties broken by a permutation seeded by (seed, epoch)), cut greedily into batches, shuffle
    the batch order (shuffle=True), then deal batches round-robin to ranks. Every rank gets the same number of batches:
    the list is padded by repeating batches from its start (drop_last=True drops the remainder instead). The batch
    partition of lengths does not depend on the epoch, so `len()` is fixed.

    Resuming mid-epoch: `state_dict()` records the epoch and the number of batches this sampler has yielded in it;
    `load_state_dict()` makes the next `__iter__` skip them. With a DataLoader that prefetches (num_workers > 0) the
    sampler runs ahead of training, so rather save your own count of batches trained and call `set_epoch(e); skip(n)`.
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
        self.epoch, self._skip, self._yielded = 0, 0, 0
        self._len = len(self._rank_batches(0))

    def _batches(self, epoch: int) -> list[list[int]]:
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, epoch])
        if self.shuffle:
            order = np.lexsort((rng.permutation(n), self.lengths))  # by length, random among equal lengths
        else:
            order = np.argsort(self.lengths, kind="stable")
        batches, cur, cur_max = [], [], 0
        for i in order.tolist():
            L = int(self.lengths[i])
            if cur and (len(cur) + 1) * max(cur_max, L) > self.batch_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, L)
        if cur:
            batches.append(cur)
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
        self._yielded = start
        for b in batches[start:]:
            self._yielded += 1
            yield b

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._yielded = int(epoch), 0

    def skip(self, n: int) -> None:
        """The next `__iter__` (of the current epoch) starts after this rank's first n batches."""
        self._skip = int(n)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self._yielded, "seed": self.seed, "num_batches": self._len}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("seed", self.seed) != self.seed or sd.get("num_batches", self._len) != self._len:
            raise HstapError("sampler state: seed or batch count differ from this sampler's "
                             "(another dataset or batch_tokens?)")
        self.set_epoch(sd["epoch"])
        self.skip(sd["batches_done"])


def collate(samples: list[dict]) -> dict:
    """Right-pad a list of `Store` samples with 0 into batch tensors (plus `lengths` (B,) and `ids`)."""
    B = len(samples)
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    T = max(lengths)
    _, K, H = samples[0]["aux"].shape
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long),  # (B, T)
           "loss_mask": torch.zeros(B, T, dtype=torch.long),  # (B, T)
           "aux": torch.zeros(B, T, K, H, dtype=samples[0]["aux"].dtype),  # (B, T, K, H)
           "final": torch.zeros(B, T, H, dtype=samples[0]["final"].dtype)}  # (B, T, H)
    for b, (s, n) in enumerate(zip(samples, lengths)):
        for k in ("input_ids", "loss_mask", "aux", "final"):
            out[k][b, :n] = s[k]
    out["lengths"] = torch.tensor(lengths, dtype=torch.long)  # (B,)
    out["ids"] = [s["id"] for s in samples]
    return out
