"""hstap.artifacts.vocab_map: the draft vocabulary map's selection rule (frequency, ties, fill, clamping) and its validity check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstap.common import HstapError
from hstap.artifacts.vocab_map import build_vocab_map, check_vocab_map


def test_vocab_map_rules():
    freq = np.array([0, 5, 3, 5, 0, 1, 0, 0], dtype=np.int64)
    d2t, t2d = build_vocab_map(freq, 3)  # counts 5, 5, 3: ids 1, 3, 2
    assert (d2t + np.arange(3)).tolist() == [1, 2, 3] and t2d.nonzero()[0].tolist() == [1, 2, 3]
    d2t, t2d = build_vocab_map(freq, 2)  # the two 5s
    assert (d2t + np.arange(2)).tolist() == [1, 3]
    d2t, _ = build_vocab_map(np.array([0, 1, 1, 0, 2]), 2)  # tie between ids 1 and 2: the lower id wins
    assert (d2t + np.arange(2)).tolist() == [1, 4]
    d2t, t2d = build_vocab_map(freq, 6)  # 4 seen tokens, filled with the lowest unused ids 0 and 4
    assert (d2t + np.arange(6)).tolist() == [0, 1, 2, 3, 4, 5]
    d2t, t2d = build_vocab_map(freq, 100)  # clamped to V: identity
    assert d2t.tolist() == [0] * 8 and t2d.all()
    check_vocab_map(d2t, t2d, 8)
    check_vocab_map(torch.tensor([1, 2]), torch.tensor([0, 1, 0, 1, 0], dtype=torch.bool), 5)
    for d, t, v, what in [([1, 0], [0, 1, 1, 0], 4, "strictly increasing"), ([3, 4], [0, 0, 0, 1, 1], 5, "leave"),
                          ([0, 1], [1, 0, 1, 1], 4, "exactly"), ([0], [1, 0], 3, "length 3"), ([-1], [1], 1, "leave")]:
        with pytest.raises(HstapError, match=what):
            check_vocab_map(np.array(d), np.array(t, dtype=bool), v)
