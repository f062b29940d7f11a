"""hstap.batching: token-budget packing, the length-bucketed batch sampler (ranks, determinism, resume), collate
with a DataLoader worker."""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers.store import H, K, sid, write

from hstap.batching import BucketBatchSampler, collate, pack_by_tokens
from hstap.common import HstapError
from hstap.store.reader import open_store


def test_pack_by_tokens_cuts_in_the_given_order_by_the_running_max():
    lengths = [5, 1, 3, 8, 2]
    assert pack_by_tokens(lengths, 10) == [[3], [0, 2], [4, 1]]  # default: longest first, ties by index
    assert pack_by_tokens(lengths, 10, order=[1, 4, 2, 0, 3]) == [[1, 4, 2], [0], [3]]  # 3 * 3 <= 10 < 4 * 5
    assert list(BucketBatchSampler(lengths, 10, shuffle=False)) == [[1, 4, 2], [0], [3]]  # the sampler's order
    assert pack_by_tokens([4, 4, 4], 8, order=[2, 0, 1]) == [[2, 0], [1]]
    with pytest.raises(HstapError, match="^--batch-tokens: must be >= 1, got 0$"):
        pack_by_tokens([1], 0)


def test_sampler_invariants_determinism_and_resume():
    rnd = random.Random(0)
    lengths = [rnd.randint(1, 120) for _ in range(400)] + [300, 1000]  # two longer than the budget
    budget = 256
    s = BucketBatchSampler(lengths, budget, seed=3)
    batches = list(s)
    assert len(batches) == len(s)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every index exactly once
    assert all(len(b) * max(lengths[i] for i in b) <= budget or len(b) == 1 for b in batches)
    assert sorted(b for b in batches if any(lengths[i] > budget for i in b)) == [[400], [401]]  # too long: alone
    assert batches == list(BucketBatchSampler(lengths, budget, seed=3))  # deterministic
    s.set_epoch(1)
    e1 = list(s)
    assert e1 != batches and len(e1) == len(batches) and sorted(i for b in e1 for i in b) == list(range(len(lengths)))
    s.set_epoch(0)
    assert list(s) == batches
    # mid-epoch resume: state after 7 batches -> a fresh sampler continues with batch 8
    s.set_epoch(1)
    it = iter(s)
    first = [next(it) for _ in range(7)]
    s2 = BucketBatchSampler(lengths, budget, seed=3)  # the trainer's resume: its own batch count, set_epoch + skip
    s2.set_epoch(1)
    s2.skip(len(first))
    assert first + list(s2) == e1 and list(s2) == e1  # skip applies to one pass only
    s3 = BucketBatchSampler(lengths, budget, seed=3)
    s3.set_epoch(1)
    s3.skip(len(e1) - 2)
    assert list(s3) == e1[-2:]
    # ranks: equal length, together they cover everything (padding repeats at most world_size - 1 batches)
    per = [list(BucketBatchSampler(lengths, budget, seed=3, rank=r, world_size=3)) for r in range(3)]
    assert len({len(x) for x in per}) == 1 and len(per[0]) == len(BucketBatchSampler(lengths, budget, world_size=3))
    flat = [i for x in per for b in x for i in b]
    assert set(flat) == set(range(len(lengths))) and 3 * len(per[0]) - len(batches) < 3
    dl = [list(BucketBatchSampler(lengths, budget, seed=3, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert all(len(x) == len(batches) // 3 for x in dl)
    assert len({tuple(map(tuple, x)) for x in per}) == 3  # ranks get different batches
    ordered = list(BucketBatchSampler(lengths, budget, shuffle=False))
    assert [lengths[b[0]] for b in ordered] == sorted(lengths[b[0]] for b in ordered)


@pytest.mark.procs
def test_collate_and_dataloader_with_forked_worker(tmp_path):
    write(tmp_path / "s", 30, "bf16")
    s = open_store(tmp_path / "s")
    sampler = BucketBatchSampler(s.lengths, 120, seed=1)
    assert s[0]["id"] == sid(0) and s._handles  # handles opened in the parent before the fork ...

    def collate_in_worker(samples):  # ... are replaced by the worker's own (runs in the worker process)
        return collate(samples) | {"pid": (os.getpid(), s._pid)}

    dl = torch.utils.data.DataLoader(s, batch_sampler=sampler, collate_fn=collate_in_worker, num_workers=1,
                                     multiprocessing_context="fork")
    seen = []
    for batch, idx in zip(dl, list(sampler)):
        assert batch["pid"][0] == batch["pid"][1] != os.getpid()
        B, T = batch["input_ids"].shape
        assert batch["aux"].shape == (B, T, K, H) and batch["final"].shape == (B, T, H)
        assert batch["aux"].dtype == torch.bfloat16
        assert batch["ids"] == [s.ids[i] for i in idx] and batch["lengths"].tolist() == [s.lengths[i] for i in idx]
        for b, i in enumerate(idx):
            n, x = s.lengths[i], s[i]
            assert torch.equal(batch["aux"][b, :n], x["aux"]) and torch.equal(batch["input_ids"][b, :n], x["input_ids"])
            assert (batch["aux"][b, n:] == 0).all() and (batch["loss_mask"][b, n:] == 0).all()
        seen += batch["ids"]
    assert sorted(seen) == sorted(s.ids)
