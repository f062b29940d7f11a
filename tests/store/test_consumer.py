"""The store side of following and consuming (hstap.store.consumer, writing_state), and the follow stream's pure parts
(hstap.train.follow_plan: the canonical order, slot plans) and its config errors. The processes are tests/train/test_follow.py's."""

from __future__ import annotations

import collections
import json
import threading
import time

import pytest
from helpers.store import header, sample, sid, write

from hstap.common import HstapError
from hstap.store.consumer import read_consumer, wait_for_room, write_consumer
from hstap.store.manifest import committed_ids_of, load_manifest, load_parts, merge_manifest, writing_state
from hstap.store.reader import open_store
from hstap.store.writer import StoreWriter
from hstap.train.follow_plan import END, TAKE, WAIT, StreamSpec, next_unit, plan_slot, slot_units


def _record(path, consumed=None, keep=2, active=True, born=None):
    born = load_manifest(path)["created_unix"] if born is None else born
    write_consumer(path, {"run": "/runs/r", "store_created_unix": born, "active": active, "keep_shards": keep,
                          "consumed": consumed or {}})


def _files(path) -> list[str]:
    return sorted(f.name for f in (path / "shards").iterdir())


def test_writer_waits_for_room_in_the_window_and_a_writer_alone_never_waits(tmp_path):
    p = tmp_path / "s"
    w = StoreWriter(p, header(), shard_tokens=10_000)
    assert load_manifest(p)["writers"] == 1
    _record(p, keep=2)
    for i in range(2):
        w.add(sid(i), *sample(i))
        w.flush()  # two shard files: the window (2 for one writer rank) is full
    done = threading.Event()

    def third():
        w.add(sid(2), *sample(2))
        w.flush()
        done.set()

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.5)
    assert not done.is_set() and len(_files(p)) == 2  # blocked before it created its temp file
    _record(p, consumed={"0": 1}, keep=2)  # the trainer consumed shard 0 ...
    assert len(open_store(p)) == 1 and open_store(p).verify() == []  # ... which readers no longer see, file or not
    (p / "shards" / "r000-000000.safetensors").unlink()  # ... and deleted it
    t.join(10)
    assert done.is_set() and _files(p) == ["r000-000001.safetensors", "r000-000002.safetensors"]
    _record(p, consumed={"0": 1}, keep=2, active=False)  # a trainer that ended releases the window
    for i in range(3, 6):
        w.add(sid(i), *sample(i))
        w.flush()
    w.close()
    assert len(_files(p)) == 5
    (p / "consumer.json").unlink()  # no record at all: never waits
    assert wait_for_room(p, 0, 1) == 0.0
    # consumed shards stay committed (a resumed capture skips them); the store stays valid without them
    assert committed_ids_of(p) == {sid(i) for i in range(6)}
    _record(p, consumed={"0": 1})
    s = open_store(p)
    assert s.ids == [sid(i) for i in range(1, 6)] and s.verify() == []
    assert StoreWriter(p, header()).committed_ids() == {sid(i) for i in range(6)}
    merge_manifest(p)  # the manifest keeps the consumed entries: consumer.json alone says what is gone
    assert len(load_manifest(p)["shards"]) == 6 and len(open_store(p)) == 5


def test_stale_or_bad_records_and_new_store(tmp_path):
    p = tmp_path / "s"
    write(p, 10, shard_tokens=50)
    _record(p, consumed={"0": 2}, born=1.0)  # made for an earlier store at this path: ignored
    assert read_consumer(p, load_manifest(p)) is None and len(open_store(p)) == 10
    (p / "consumer.json").write_text('{"format": "hstap-store-consumer", "version": 1, "consumed": {"0": -1},\n'
                                     ' "keep_shards": 2, "active": true}')
    with pytest.raises(HstapError, match=r"consumer.json:1: consumed"):
        open_store(p)
    (p / "consumer.json").write_text('{"format": "hstap-store-consumer",\n oops')
    with pytest.raises(HstapError, match=r"consumer.json:2: consumer record is not valid JSON"):
        open_store(p)
    StoreWriter(p, header(), new=True).close()  # --new replaces the store and its record
    assert not (p / "consumer.json").exists() and len(open_store(p)) == 0


def test_writing_state_waits_for_ranks_that_did_not_start(tmp_path):
    p = tmp_path / "s"
    w0 = StoreWriter(p, header(), rank=0, world_size=3)
    w0.add(sid(0), *sample(0))
    w0.close()
    assert writing_state(load_manifest(p), load_parts(p)) == (3, {0})  # ranks 1, 2 have no part file yet
    w1 = StoreWriter(p, header(), rank=1, world_size=3)
    assert writing_state(load_manifest(p), load_parts(p)) == (3, {0})
    w1.close()
    StoreWriter(p, header(), rank=2, world_size=3).close()
    assert writing_state(load_manifest(p), load_parts(p)) == (3, {0, 1, 2})
    # resumed with one rank: `writers` becomes 1, the wider session's ranks count as finished, rank 0 re-opens
    StoreWriter(p, header(), rank=0, world_size=1)
    assert load_manifest(p)["writers"] == 1 and writing_state(load_manifest(p), load_parts(p)) == (3, {1, 2})
    # the SGLang driver: creates or checks the store, takes no rank
    q = tmp_path / "q"
    StoreWriter(q, header(), world_size=2, claim=False).close()
    assert load_parts(q) == [] and writing_state(load_manifest(q), []) == (2, set())
    with pytest.raises(HstapError, match="claim=False"):
        StoreWriter(q, header(), world_size=2, claim=False).add(sid(0), *sample(0))


def test_canonical_order_round_robin_skips_finished_ranks_and_waits_on_open_ones():
    by = {0: [{"seq": 0}, {"seq": 1}, {"seq": 2}], 1: [{"seq": 0}]}
    assert next_unit(by, 2, set(), {}, 0) == (TAKE, 0)
    assert next_unit(by, 2, set(), {0: 1}, 1) == (TAKE, 1)
    assert next_unit(by, 2, set(), {0: 1, 1: 1}, 1) == (WAIT, 1)  # rank 1 may still write: wait, do not skip
    assert next_unit(by, 2, {1}, {0: 1, 1: 1}, 1) == (TAKE, 0)  # rank 1 closed: skipped
    assert next_unit(by, 3, {0, 1}, {0: 3, 1: 1}, 0) == (WAIT, 2)  # rank 2 has not started
    assert next_unit(by, 2, {0, 1}, {0: 3, 1: 1}, 0) == (END, -1)


def test_slot_plans_are_seeded_use_each_sample_epochs_times_and_replay_from_the_pool():
    lengths = {u: [5 + (u * 7 + j * 3) % 40 for j in range(3 + u % 4)] for u in range(12)}
    spec = StreamSpec(epochs=3, retain=5, replay=0.3, seed=7, batch_tokens=90, group=2)
    assert slot_units(6, spec, None) == ([6, 5, 4], [2, 3])
    assert slot_units(13, spec, 12) == ([11], [9, 10]) and spec.slots(12) == 14
    uses, replays = collections.Counter(), collections.Counter()
    for t in range(spec.slots(12)):
        plan = plan_slot(t, lengths.__getitem__, spec, 12 if t >= 12 else None)
        assert plan == plan_slot(t, lengths.__getitem__, spec, 12 if t >= 12 else None)  # seeded: the same plan
        assert len(plan) % 2 == 0 and all(sum(lengths[u][j] for u, j, _ in mb) and
                                          len(mb) * max(lengths[u][j] for u, j, _ in mb) <= 90 or len(mb) == 1
                                          for mb in plan)
        regular, pool = slot_units(t, spec, 12 if t >= 12 else None)
        real = {(u, j) for mb in plan for u, j, rep in mb if not rep}
        assert real == {(u, j) for u in regular for j in range(len(lengths[u]))}
        assert all(u in pool for mb in plan for u, _, rep in mb if rep)
        seen = set()  # count each planned sample once (padding repeats whole batches)
        for mb in plan:
            for u, j, rep in mb:
                if (u, j, rep) not in seen:
                    seen.add((u, j, rep))
                    (replays if rep else uses)[(u, j)] += 1
    assert set(uses.values()) == {3} and len(uses) == sum(len(v) for v in lengths.values())
    assert sum(replays.values()) > 0
    other = StreamSpec(epochs=3, retain=5, replay=0.3, seed=8, batch_tokens=90, group=2)
    assert plan_slot(6, lengths.__getitem__, other, None) != plan_slot(6, lengths.__getitem__, spec, None)


def test_follow_config_errors_are_one_line_each(tmp_path):
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig

    base = {"store": str(tmp_path / "s"), "target": str(tmp_path), "out": str(tmp_path / "r"), "follow": True,
            "vocab_map": str(tmp_path / "v"), "eval_frac": 0.0}
    cases = [({"follow": False, "consume": True, "keep_shards": 2}, "need --follow"),
             ({"consume": True}, "--consume and --keep-shards go together"),
             ({"keep_shards": 2}, "--consume and --keep-shards go together"),
             ({"consume": True, "keep_shards": 0}, "--keep-shards: must be >= 1"),
             ({"replay_fraction": 1.0}, "--replay-fraction: must be in"),
             ({"replay_fraction": 0.2}, "draws from the shards --consume keeps"),
             ({"vocab_map": None}, "the draft vocabulary must be fixed"),
             ({"eval_frac": 0.05}, "evaluation needs a fixed held-out set"),
             ({"online": True, "data": str(tmp_path), "store": None}, "no --online mode")]
    for over, msg in cases:
        with pytest.raises(HstapError, match=msg):
            from_flags(TrainConfig, **(base | over))
    cfg = from_flags(TrainConfig, **(base | {"steps": 5, "epochs": 2}))  # --follow: both (ends at whichever first)
    assert cfg.hyper.steps == 5 and cfg.hyper.epochs == 2


def test_too_small_a_window_and_a_store_consumed_by_another_run(tmp_path):
    from hstap.store.consumer import claim_store

    p = tmp_path / "s"
    write(p, 6, shard_tokens=50)

    claim_store(str(p), 2, tmp_path / "run-a", resuming=False)
    rec = json.loads((p / "consumer.json").read_bytes())
    assert rec["active"] and rec["keep_shards"] == 2 and rec["run"] == str(tmp_path / "run-a")
    with pytest.raises(HstapError, match="consumed by .*run-a"):
        claim_store(str(p), 2, tmp_path / "run-b", resuming=False)
    _record(p, consumed={"0": 1})
    (p / "consumer.json").write_text((p / "consumer.json").read_text().replace("/runs/r", str(tmp_path / "run-a")))
    with pytest.raises(HstapError, match="pass --resume"):
        claim_store(str(p), 2, tmp_path / "run-a", resuming=False)
    claim_store(str(p), 2, tmp_path / "run-a", resuming=True)
    assert json.loads((p / "consumer.json").read_bytes())["consumed"] == {"0": 1}
