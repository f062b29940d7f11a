"""`hstap train --follow`: the batch stream of a trainer that follows a growing store, waits when caught up and, with
--consume, deletes the shards it no longer needs, keeping the store's disk within a window (`hstap.store.consumer`).

The trainer takes each shard as soon as it is committed, by any writer rank, and waits when it has caught up (the
progress bar shows samples committed and sample uses trained); the store's spec (hstap/store/format.py, "Writers and
the end of writing") says when writing has ended. The stream does not depend on when shards arrive, so an interrupted
and resumed run reproduces an uninterrupted one (bitwise on CPU fp32):
- Order: shards are taken round robin over the store's writer ranks (0, 1, ..., W-1, 0, ...), each rank's shards in
  seq order; a rank that finished writing and has no shard left is skipped; on a rank that may still write, the
  stream waits. (A rank that re-opens after a clean close, i.e. a capture resumed after it ended, continues the order
  from where the trainer stands.)
- Slots and epochs: slot t trains pass e of shard t-e for e = 0..E-1 (E = --epochs, default 1): each shard is used in
  E consecutive slots, each slot mixes the passes of the E newest shards, every sample (not held back) is used exactly
  E times. A slot's samples (with its replay and anchor draws) are sorted by length, ties broken by a permutation
  seeded by (--seed, t), cut into micro-batches of --batch-tokens, shuffled by the same generator and padded to a
  multiple of world x --grad-accum micro-batches by repeating its first ones (as offline epochs pad to the world
  size); global micro-batch i of a slot goes to rank i mod world. Every rank computes the same stream; rank 0 polls
  the store and one all-reduce gives its answer to all, so ranks agree on which shards each takes and on every wait.
- End: when writing has ended and the last shard had its E passes, or at --steps. With --steps the LR schedule is
  warmup + cosine over --steps; without, the learning rate is constant (--lr): the total is not known in advance.
- Replay (--replay-fraction F, with --consume): slot t also draws round(n F / (1 - F)) samples (n: its own), without
  replacement, seeded by (--seed, t, 1), from the shards kept beyond their passes, t-R+1..t-E, where R = --keep-shards
  // W - 1: the retained window less one shard of write-ahead per writer rank.
- Holdout (--holdout-frac H): a sample whose id falls in fraction H of the hash split of --eval-frac
  (`hstap.train.data.held_back`) is never trained on, neither in its passes nor as a replay draw (n counts only the
  others): recent traffic that no drafter of the run trained on, for a gate (hstap serve-loop) to score candidate
  drafters on. --epochs and the uses of the progress bar count only the trained samples.
- Anchor (--anchor-store A --anchor-fraction F): slot t also draws round(n F / (1 - F)) samples (n: its own regular
  samples, at most all of A's), without replacement, seeded by (--seed, t, 2), from the fixed store A (e.g. the
  drafter's offline training store): rehearsal of the domain the drafter was trained on, while it follows served
  traffic. A is complete, consumed by no one and of the followed store's target, layers, hidden size and dtype
  (`open_anchor`); the trainer never writes to it. Independent of --consume and --replay-fraction (a slot may hold
  regular, replay and anchor samples at once); anchor samples are not uses and go into the same micro-batches.
- Consumption (--consume --keep-shards N): a shard is deleted once every slot that uses it (its E passes, its replay
  slots) is trained and a checkpoint that records it is committed: after each checkpoint rank 0 replaces
  STORE/consumer.json (the consumed shards, a prefix of the stream: the commit point), then deletes their files.
  Writer rank r of W then holds at most N // W shard files (it waits for room, `hstap.store.consumer`), so the store
  never holds more than N shards; N // W must be >= E (>= E + 2 with replay). At the end of a slot, when some shard's
  last use is done and a writer has its whole share on disk (it waits for room), the trainer checkpoints right there
  (no evaluation) to consume it: a consumption costs a checkpoint, so make shards large against the drafter's
  checkpoint. A normal end releases the window (`active: false`); after a crash or kill -9 the writers wait for the
  --resume.
  Without --consume nothing is deleted and writers never wait.
- Checksums: every rank hashes each shard it reads (of the followed store or the anchor) once, at the first slot that
  reads it, against the checksum its entry records (`hstap.store.reader.check_shard`): a damaged shard stops the run
  with its name before a step uses it.
- Exactly once: a checkpoint records the stream position (the shards taken, the slot, the micro-batches done in it);
  --resume continues from it and completes an interrupted consumption. RUN/follow.jsonl has one line per step with the
  ids of the samples it trained on (all ranks; "ids": the regular samples, "replay": the replay draws, "anchor": the
  anchor store's draws); a resume truncates it like metrics.jsonl. A resume must repeat the stream's SETTINGS.
- Needs a fixed draft vocabulary (--vocab-map, or --data's) and a fixed eval set (--eval-store, or --eval-frac 0).
  The pre-flight check compares the store header's target fingerprints (there may be no sample to recompute yet).
  The store may not exist yet: the trainer waits for it, and with --consume first writes STORE/consumer.json so that
  writers keep to the window from their first shard.

The stream's pure plan (`next_unit`: the canonical order, `plan_slot`: one slot's global micro-batches) is
`hstap.train.follow_plan`. Here: `FollowBatches` (this rank's micro-batches, the polling, the checkpointed position, the
id log and consumption), `open_followed_store` (the claim and the wait for the store before anything else of the run
is built), `check_store_target` (the pre-flight) and `open_anchor` (the anchor store's checks).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hstap import dist as D
from hstap.train.side import SideCollate
from hstap.common import HstapError
from hstap.store.consumer import (claim_store, delete_consumed, is_consumed, own_shard_files, read_consumer,
                                  write_consumer)
from hstap.store.manifest import load_manifest, load_parts, union_entries, writing_state
from hstap.store.reader import Store, check_shard, open_store
from hstap.train import checkpoint
from hstap.train.config import HyperParams, StreamParams
from hstap.train.follow_plan import (ANCHOR, ANCHOR_UNIT, END, REGULAR, REPLAY, TAKE, StreamSpec, kept, next_unit,
                                     plan_slot)

POLL_S = 0.1  # seconds between polls of the store while the stream waits
NOTE_S = 30.0  # seconds between "waiting" notes on rank 0
IDS_LOG = "follow.jsonl"
SETTINGS = ("epochs", "replay_fraction", "consume", "keep_shards", "holdout_frac", "anchor_store", "anchor_fraction")
"""What a resume must repeat (with checkpoint.RESUME_KEYS): they decide the stream."""
BEFORE = {"holdout_frac": 0.0, "anchor_store": None, "anchor_fraction": 0.0}
"""What a checkpoint written before a SETTINGS key existed was trained with."""
ANCHOR_FIELDS = ("layers", "hidden_size", "dtype", "target.config_sha256", "target.weights_fingerprint")
"""Header fields in which the anchor store must equal the followed store (its samples go into the same batches)."""
_ERROR = 4  # `_agree`'s code when rank 0 could not poll (next to follow_plan's TAKE, WAIT, END)


def wait_for_store(path: Path) -> dict:
    """The manifest of the store at `path`, once a writer created it (waits, with a note every NOTE_S on rank 0)."""
    t0 = time.monotonic()
    noted = t0
    while not (path / "manifest.json").is_file():
        if D.get_rank() == 0 and time.monotonic() - noted > NOTE_S:
            print(f"follow: waiting for a writer to create {path} ({time.monotonic() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
            noted = time.monotonic()
        time.sleep(POLL_S)
    return load_manifest(path)


def open_followed_store(store: str, keep_shards: int | None, consume: bool, resume: bool, run: Path,
                        rank: int) -> Callable[[], None]:
    """With --consume, rank 0 claims the store (`claim_store`, the window --keep-shards) first; then every rank waits
    until a writer created it. resume: --resume (a run with checkpoints resumes its claim). Returns the claim's undo
    (a no-op where there is none), which this call runs itself when the wait is cut."""
    err, undo = None, (lambda: None)
    if rank == 0 and consume:
        try:
            undo = claim_store(store, keep_shards, run, resuming=bool(resume and checkpoint.complete(run)))
        except HstapError as e:
            err = e
    if not D.agree(err is None):
        raise err or HstapError(f"{store}: rank 0 could not claim the store (see its output)")
    try:
        wait_for_store(Path(store))
    except BaseException:
        undo()
        raise
    return undo


def stream_settings(stream: StreamParams, epochs: int | None, consume: bool) -> dict:
    """The SETTINGS of a follow run (its stream section, --epochs, --consume), as its checkpoints record them."""
    given = {"epochs": epochs or 1, "consume": consume}
    return {k: given[k] if k in given else getattr(stream, k) for k in SETTINGS}


def check_resume(run: Path, state: dict, settings: dict) -> dict:
    """A --resume of a follow run against its checkpoint's trainer_state.json `state`, before anything is written:
    the checkpoint is of a follow run, and it was trained with this run's SETTINGS (`stream_settings`). Returns its
    stream position."""
    st = state.get("follow")
    if st is None:
        raise HstapError(f"{run}: the checkpoint is of a run without --follow; resume it without --follow")
    for k in SETTINGS:
        was = st["settings"].get(k, BEFORE.get(k))
        if was != settings[k]:
            raise HstapError(f"{run}: --{k.replace('_', '-')} was {was}; resume with the same value")
    return st


def check_store_target(store: str, target: str, require: bool = False) -> None:
    """The store was captured from `target` itself: its header's target config and weights fingerprints are the
    target's (train's pre-flight; --follow's whole check, `require`d there: its store may have no sample yet to
    recompute). Elsewhere a header without them (an imported store) is not refused here: the recomputation judges its
    states."""
    from hstap.artifacts.model_dir import target_fingerprint

    have, want = load_manifest(Path(store)).get("target") or {}, target_fingerprint(target)
    differ = [k for k in ("config_sha256", "weights_fingerprint") if (have.get(k) or require) and have.get(k) != want[k]]
    if differ:
        raise HstapError(f"{store}/manifest.json:1: target.{differ[0]}: the store was captured from another model or "
                         f"another variant of it than {target} (a full-precision original, another quantization, "
                         "re-saved weights): --allow-other-variant to train on it anyway, --skip-verify to skip the "
                         "check")


def open_anchor(anchor: str, store: str, header: dict) -> Store:
    """--anchor-store, opened for reading: a store other than the followed one (`store`, whose header is `header`),
    complete (every writer rank closed it), consumed by no trainer, with samples, and equal to the followed store in
    ANCHOR_FIELDS; else one HstapError line naming the store and what differs. Nothing of it is ever written."""
    p = Path(anchor)
    what = "--anchor-store"
    if p.resolve() == Path(store).resolve():
        raise HstapError(f"{p}: {what}: the followed store itself; anchor from a fixed store (e.g. the drafter's "
                         f"offline training store)")
    if not (p / "manifest.json").is_file():
        raise HstapError(f"{p}: {what}: not an hstap store (no manifest.json)")
    m = load_manifest(p)
    for name in ANCHOR_FIELDS:
        a, b = m, header
        for k in name.split("."):
            a, b = (a.get(k) if isinstance(a, dict) else None), (b.get(k) if isinstance(b, dict) else None)
        if a != b:
            raise HstapError(f"{p / 'manifest.json'}:1: {name}: the anchor store has {a!r}, the followed store "
                             f"{store} has {b!r}; an anchor holds states of the same target, layers and dtype")
    ranks, finished = writing_state(m, load_parts(p))
    still = sorted(set(range(ranks)) - finished)
    if still:
        raise HstapError(f"{p}: {what}: writer rank {still[0]} has not closed the store: anchor from a complete store")
    rec = read_consumer(p, m)
    if rec is not None and (rec["active"] or any(rec["consumed"].values())):
        raise HstapError(f"{p / 'consumer.json'}:1: {what}: the store is consumed by {rec['run']}: an anchor must "
                         f"stay whole")
    st = open_store(p)
    if not len(st):
        raise HstapError(f"{p}: {what}: the store holds no sample")
    st.check(checksums=False)  # every shard there at its recorded size; each is hashed at its first draw
    return st


class FollowBatches:
    """This rank's micro-batches of the follow stream, slot after slot (see the module docstring).

    `start()` once RUN is written; the loop calls `wait(save)` before each optimizer step (True: the step's
    micro-batches are planned; False: the stream ended), takes grad_accum micro-batches with `next()`, calls
    `step_done(step)` after the step and `committed(step)` after each checkpoint; `state()` goes into
    trainer_state.json; `finish()` at a normal end."""

    def __init__(self, stream: StreamParams, hyper: HyperParams, store: str, consume: bool, seed: int, run: Path,
                 rank: int, world: int, dev: torch.device, state: dict | None, pin: bool, workers: int):
        """stream: the run's follow section; hyper: its --epochs, --batch-tokens, --grad-accum; store: --store;
        consume: --consume; seed: --seed."""
        self.path, self.run, self.rank, self.world, self.dev = Path(store), run, rank, world, dev
        self.pin, self.workers, self.consume = pin, workers, consume
        self.collate_fn = SideCollate(hyper.side_branches, hyper.side_context)  # with a store's side branches
        self.manifest = load_manifest(self.path)
        self.header = {k: v for k, v in self.manifest.items() if k != "shards"}
        self.ranks = writing_state(self.manifest, load_parts(self.path))[0]
        self.settings = stream_settings(stream, hyper.epochs, consume)
        self.spec = StreamSpec(self.settings["epochs"], self._retain(stream), stream.replay_fraction, seed,
                               hyper.batch_tokens, world * hyper.grad_accum, stream.holdout_frac,
                               stream.anchor_fraction)
        self.anchor = open_anchor(stream.anchor_store, store, self.header) if stream.anchor_store else None
        self.anchor_lengths = list(self.anchor.lengths) if self.anchor is not None else None
        a_entries = self.anchor.manifest["shards"] if self.anchor is not None else []
        self.anchor_shard = np.repeat(np.arange(len(a_entries), dtype=np.int64),
                                      [len(e["ids"]) for e in a_entries])  # (Na,) shard entry of each anchor sample
        self.entries: dict[tuple[int, int], dict] = {}
        self.units: list[tuple[int, int]] = []
        self.final: int | None = None  # shards in the stream once it ended
        self.slot, self.plan, self.done, self.uses = -1, [], 0, 0  # slot, its micro-batches, those done, sample uses
        self.consumed_units, self.available, self.taken_samples, self._it = 0, 0, 0, iter(())
        self.checked: set[str] = set()  # shard files hashed against their checksums by this process
        rec = read_consumer(self.path, self.manifest)
        if not self.consume and rec is not None and any(rec["consumed"].values()):
            raise HstapError(f"{self.path / 'consumer.json'}:1: consumed: {rec['run']} consumed shards of this store "
                             f"already; a follower needs every shard from the first")
        if state is not None:
            self._restore(state)

    def start(self) -> None:
        """Once RUN is written (the stream is checked and planned, nothing written, until here): rank 0 binds the
        consumer record to this store; a resume redoes what a kill interrupted (idempotent)."""
        if self.rank == 0 and self.consume:
            self._consume()
        D.barrier()

    def _retain(self, stream: StreamParams) -> int:
        """R: how many consecutive slots use a shard (see StreamSpec), checked against the window."""
        E, W = self.settings["epochs"], self.ranks
        if not self.consume:
            return E  # replay needs --consume (TrainConfig): its pool is the retained window
        quota = stream.keep_shards // W
        need, R = (E, E) if stream.replay_fraction == 0 else (E + 2, quota - 1)
        if quota < need:
            raise HstapError(f"train: --keep-shards {stream.keep_shards} is too small for {W} writer rank(s) and "
                             f"--epochs {E}{' with replay' if stream.replay_fraction else ''}: each writer rank gets "
                             f"{stream.keep_shards} // {W} = {quota} shards and needs >= {need}")
        return R

    def _restore(self, state: dict) -> None:
        st = check_resume(self.run, state, self.settings)
        if st["store_created_unix"] != self.manifest.get("created_unix") or st["ranks"] != self.ranks:
            raise HstapError(f"{self.path}: not the store this run followed (re-created, or its writer ranks changed "
                             f"from {st['ranks']} to {self.ranks})")
        if self.anchor is not None and st.get("anchor_created_unix") != self.anchor.header.get("created_unix"):
            raise HstapError(f"{self.anchor.path}: not the anchor store this run drew from (re-created?)")
        self.units, self.final, self.uses = [tuple(u) for u in st["units"]], st["final"], st["uses"]
        self.taken_samples = sum(self._trained(u) for u in range(len(self.units)))
        self.consumed_units = st["consumed_units"]
        if st["slot"] >= 0:
            self._plan(st["slot"], st["slot_done"])
        # the checkpoint is committed: what its position makes done is consumable (the kill may have come before)
        self.consumed_units = max(self.consumed_units, self._done_units())
        rec = read_consumer(self.path, self.manifest) if self.consume else None
        ahead = [u for u in range(self.consumed_units, len(self.units)) if is_consumed(self._entry(u), rec)]
        if ahead:
            raise HstapError(f"{self.path / 'consumer.json'}:1: shard {self._entry(ahead[0])['file']} is consumed, "
                             f"but the checkpoint this run resumes from still needs it (an older checkpoint?)")

    # -- the store -----------------------------------------------------------------------------------------------------

    def _refresh(self) -> tuple[dict[int, list[dict]], set[int]]:
        """Re-read the store: entries by rank (cached by (rank, seq)) and the finished ranks."""
        m, parts = load_manifest(self.path), load_parts(self.path)
        if m.get("created_unix") != self.manifest.get("created_unix"):
            raise HstapError(f"{self.path}: the store was re-created (--new?) while this run followed it")
        entries, _, _ = union_entries(m, parts)
        by_rank: dict[int, list[dict]] = {}
        for e in entries:
            self.entries[(e["rank"], e["seq"])] = e
            by_rank.setdefault(e["rank"], []).append(e)
        ranks, finished = writing_state(m, parts)
        if ranks != self.ranks:
            raise HstapError(f"{self.path}: the store's writer ranks changed from {self.ranks} to {ranks} while this "
                             f"run followed it (not supported)")
        self.available = sum(len(e["ids"]) for e in entries)
        return by_rank, finished

    def _entry(self, u: int) -> dict:
        key = self.units[u]
        t0 = time.monotonic()
        while key not in self.entries:  # rank 0 saw it committed: this rank's view of the filesystem catches up
            if time.monotonic() - t0 > 600:
                raise HstapError(f"{self.path}: shard r{key[0]:03d}-{key[1]:06d} is not visible on this rank")
            self._refresh()
            if key not in self.entries:
                time.sleep(POLL_S)
        return self.entries[key]

    def _poll(self) -> tuple[int, int, int]:
        """Rank 0: (code, rank, seq) of the next shard of the canonical order."""
        by_rank, finished = self._refresh()
        taken: dict[int, int] = {}
        for r, _ in self.units:
            taken[r] = taken.get(r, 0) + 1
        pointer = (self.units[-1][0] + 1) % self.ranks if self.units else 0
        code, r = next_unit(by_rank, self.ranks, finished, taken, pointer)
        return code, r, (by_rank[r][taken.get(r, 0)]["seq"] if code == TAKE else -1)

    def _agree(self) -> tuple[int, int, int]:
        """Rank 0's `_poll`, given to every rank (one all-reduce): ranks take the same decisions."""
        vec, err = torch.zeros(4, dtype=torch.int64, device=self.dev), None  # (4,)
        if self.rank == 0:
            try:
                code, r, s = self._poll()
            except HstapError as e:
                err, (code, r, s) = e, (_ERROR, 0, 0)
            vec += torch.tensor([code, r, s, self.available], device=self.dev)
        code, r, s, avail = (int(x) for x in D.all_reduce_sum(vec).tolist())
        if code == _ERROR:
            raise err or HstapError(f"{self.path}: rank 0 stopped following the store (see its output)")
        self.available = avail
        return code, r, s

    def _writers_full(self) -> bool:
        """Whether a writer rank has its whole share of the window on disk (it waits for room), rank 0's view given
        to every rank."""
        full = False
        if self.rank == 0:
            rec = read_consumer(self.path, self.manifest)
            if rec is not None and rec["active"]:
                quota = max(1, rec["keep_shards"] // self.ranks)
                full = any(own_shard_files(self.path / "shards", r) >= quota for r in range(self.ranks))
        return bool(D.all_reduce_sum(torch.tensor([int(full)], device=self.dev)).item())  # (1,)

    # -- the stream ----------------------------------------------------------------------------------------------------

    def _lengths(self, u: int) -> list[int]:
        return self._entry(u)["lengths"]

    def _ids(self, u: int) -> list[str]:
        return self._entry(u)["ids"]

    def _trained(self, u: int) -> int:
        """Samples of unit u that the stream trains on (--holdout-frac holds the others back)."""
        return len(kept(u, self._lengths, self._ids, self.spec.holdout))

    def _check(self, path: Path, e: dict) -> None:
        """Hash a shard (of the followed or of the anchor store) against its checksum, once per process."""
        if str(path / e["file"]) not in self.checked:
            check_shard(path, e)
            self.checked.add(str(path / e["file"]))

    def _plan(self, t: int, done: int = 0) -> None:
        """Make slot t current, `done` of its global micro-batches already trained."""
        self.slot, self.done = t, done
        self.plan = plan_slot(t, self._lengths, self.spec, self.final, self._ids, self.anchor_lengths)
        units = sorted({u for mb in self.plan for u, _, kind in mb if kind != ANCHOR})
        for u in units:
            if self.consume and u < self.consumed_units:
                raise HstapError(f"{self.path}: shard {self._entry(u)['file']} is consumed but slot {t} needs it "
                                 f"(resumed from a checkpoint older than the store's consumption?)")
        todo = self.plan[self.rank::self.world][done // self.world:]  # this rank's micro-batches still to train
        for u, j, kind in sorted({r for mb in todo for r in mb}):  # hashed once, at the first slot that reads it
            if kind == ANCHOR:
                self._check(self.anchor.path, self.anchor.manifest["shards"][int(self.anchor_shard[j])])
            else:
                self._check(self.path, self._entry(u))
        base, n = {}, 0
        for u in units:
            base[u], n = n, n + len(self._lengths(u))
        base[ANCHOR_UNIT] = n  # anchor samples come after the followed ones
        data = Store(self.path, self.header | {"shards": []}, [self._entry(u) for u in units], [])
        if self.anchor is not None:
            data = torch.utils.data.ConcatDataset([data, self.anchor])
        mine = [[base[u] + j for u, j, _ in mb] for mb in todo]
        self._it = iter(torch.utils.data.DataLoader(data, batch_sampler=mine, collate_fn=self.collate_fn,
                                                    num_workers=self.workers, pin_memory=self.pin))

    def wait(self, save: Callable[[], object]) -> bool:
        """Before a step: plan the next slot when the current one is used up, waiting for its shard (True), or tell
        that the stream ended (False). At a slot's end, when some shard's last use is done and a writer has its whole
        share of the window on disk, `save()` (a checkpoint; every rank calls this together) lets `committed` consume
        the done shards first: a writer that waits for room gets it at the next slot, not at the next --save-every."""
        noted = time.monotonic()
        while self.done >= len(self.plan):
            t = self.slot + 1
            if self.final is not None and t >= self.spec.slots(self.final):
                return False
            if self.consume and self._done_units() > self.consumed_units and self._writers_full():
                save()
                continue
            if t < len(self.units) or self.final is not None:
                self._plan(t)
                continue
            code, r, s = self._agree()
            if code == TAKE:
                self.units.append((r, s))
                self.taken_samples += self._trained(len(self.units) - 1)
            elif code == END:
                self.final = len(self.units)
                if self.final == 0:
                    raise HstapError(f"{self.path}: every writer closed the store without a sample")
            else:
                if self.rank == 0 and time.monotonic() - noted > NOTE_S:
                    print(f"follow: waiting for rank {r}'s next shard ({self.available} samples committed, "
                          f"{self.uses} uses trained)", file=sys.stderr, flush=True)
                    noted = time.monotonic()
                time.sleep(POLL_S)
        return True

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.done += self.world
        return next(self._it)

    def step_done(self, step: int) -> None:
        """After optimizer step `step` (its micro-batches are the last `group` of the slot done): count its sample
        uses (its regular samples); rank 0 appends its sample ids to RUN/follow.jsonl, by kind."""
        mbs = self.plan[self.done - self.spec.group:self.done]
        got: dict[int, list[str]] = {REGULAR: [], REPLAY: [], ANCHOR: []}
        for mb in mbs:
            for u, j, kind in mb:
                got[kind].append(self.anchor.ids[j] if kind == ANCHOR else self._ids(u)[j])
        self.uses += len(got[REGULAR])
        if self.rank == 0:
            with open(self.run / IDS_LOG, "a") as f:
                f.write(json.dumps({"step": step, "slot": self.slot, "ids": got[REGULAR], "replay": got[REPLAY],
                                    "anchor": got[ANCHOR]}) + "\n")

    def epochs_done(self) -> float:
        """Average uses per trained sample of the shards taken so far (reaches --epochs at the end, padding aside;
        held-back samples are not counted)."""
        return self.uses / self.taken_samples if self.taken_samples else 0.0

    def progress(self) -> dict:
        return {"avail": self.available, "used": self.uses}

    def state(self) -> dict:
        """The stream position for trainer_state.json (after the last step done)."""
        return {"follow": {"settings": self.settings, "store_created_unix": self.manifest.get("created_unix"),
                           "ranks": self.ranks, "units": [list(u) for u in self.units], "final": self.final,
                           "slot": self.slot, "slot_done": self.done, "uses": self.uses,
                           "consumed_units": self.consumed_units, "anchor_created_unix":
                           self.anchor.header.get("created_unix") if self.anchor is not None else None}}

    # -- consumption ---------------------------------------------------------------------------------------------------

    def _done_units(self) -> int:
        """Shards (a prefix of the stream) whose last use is trained: those that no slot after the finished ones uses."""
        finished = self.slot + (1 if self.done >= len(self.plan) else 0)  # slots fully trained
        if self.final is not None and finished >= self.spec.slots(self.final):
            return self.final
        return min(len(self.units), max(0, finished - self.spec.retain + 1))  # slot t uses units t-R+1..t

    def committed(self, step: int) -> None:
        """After the checkpoint of `step` committed (every rank): consume the shards whose last use it covers."""
        if self.consume and self._done_units() > self.consumed_units:
            self.consumed_units = self._done_units()
            if self.rank == 0:
                self._consume()
        D.barrier()

    def _consume(self, active: bool = True) -> None:
        """Rank 0: record the consumed prefix of the stream in consumer.json (the commit point of consumption), then
        delete its files (and any that a kill left behind)."""
        ours: dict[str, int] = {}
        for r, s in self.units[:self.consumed_units]:
            ours[str(r)] = max(ours.get(str(r), 0), s + 1)
        rec = read_consumer(self.path, self.manifest)
        have = rec["consumed"] if rec is not None else {}
        rec = {"run": str(self.run), "store_created_unix": self.manifest.get("created_unix"), "active": active,
               "keep_shards": self.settings["keep_shards"],
               "consumed": {k: max(have.get(k, 0), ours.get(k, 0)) for k in sorted(set(have) | set(ours))}}
        write_consumer(self.path, rec)
        delete_consumed(self.path, rec)

    def finish(self) -> None:
        """A normal end (the newest checkpoint is at this position): consume what it makes done (the stream's end may
        be known only now) and release the window (writers stop waiting for this trainer)."""
        if self.consume:
            self.consumed_units = max(self.consumed_units, self._done_units())
            if self.rank == 0:
                self._consume(active=False)
