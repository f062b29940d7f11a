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
  E consecutive slots, each slot mixes the passes of the E newest shards, every sample is used exactly E times. A
  slot's samples (with its replay draws) are sorted by length, ties broken by a permutation seeded by (--seed, t),
  cut into micro-batches of --batch-tokens, shuffled by the same generator and padded to a multiple of world x
  --grad-accum micro-batches by repeating its first ones (as offline epochs pad to the world size); global
  micro-batch i of a slot goes to rank i mod world. Every rank computes the same stream; rank 0 polls the store and
  one all-reduce gives its answer to all, so ranks agree on which shards each takes and on every wait.
- End: when writing has ended and the last shard had its E passes, or at --steps. With --steps the LR schedule is
  warmup + cosine over --steps; without, the learning rate is constant (--lr): the total is not known in advance.
- Replay (--replay-fraction F, with --consume): slot t also draws round(n F / (1 - F)) samples (n: its own), without
  replacement, seeded by (--seed, t, 1), from the shards kept beyond their passes, t-R+1..t-E, where R = --keep-shards
  // W - 1: the retained window less one shard of write-ahead per writer rank.
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
- Checksums: every rank hashes each shard it reads once, at the first slot that reads it, against the checksum its
  entry records (`hstap.store.reader.check_shard`): a damaged shard stops the run with its name before a step uses it.
- Exactly once: a checkpoint records the stream position (the shards taken, the slot, the micro-batches done in it);
  --resume continues from it and completes an interrupted consumption. RUN/follow.jsonl has one line per step with the
  ids of the samples it trained on (all ranks; "replay": the replay draws); a resume truncates it like metrics.jsonl.
- Needs a fixed draft vocabulary (--vocab-map, or --data's) and a fixed eval set (--eval-store, or --eval-frac 0).
  The pre-flight check compares the store header's target fingerprints (there may be no sample to recompute yet).
  The store may not exist yet: the trainer waits for it, and with --consume first writes STORE/consumer.json so that
  writers keep to the window from their first shard.

Here: `next_unit` (the canonical order), `plan_slot` (one slot's global micro-batches), `FollowBatches` (this rank's
micro-batches, the polling, the checkpointed position, the id log and consumption), `open_followed_store` (the claim
and the wait for the store before anything else of the run is built).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hstap import dist as D
from hstap.batching import collate, pack_by_tokens
from hstap.common import HstapError
from hstap.store.consumer import delete_consumed, is_consumed, own_shard_files, read_consumer, write_consumer
from hstap.store.format import load_manifest, load_parts, union_entries, writing_state
from hstap.store.reader import Store, check_shard
from hstap.train import checkpoint
from hstap.train.config import TrainConfig

POLL_S = 0.1  # seconds between polls of the store while the stream waits
NOTE_S = 30.0  # seconds between "waiting" notes on rank 0
IDS_LOG = "follow.jsonl"
SETTINGS = ("epochs", "replay_fraction", "consume", "keep_shards")  # a resume must repeat these (with RESUME_KEYS)
_TAKE, _WAIT, _END, _ERROR = 1, 2, 3, 4


@dataclass(frozen=True)
class StreamSpec:
    """What decides the stream, given the store's shards."""

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

    def slots(self, final: int) -> int:
        """Slots of a stream that ended with `final` shards."""
        return final + self.epochs - 1 if final else 0


def next_unit(by_rank: dict[int, list[dict]], ranks: int, finished: set[int], taken: dict[int, int],
              pointer: int) -> tuple[int, int]:
    """The next shard of the canonical order: (_TAKE, r) when it is rank r's next committed one,
    by_rank[r][taken[r]]; (_WAIT, r) while rank r may still write it; (_END, -1) once every rank is finished and fully
    taken. `pointer`: the rank after the last shard taken; `taken[r]`: shards of rank r taken so far; `by_rank[r]`:
    rank r's committed entries in seq order."""
    for k in range(ranks):
        r = (pointer + k) % ranks
        if len(by_rank.get(r, ())) > taken.get(r, 0):
            return _TAKE, r
        if r not in finished:
            return _WAIT, r
    return _END, -1


def slot_units(t: int, spec: StreamSpec, final: int | None) -> tuple[list[int], list[int]]:
    """(units trained in slot t: their passes, newest first; units of its replay pool)."""
    hi = final if final is not None else t + 1
    regular = [u for u in range(t, t - spec.epochs, -1) if 0 <= u < hi]
    lo = max(0, t - spec.retain + 1)
    return regular, (list(range(lo, min(t - spec.epochs + 1, hi))) if spec.replay > 0 else [])


def plan_slot(t: int, lengths: Callable[[int], list[int]], spec: StreamSpec, final: int | None
              ) -> list[list[tuple[int, int, bool]]]:
    """Slot t's global micro-batches, each a list of (unit, sample index in the unit, replay?).

    Regular samples: every sample of slot t's units (`slot_units`). Replay: round(n * F / (1 - F)) samples (at most the
    pool) drawn without replacement from the pool, seeded by (seed, t, 1). The slot's samples are sorted by length (ties
    by a permutation seeded by (seed, t)), cut by `pack_by_tokens`, the batches shuffled with the same generator, and
    the list padded to a multiple of `spec.group` by repeating batches from its start."""
    regular, pool = slot_units(t, spec, final)
    refs = [(u, j, False) for u in regular for j in range(len(lengths(u)))]
    if pool and spec.replay > 0:
        cand = [(u, j, True) for u in pool for j in range(len(lengths(u)))]
        k = min(len(cand), round(len(refs) * spec.replay / (1 - spec.replay)))
        pick = np.random.default_rng([spec.seed, t, 1]).choice(len(cand), size=k, replace=False)
        refs += [cand[i] for i in sorted(pick.tolist())]
    if not refs:
        return []
    lens = np.asarray([lengths(u)[j] for u, j, _ in refs], dtype=np.int64)  # (n,)
    rng = np.random.default_rng([spec.seed, t])
    order = np.lexsort((rng.permutation(len(refs)), lens))  # (n,) by length, seeded among equal lengths
    batches = pack_by_tokens(lens, spec.batch_tokens, order.tolist())
    batches = [[refs[i] for i in batches[j]] for j in rng.permutation(len(batches))]
    if len(batches) % spec.group:
        batches += [batches[j % len(batches)] for j in range(spec.group - len(batches) % spec.group)]
    return batches


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


def claim_store(store: str, keep_shards: int, run: Path, resuming: bool) -> None:
    """Rank 0 of a consuming run, before anything else: write STORE/consumer.json (active, the window), creating STORE
    if no writer has yet, so that writers keep to the window from their first shard. Refuses a store another run
    consumes, or a consumed store this run did not consume before (a resume must be of the run that consumed it)."""
    path = Path(store)
    path.mkdir(parents=True, exist_ok=True)
    m = load_manifest(path) if (path / "manifest.json").is_file() else None
    rec = read_consumer(path, m)
    if rec is not None and rec["run"] != str(run):
        raise HstapError(f"{path / 'consumer.json'}:1: run: the store is consumed by {rec['run']}; one consuming "
                         f"trainer per store (resume that run)")
    if rec is not None and any(rec["consumed"].values()) and not resuming:
        raise HstapError(f"{path / 'consumer.json'}:1: consumed: {run} consumed shards of this store already: pass "
                         f"--resume")
    write_consumer(path, {"run": str(run), "store_created_unix": m.get("created_unix") if m else None, "active": True,
                          "keep_shards": keep_shards, "consumed": rec["consumed"] if rec else {}})


def open_followed_store(cfg: TrainConfig, run: Path, rank: int) -> None:
    """With --consume, rank 0 claims the store (`claim_store`) first; then every rank waits until a writer created
    it."""
    err = None
    if rank == 0 and cfg.consume:
        try:
            claim_store(cfg.store, cfg.keep_shards, run, resuming=bool(cfg.resume and checkpoint.complete(run)))
        except HstapError as e:
            err = e
    if not D.agree(err is None):
        raise err or HstapError(f"{cfg.store}: rank 0 could not claim the store (see its output)")
    wait_for_store(Path(cfg.store))


def check_store_target(store: str, target: str) -> None:
    """The follow pre-flight (the store may have no sample yet to recompute): its header's target config and weights
    fingerprints must be the target's."""
    from hstap.artifacts.model_dir import target_fingerprint

    have, want = load_manifest(Path(store)).get("target") or {}, target_fingerprint(target)
    for k in ("config_sha256", "weights_fingerprint"):
        if have.get(k) != want[k]:
            raise HstapError(f"{store}/manifest.json:1: target.{k}: the store was captured from another target than "
                             f"{target} (--skip-verify to train anyway)")


class FollowBatches:
    """This rank's micro-batches of the follow stream, slot after slot (see the module docstring).

    The loop calls `wait(save)` before each optimizer step (True: the step's micro-batches are planned; False: the
    stream ended), takes grad_accum micro-batches with `next()`, calls `step_done(step)` after the step and
    `committed(step)` after each checkpoint; `state()` goes into trainer_state.json; `finish()` at a normal end."""

    def __init__(self, cfg: TrainConfig, run: Path, rank: int, world: int, dev: torch.device, state: dict | None,
                 pin: bool, workers: int):
        self.path, self.run, self.rank, self.world, self.dev = Path(cfg.store), run, rank, world, dev
        self.pin, self.workers, self.consume = pin, workers, cfg.consume
        self.manifest = load_manifest(self.path)
        self.header = {k: v for k, v in self.manifest.items() if k != "shards"}
        self.ranks = writing_state(self.manifest, load_parts(self.path))[0]
        self.settings = {k: getattr(cfg, k) for k in SETTINGS} | {"epochs": cfg.epochs or 1}
        self.spec = StreamSpec(self.settings["epochs"], self._retain(cfg), cfg.replay_fraction, cfg.seed,
                               cfg.batch_tokens, world * cfg.grad_accum)
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
        if rank == 0 and self.consume:
            self._consume()  # binds the record to this store; a resume redoes what a kill interrupted (idempotent)
        D.barrier()

    def _retain(self, cfg: TrainConfig) -> int:
        """R: how many consecutive slots use a shard (see StreamSpec), checked against the window."""
        E, W = cfg.epochs or 1, self.ranks
        if not cfg.consume:
            return E  # replay needs --consume (TrainConfig): its pool is the retained window
        quota = cfg.keep_shards // W
        need, R = (E, E) if cfg.replay_fraction == 0 else (E + 2, quota - 1)
        if quota < need:
            raise HstapError(f"train: --keep-shards {cfg.keep_shards} is too small for {W} writer rank(s) and "
                             f"--epochs {E}{' with replay' if cfg.replay_fraction else ''}: each writer rank gets "
                             f"{cfg.keep_shards} // {W} = {quota} shards and needs >= {need}")
        return R

    def _restore(self, state: dict) -> None:
        st = state.get("follow")
        if st is None:
            raise HstapError(f"{self.run}: the checkpoint is of a run without --follow; resume it without --follow")
        for k in SETTINGS:
            if st["settings"][k] != self.settings[k]:
                raise HstapError(f"{self.run}: --{k.replace('_', '-')} was {st['settings'][k]}; resume with the same "
                                 f"value")
        if st["store_created_unix"] != self.manifest.get("created_unix") or st["ranks"] != self.ranks:
            raise HstapError(f"{self.path}: not the store this run followed (re-created, or its writer ranks changed "
                             f"from {st['ranks']} to {self.ranks})")
        self.units, self.final, self.uses = [tuple(u) for u in st["units"]], st["final"], st["uses"]
        self.taken_samples = sum(len(self._lengths(u)) for u in range(len(self.units)))
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
        return code, r, (by_rank[r][taken.get(r, 0)]["seq"] if code == _TAKE else -1)

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

    def _plan(self, t: int, done: int = 0) -> None:
        """Make slot t current, `done` of its global micro-batches already trained."""
        self.slot, self.plan, self.done = t, plan_slot(t, self._lengths, self.spec, self.final), done
        units = sorted({u for mb in self.plan for u, _, _ in mb})
        for u in units:
            if self.consume and u < self.consumed_units:
                raise HstapError(f"{self.path}: shard {self._entry(u)['file']} is consumed but slot {t} needs it "
                                 f"(resumed from a checkpoint older than the store's consumption?)")
        todo = self.plan[self.rank::self.world][done // self.world:]  # this rank's micro-batches still to train
        for u in sorted({u for mb in todo for u, _, _ in mb}):  # hashed once, at the first slot that reads it
            e = self._entry(u)
            if e["file"] not in self.checked:
                check_shard(self.path, e)
                self.checked.add(e["file"])
        base, n = {}, 0
        for u in units:
            base[u], n = n, n + len(self._lengths(u))
        view = Store(self.path, self.header | {"shards": []}, [self._entry(u) for u in units], [])
        mine = [[base[u] + j for u, j, _ in mb] for mb in todo]
        self._it = iter(torch.utils.data.DataLoader(view, batch_sampler=mine, collate_fn=collate,
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
            if code == _TAKE:
                self.units.append((r, s))
                self.taken_samples += len(self._lengths(len(self.units) - 1))
            elif code == _END:
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
        uses; rank 0 appends its sample ids to RUN/follow.jsonl."""
        mbs = self.plan[self.done - self.spec.group:self.done]
        ids = [self._entry(u)["ids"][j] for mb in mbs for u, j, rep in mb if not rep]
        self.uses += len(ids)
        if self.rank == 0:
            replay = [self._entry(u)["ids"][j] for mb in mbs for u, j, rep in mb if rep]
            with open(self.run / IDS_LOG, "a") as f:
                f.write(json.dumps({"step": step, "slot": self.slot, "ids": ids, "replay": replay}) + "\n")

    def epochs_done(self) -> float:
        """Average uses per sample of the shards taken so far (reaches --epochs at the end, padding aside)."""
        return self.uses / self.taken_samples if self.taken_samples else 0.0

    def progress(self) -> dict:
        return {"avail": self.available, "used": self.uses}

    def state(self) -> dict:
        """The stream position for trainer_state.json (after the last step done)."""
        return {"follow": {"settings": self.settings, "store_created_unix": self.manifest.get("created_unix"),
                           "ranks": self.ranks, "units": [list(u) for u in self.units], "final": self.final,
                           "slot": self.slot, "slot_done": self.done, "uses": self.uses,
                           "consumed_units": self.consumed_units}}

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
