"""The trainer's data helpers: which aux layers feed fc (and where they sit in a store), and the eval split by id."""

from __future__ import annotations

import pytest

from hstap.common import HstapError
from hstap.train_data import is_eval, select_layers


def test_select_layers_offline_online_and_final():
    assert select_layers("", [1, 3, 4], 6) == ([1, 3, 4], [0, 1, 2])  # offline default: the store's layers
    assert select_layers(" 1,4 ", [1, 3, 4], 6) == ([1, 4], [0, 2])  # a subset: indices into the store's aux
    assert select_layers("final", [1, 3, 4], 6) == ([], None)  # EAGLE-1-style: the final state alone
    assert select_layers("final", None, 8) == ([], None)
    assert select_layers("", None, 8) == ([1, 3, 4], [])  # online default: [1, N//2-1, N-4]
    assert select_layers("2,5", None, 8) == ([2, 5], [])
    with pytest.raises(HstapError, match=r"--aux-layers: \[2\] not captured in the store \(it has \[1, 3, 4\]\)"):
        select_layers("1,2", [1, 3, 4], 6)


def test_eval_split_is_a_stable_hash_of_the_id():
    ids = [f"sample-{i}" for i in range(2000)]
    ev = [s for s in ids if is_eval(s, 0.1)]
    assert 0.07 < len(ev) / len(ids) < 0.13
    assert ev == [s for s in ids if is_eval(s, 0.1)]  # the same every time (no RNG)
    assert set(ev) <= {s for s in ids if is_eval(s, 0.2)}  # a larger fraction keeps the smaller split
    assert not any(is_eval(s, 0.0) for s in ids)
