"""The learning-rate schedule: linear warmup, cosine decay, the min_lr floor, and a longer resumed run laying the cosine
out over its new total (the resume itself: tests/train/test_train.py)."""

from __future__ import annotations

import math

import pytest

from hstap.train.trainer import Schedule


def test_warmup_is_linear_to_the_peak():
    s = Schedule(lr=2.0, warmup_ratio=0.1, min_lr_ratio=0.0, total=100)  # ceil(0.1 * 100) = 10 warmup steps
    assert [s.lr_at(i) for i in range(10)] == [2.0 * (i + 1) / 10 for i in range(10)]
    assert s.lr_at(10) == 2.0  # cosine starts at the peak
    assert Schedule(lr=2.0, warmup_ratio=0.0, min_lr_ratio=0.0, total=100).lr_at(0) == 2.0  # no warmup
    assert Schedule(lr=1.0, warmup_ratio=0.015, min_lr_ratio=0.0, total=20).lr_at(0) == 1.0  # ceil(0.3) = 1 step


def test_cosine_decays_to_the_min_lr_floor():
    s = Schedule(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.0, total=100)  # 10 warmup steps, then 90 of cosine
    assert s.lr_at(55) == pytest.approx(0.5)  # half way through the cosine
    assert s.lr_at(100) == pytest.approx(0.0, abs=1e-12)
    f = Schedule(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.2, total=100)
    assert f.lr_at(55) == pytest.approx(0.2 + 0.8 * 0.5)
    assert f.lr_at(100) == pytest.approx(0.2)
    lrs = [f.lr_at(i) for i in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and min(lrs) >= 0.2 - 1e-12
    assert lrs[1] == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 90)))


def test_a_longer_resumed_run_lays_the_cosine_over_the_new_total():
    short, long = (Schedule(lr=1.0, warmup_ratio=0.25, min_lr_ratio=0.0, total=n) for n in (8, 16))
    assert short.lr_at(8) == pytest.approx(0.0, abs=1e-12)
    assert long.lr_at(8) > 0.3 and long.lr_at(16) == pytest.approx(0.0, abs=1e-12)
    assert short.state(8) == {"kind": "warmup-cosine", "lr": 1.0, "warmup_ratio": 0.25, "min_lr_ratio": 0.0,
                              "next_lr": short.lr_at(8)}
