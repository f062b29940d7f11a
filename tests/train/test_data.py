"""The trainer's data helpers: which aux layers feed fc (and where they sit in a store), and the eval split by id."""

from __future__ import annotations

import pytest

from hstap.common import HstapError
from hstap.train.data import is_eval, select_layers


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


def test_feed_padding_changes_no_figure():
    """Feed(pad_to=16) right-pads T (what train does on CUDA): the same counted rows, loss, gradients and simulated
    chain as the unpadded batch."""
    from types import SimpleNamespace

    import torch
    from helpers.drafter import tiny_setup

    from hstap.train.data import Feed
    from hstap.train.ttt import TTTModel

    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=3, num_layers=2)
    data = SimpleNamespace(target=None, layers=[1, 2], sel=[0, 1], d2t=hot - torch.arange(hot.numel()), t2d=t2d)
    b = {"input_ids": ids, "loss_mask": lm, "lengths": L, "aux": aux, "final": final}
    out = []
    for pad in (1, 16):
        i2, feats, tb, counted, _ = Feed(data, W, torch.device("cpu"), torch.float32, 4, 3, pad_to=pad)(b)
        assert i2.shape[1] == (10 if pad == 1 else 16) and feats.shape[1] == i2.shape[1]
        model = TTTModel(d, ttt=3, attn="sdpa", ce_chunk=4)
        d.zero_grad()
        loss, stats = model(i2, feats, tb, torch.tensor(counted))
        loss.backward()
        with torch.no_grad():
            _, sim, runs = model(i2, feats, tb, evaluate=True)
        out.append((counted, loss.detach(), stats, [p.grad.clone() for p in d.parameters() if p.requires_grad],
                    sim, runs[:, :10]))
    (c1, l1, s1, g1, m1, r1), (c2, l2, s2, g2, m2, r2) = out
    assert c1 == c2 and torch.equal(m1, m2) and torch.equal(r1, r2)
    torch.testing.assert_close(l2, l1)
    torch.testing.assert_close(s2, s1, rtol=1e-6, atol=1e-5)  # float32 sums over other kernel shapes
    for a, b_ in zip(g1, g2):
        torch.testing.assert_close(b_, a, rtol=1e-4, atol=1e-6)
