"""The plan of `hstap train --follow`'s stream: pure functions of the store's committed shards and the run's settings,
so that every rank, and every resume, computes the same stream (the rules: `hstap.train.follow`'s docstring).

`next_unit` (the canonical order of the shards), `slot_units` (the shards a slot trains, and its replay pool),
`plan_slot` (one slot's global micro-batches: its regular samples, its replay and anchor draws, held-back samples left
out). A micro-batch is a list of refs (unit, sample index, kind): `REGULAR` and `REPLAY` refs name a sample of the
stream's unit (the u-th shard taken); `ANCHOR` refs have unit `ANCHOR_UNIT` and index a sample of the anchor store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hstap.batching import pack_by_tokens
from hstap.train.data import held_back

TAKE, WAIT, END = 1, 2, 3  # `next_unit`'s answers
REGULAR, REPLAY, ANCHOR = 0, 1, 2  # a ref's kind: a pass of its shard, a replay draw, an anchor draw
ANCHOR_UNIT = -1  # the unit of an ANCHOR ref (its index is into the anchor store)

Ref = tuple[int, int, int]
"""(unit, sample index in the unit (ANCHOR: in the anchor store), kind)."""


@dataclass(frozen=True)
class StreamSpec:
    """What decides the stream, given the store's shards (and the anchor store's samples)."""

    epochs: int
    """E: passes over each shard."""
    retain: int
    """R >= E: a shard is used in R consecutive slots (E passes, then as a replay source)."""
    replay: float
    """Fraction of a slot's samples drawn from the replay pool."""
    seed: int
    batch_tokens: int
    group: int
    """Global micro-batches per optimizer step (world * grad_accum): every slot is a whole number of steps."""
    holdout: float = 0.0
    """Samples whose id `held_back` at this fraction are never planned (regular or replay)."""
    anchor: float = 0.0
    """Fraction of a slot's samples drawn from the anchor store."""

    def slots(self, final: int) -> int:
        """Slots of a stream that ended with `final` shards."""
        return final + self.epochs - 1 if final else 0


def next_unit(by_rank: dict[int, list[dict]], ranks: int, finished: set[int], taken: dict[int, int],
              pointer: int) -> tuple[int, int]:
    """The next shard of the canonical order: (TAKE, r) when it is rank r's next committed one, by_rank[r][taken[r]];
    (WAIT, r) while rank r may still write it; (END, -1) once every rank is finished and fully taken. `pointer`: the
    rank after the last shard taken; `taken[r]`: shards of rank r taken so far; `by_rank[r]`: rank r's committed
    entries in seq order."""
    for k in range(ranks):
        r = (pointer + k) % ranks
        if len(by_rank.get(r, ())) > taken.get(r, 0):
            return TAKE, r
        if r not in finished:
            return WAIT, r
    return END, -1


def slot_units(t: int, spec: StreamSpec, final: int | None) -> tuple[list[int], list[int]]:
    """(units trained in slot t: their passes, newest first; units of its replay pool)."""
    hi = final if final is not None else t + 1
    regular = [u for u in range(t, t - spec.epochs, -1) if 0 <= u < hi]
    lo = max(0, t - spec.retain + 1)
    return regular, (list(range(lo, min(t - spec.epochs + 1, hi))) if spec.replay > 0 else [])


def kept(u: int, lengths: Callable[[int], list[int]], ids: Callable[[int], list[str]] | None,
         holdout: float) -> list[int]:
    """Indices of unit u's samples that may be trained on: all of them, less those `held_back` at `holdout` (`ids`
    gives the unit's sample ids; needed only when holdout > 0)."""
    if holdout <= 0:
        return list(range(len(lengths(u))))
    return [j for j, sid in enumerate(ids(u)) if not held_back(sid, holdout)]


def _draws(n: int, frac: float, size: int, seed: list[int]) -> list[int]:
    """round(n * frac / (1 - frac)) indices (at most `size`) of range(size), without replacement, seeded, sorted."""
    k = min(size, round(n * frac / (1 - frac)))
    return sorted(np.random.default_rng(seed).choice(size, size=k, replace=False).tolist())


def plan_slot(t: int, lengths: Callable[[int], list[int]], spec: StreamSpec, final: int | None,
              ids: Callable[[int], list[str]] | None = None, anchor_lengths: list[int] | None = None
              ) -> list[list[Ref]]:
    """Slot t's global micro-batches, each a list of refs (unit, sample index, kind).

    Regular samples: every sample of slot t's units (`slot_units`) that is not held back (`kept`; n of them). Replay:
    round(n * F / (1 - F)) samples (at most the pool) drawn without replacement from the pool's kept samples, seeded by
    (seed, t, 1). Anchor: round(n * A / (1 - A)) samples (at most the anchor store, whose sample lengths are
    `anchor_lengths`) drawn without replacement, seeded by (seed, t, 2). The slot's samples are sorted by length (ties
    by a permutation seeded by (seed, t)), cut by `pack_by_tokens`, the batches shuffled with the same generator, and
    the list padded to a multiple of `spec.group` by repeating batches from its start."""
    regular, pool = slot_units(t, spec, final)
    refs = [(u, j, REGULAR) for u in regular for j in kept(u, lengths, ids, spec.holdout)]
    n = len(refs)
    if pool and spec.replay > 0:
        cand = [(u, j, REPLAY) for u in pool for j in kept(u, lengths, ids, spec.holdout)]
        refs += [cand[i] for i in _draws(n, spec.replay, len(cand), [spec.seed, t, 1])]
    if anchor_lengths and spec.anchor > 0:
        refs += [(ANCHOR_UNIT, i, ANCHOR) for i in _draws(n, spec.anchor, len(anchor_lengths), [spec.seed, t, 2])]
    if not refs:
        return []
    lens = np.asarray([anchor_lengths[j] if kind == ANCHOR else lengths(u)[j] for u, j, kind in refs],
                      dtype=np.int64)  # (n,)
    rng = np.random.default_rng([spec.seed, t])
    order = np.lexsort((rng.permutation(len(refs)), lens))  # (n,) by length, seeded among equal lengths
    batches = pack_by_tokens(lens, spec.batch_tokens, order.tolist())
    batches = [[refs[i] for i in batches[j]] for j in rng.permutation(len(batches))]
    if len(batches) % spec.group:
        batches += [batches[j % len(batches)] for j in range(spec.group - len(batches) % spec.group)]
    return batches
