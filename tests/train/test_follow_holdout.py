"""`hstap train --follow --holdout-frac` and `--anchor-store`: a held-back sample is never trained on (neither in its
passes nor as a replay draw) and every other one is, --epochs times; each slot draws from the anchor store as many
samples as its share says, distinct, all of the anchor store; a run with both (and replay, consuming its store) killed
with SIGKILL and resumed equals an uninterrupted one, bitwise on CPU fp32; a bad anchor store is one line naming it and
the field before RUN is written, and a resume with another --holdout-frac or anchor is refused. The stores are written
by the real StoreWriter (`helpers.train.states_store`), the runs are the real train stage."""

from __future__ import annotations

import collections
import contextlib
import io
import random
import shutil
import time

import pytest
from helpers.train import Child, cli_argv, ids_log, metrics, states_store, train_lines

from hstap.common import HstapError
from hstap.train.data import held_back
from hstap.train.follow_plan import ANCHOR, ANCHOR_UNIT, REGULAR, REPLAY, StreamSpec, plan_slot, slot_units

ASSETS = {"n": 4, "with_store": False}  # the target and the prepared set's vocab map (`build_assets`)
HOLD, AF = 0.4, 0.4
FOLLOWED = [f"s{i:02d}" for i in range(18)]
ANCHORS = [f"anchor-{i}" for i in range(6)]
HELD = {i for i in FOLLOWED if held_back(i, HOLD)}


def _opts(a, store, out, **kw) -> dict:
    return {"store": store, "target": a["target"], "out": out, "vocab_map": a["prepared"], "eval_frac": 0.0,
            "batch_tokens": 160, "ttt": 2, "lr": 3e-3, "log_every": 1, "save_every": 4, "device": "cpu",
            "tensorboard": False, "follow": True, "skip_verify": True, **kw}


def _train(a, store, out, **kw) -> None:
    from hstap.cli import make_config
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(make_config("train", TrainConfig, cli_argv(_opts(a, store, out, **kw))))


def _stores(a, root):
    """(followed store: FOLLOWED, several samples per shard; anchor store: ANCHORS), both complete."""
    store, anchor = root / "store", root / "anchor"
    states_store(store, a["target"], FOLLOWED, seed=0, shard_tokens=150)
    states_store(anchor, a["target"], ANCHORS, seed=1, shard_tokens=100)
    return store, anchor


def _by_slot(rows: list[dict]) -> dict[int, dict[str, list[str]]]:
    out: dict[int, dict[str, list[str]]] = {}
    for r in rows:
        s = out.setdefault(r["slot"], {"ids": [], "replay": [], "anchor": []})
        for k in s:
            s[k] += r[k]
    return out


def test_slot_plans_leave_held_back_samples_out_and_draw_the_anchor_share():
    lengths = {u: [5 + (u * 7 + j * 3) % 40 for j in range(3 + u % 4)] for u in range(12)}
    ids = {u: [f"u{u}-{j}" for j in range(len(v))] for u, v in lengths.items()}
    anchor = [10 + (i * 13) % 50 for i in range(9)]
    spec = StreamSpec(epochs=2, retain=4, replay=0.3, seed=7, batch_tokens=90, group=2, holdout=0.3, anchor=0.4)
    held = {(u, j) for u in ids for j, s in enumerate(ids[u]) if held_back(s, 0.3)}
    assert held and len(held) < sum(map(len, ids.values()))
    uses, drawn = collections.Counter(), 0
    for t in range(spec.slots(12)):
        final = 12 if t >= 12 else None
        plan = plan_slot(t, lengths.__getitem__, spec, final, ids.__getitem__, anchor)
        assert plan == plan_slot(t, lengths.__getitem__, spec, final, ids.__getitem__, anchor)  # seeded
        assert len(plan) % 2 == 0
        refs = {r for mb in plan for r in mb}  # padding repeats whole batches
        regular, pool = slot_units(t, spec, final)
        mine = {(u, j) for u, j, k in refs if k == REGULAR}
        assert mine == {(u, j) for u in regular for j in range(len(lengths[u])) if (u, j) not in held}
        replay = {(u, j) for u, j, k in refs if k == REPLAY}
        assert not replay & held and all(u in pool for u, _ in replay)
        drew = [(u, j) for u, j, k in refs if k == ANCHOR]
        assert len(drew) == min(len(anchor), round(len(mine) * 0.4 / 0.6))
        assert all(u == ANCHOR_UNIT and 0 <= j < len(anchor) for u, j in drew)
        drawn += len(drew)
        uses.update(mine)
    assert set(uses.values()) == {2} and len(uses) == sum(map(len, ids.values())) - len(held)
    assert drawn > 0
    # with neither, passing the ids and the anchor changes nothing: the plan of a run without them
    plain = StreamSpec(epochs=2, retain=4, replay=0.3, seed=7, batch_tokens=90, group=2)
    assert plan_slot(6, lengths.__getitem__, plain, None, ids.__getitem__, anchor) == \
        plan_slot(6, lengths.__getitem__, plain, None)


def test_held_back_ids_are_never_trained_and_each_slot_draws_its_anchor_share(assets, tmp_path):
    assert HELD and len(HELD) < len(FOLLOWED)
    store, anchor = _stores(assets, tmp_path)
    run, before = tmp_path / "run", sorted((anchor / "shards").iterdir())
    _train(assets, store, run, holdout_frac=HOLD, anchor_store=anchor, anchor_fraction=AF)
    rows = ids_log(run)
    trained = sorted(i for r in rows for i in r["ids"] + r["replay"])
    assert trained == sorted(set(FOLLOWED) - HELD)  # every kept sample once (--epochs 1), none held back
    slots = _by_slot(rows)
    for s in slots.values():
        assert len(s["anchor"]) == min(len(ANCHORS), round(len(s["ids"]) * AF / (1 - AF)))
        assert len(set(s["anchor"])) == len(s["anchor"]) and set(s["anchor"]) <= set(ANCHORS)
    assert sum(len(s["anchor"]) for s in slots.values()) > 0
    assert metrics(run)[0][-1]["epoch"] == 1.0  # held-back samples count for no epoch
    assert sorted((anchor / "shards").iterdir()) == before and not (anchor / "consumer.json").exists()


@pytest.mark.procs
def test_a_killed_and_resumed_run_with_holdout_anchor_and_replay_equals_an_uninterrupted_one(assets, tmp_path):
    store, anchor = _stores(assets, tmp_path)
    ref_store = tmp_path / "ref-store"
    shutil.copytree(store, ref_store)  # --consume deletes what it used: each run gets its own copy
    opts = dict(holdout_frac=HOLD, anchor_store=anchor, anchor_fraction=AF, consume=True, keep_shards=4, epochs=2,
                replay_fraction=0.3)
    _train(assets, ref_store, tmp_path / "ref", **opts)
    ref = ids_log(tmp_path / "ref")
    assert any(r["replay"] for r in ref) and any(r["anchor"] for r in ref)

    run, rng = tmp_path / "run", random.Random(5)
    kills, landed, starts = sorted(rng.sample(range(3, len(ref) - 4), 2)), 0, 0
    while True:
        starts += 1
        child = Child(cli_argv(_opts(assets, store, run, **opts, resume=starts > 1)), tmp_path / f"train{starts}.log")
        t0 = time.monotonic()
        while kills and child.proc.exitcode is None:
            assert time.monotonic() - t0 < 150, child.output()[-3000:]
            if (run / "follow.jsonl").exists() and len(ids_log(run)) >= kills[0]:
                kills.pop(0)
                time.sleep(rng.uniform(0, 0.02))
                child.kill()
                break
            time.sleep(0.002)
        code = child.wait()
        if code == -9:
            landed += 1
            continue
        assert code == 0, child.output()[-3000:]
        break
    assert landed >= 1, starts
    assert train_lines(run) == train_lines(tmp_path / "ref")
    assert ids_log(run) == ref
    uses = collections.Counter(i for r in ref for i in r["ids"])
    assert set(uses) == set(FOLLOWED) - HELD and set(uses.values()) == {2}
    assert not HELD & {i for r in ref for i in r["replay"]}
    assert {i for r in ref for i in r["anchor"]} <= set(ANCHORS)
    assert not list((store / "shards").iterdir()) and len(list((anchor / "shards").iterdir())) > 0


def test_bad_anchors_and_a_resume_with_another_holdout_are_refused_in_one_line(assets, tmp_path):
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig

    base = {"store": str(tmp_path / "s"), "target": str(tmp_path), "out": str(tmp_path / "r"), "follow": True,
            "vocab_map": str(tmp_path / "v"), "eval_frac": 0.0}
    for over, msg in [({"anchor_fraction": 0.2}, "--anchor-store and --anchor-fraction"),
                      ({"anchor_store": str(tmp_path)}, "--anchor-store and --anchor-fraction"),
                      ({"anchor_store": str(tmp_path), "anchor_fraction": 1.0}, "--anchor-fraction: must be in"),
                      ({"holdout_frac": 1.0}, "--holdout-frac: must be in"),
                      ({"holdout_frac": -0.1}, "--holdout-frac: must be in"),
                      ({"follow": False, "holdout_frac": 0.1}, "need --follow")]:
        with pytest.raises(HstapError, match=msg):
            from_flags(TrainConfig, **(base | over))

    store = tmp_path / "store"
    states_store(store, assets["target"], FOLLOWED, seed=0, shard_tokens=150)
    bad = {"layers": dict(layers=(1, 3)), "hidden_size": dict(hidden=32)}
    for field, kw in bad.items():
        other = tmp_path / f"anchor-{field}"
        states_store(other, assets["target"], ANCHORS, seed=1, **kw)
        with pytest.raises(HstapError, match=rf"^{other}/manifest.json:1: {field}: the anchor store has ") as e:
            _train(assets, store, tmp_path / f"run-{field}", anchor_store=other, anchor_fraction=AF)
        assert "\n" not in str(e.value) and not (tmp_path / f"run-{field}" / "config.json").exists()
    open_anchor = tmp_path / "anchor-open"
    states_store(open_anchor, assets["target"], ANCHORS, seed=1, close=False)
    with pytest.raises(HstapError, match=rf"^{open_anchor}: --anchor-store: writer rank 0 has not closed"):
        _train(assets, store, tmp_path / "run-open", anchor_store=open_anchor, anchor_fraction=AF)
    with pytest.raises(HstapError, match="--anchor-store: the followed store itself"):
        _train(assets, store, tmp_path / "run-self", anchor_store=store, anchor_fraction=AF)

    run = tmp_path / "run"
    _train(assets, store, run, steps=2, holdout_frac=0.3)
    with pytest.raises(HstapError, match=r"--holdout-frac was 0\.3; resume with the same value"):
        _train(assets, store, run, steps=3, holdout_frac=0.2, resume=True)
    anchor = tmp_path / "anchor"
    states_store(anchor, assets["target"], ANCHORS, seed=1)
    with pytest.raises(HstapError, match="--anchor-store was None; resume with the same value"):
        _train(assets, store, run, steps=3, holdout_frac=0.3, resume=True, anchor_store=anchor, anchor_fraction=AF)
    _train(assets, store, run, steps=3, holdout_frac=0.3, resume=True)  # the same settings: resumed
    assert [r["step"] for r in ids_log(run)] == [1, 2, 3]


def test_a_refused_resume_or_anchor_leaves_the_run_and_the_store_as_they_were(assets, tmp_path):
    """Every check of a resume (the stream's settings), and of an anchor store, comes before anything is written:
    RUN/config.json and plan.json still describe the checkpoints, and the store's consumer.json holds no new claim."""
    from helpers.refusals import snapshot

    store, anchor = _stores(assets, tmp_path)
    run, opts = tmp_path / "run", dict(consume=True, keep_shards=4, holdout_frac=0.3)
    _train(assets, store, run, steps=2, **opts)
    before = snapshot(run, store)
    for over, msg in [(dict(holdout_frac=0.2), r"--holdout-frac was 0\.3"),
                      (dict(anchor_store=anchor, anchor_fraction=AF), "--anchor-store was None")]:
        with pytest.raises(HstapError, match=msg):
            _train(assets, store, run, steps=3, resume=True, **(opts | over))
        assert snapshot(run, store) == before, over
    fresh, other = tmp_path / "fresh", tmp_path / "anchor-layers"
    states_store(fresh, assets["target"], FOLLOWED, seed=0, shard_tokens=150)
    states_store(other, assets["target"], ANCHORS, seed=1, layers=(1, 3))
    before = snapshot(fresh)
    with pytest.raises(HstapError, match="layers: the anchor store has"):
        _train(assets, fresh, tmp_path / "run-fresh", steps=2, anchor_store=other, anchor_fraction=AF, **opts)
    assert snapshot(fresh) == before and not (tmp_path / "run-fresh").exists()
