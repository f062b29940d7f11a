"""The tap beside EAGLE-3's row book (hstap/capture/vllm/eagle_tap.py), fed as vLLM's model runner feeds it: batched
steps of several requests, a verify step whose rejected drafts' positions the next step recomputes. The live server
path (vLLM's own forward, the connector, the store) is tests/test_serve_loop.py's."""

from __future__ import annotations

import torch
from helpers.vllm import require_vllm

L, H = 3, 4


def _rows(tag: float, n: int) -> torch.Tensor:
    return torch.full((n, L, H), tag) + torch.arange(n, dtype=torch.float32)[:, None, None]  # (n, L, H)


def test_the_latest_row_at_each_position_wins_and_the_tokens_are_checked():
    require_vllm()
    from hstap.capture.vllm.eagle_tap import RowBook

    book = RowBook()
    # step 1: "a" prefills positions 0..4, "b" positions 0..2 (one batch: a's rows first)
    book.record(["a", "b"], [0, 5, 8], torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
                torch.tensor([10, 11, 12, 13, 14, 20, 21, 22]), torch.cat([_rows(1, 5), _rows(2, 3)]))
    # step 2: "a" verifies its sampled token 15 and drafts 16, 17, 18 at positions 5..8; one draft is accepted
    book.record(["a"], [0, 4], torch.tensor([5, 6, 7, 8]), torch.tensor([15, 16, 17, 18]), _rows(3, 4))
    # step 3: the target's own token 27 at position 7 (draft 17 rejected), new drafts at 8..10
    book.record(["a"], [0, 4], torch.tensor([7, 8, 9, 10]), torch.tensor([27, 28, 29, 30]), _rows(4, 4))
    a = [10, 11, 12, 13, 14, 15, 16, 27, 28]  # prompt + fed tokens: the request ended after accepting 28
    rows, side, why = book.take("a", a)
    assert why == "" and rows.shape == (9, L, H) and side is None  # side rows kept only when asked
    assert torch.equal(rows[:5], _rows(1, 5)) and torch.equal(rows[5:7], _rows(3, 4)[:2])
    assert torch.equal(rows[7:], _rows(4, 4)[:2])  # positions 7, 8: the recomputed rows, not the rejected drafts'
    assert book.take("a", a) == (None, None, "tap_incomplete")  # taken once
    assert book.take("b", [20, 21, 99]) == (None, None, "tap_token_mismatch")
    book.record(["c"], [0, 2], torch.tensor([0, 2]), torch.tensor([1, 3]), _rows(5, 2))
    assert book.take("c", [1, 2, 3]) == (None, None, "tap_incomplete")  # position 1 never computed
    book.record(["d"], [0, 1], torch.tensor([0]), torch.tensor([1]), _rows(6, 1))
    book.discard({"d", "zz"})
    assert book.reqs == {}


def _verify_steps(book) -> list[int]:
    """Request "a": a prefill (0..4), a verify step at 5..8 that accepts 1 draft, one at 7..10 that accepts 0, one at
    8..11 that accepts all 3, one at 12..15 (the request ends at 13); b prefills beside it. Returns a's tokens."""
    book.record(["a", "b"], [0, 5, 8], torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
                torch.tensor([10, 11, 12, 13, 14, 20, 21, 22]), torch.cat([_rows(1, 5), _rows(2, 3)]))
    book.record(["a"], [0, 4], torch.tensor([5, 6, 7, 8]), torch.tensor([15, 16, 17, 18]), _rows(3, 4))
    book.record(["a"], [0, 4], torch.tensor([7, 8, 9, 10]), torch.tensor([27, 28, 29, 30]), _rows(4, 4))
    book.record(["a"], [0, 4], torch.tensor([8, 9, 10, 11]), torch.tensor([38, 39, 40, 41]), _rows(5, 4))
    book.record(["a"], [0, 4], torch.tensor([12, 13, 14, 15]), torch.tensor([52, 53, 54, 55]), _rows(6, 4))
    return [10, 11, 12, 13, 14, 15, 16, 27, 38, 39, 40, 41, 52, 53]


def test_the_rows_of_rejected_drafts_are_kept_as_side_branches():
    require_vllm()
    from hstap.capture.vllm.eagle_tap import RowBook

    book = RowBook()
    book.side_rows = "all"
    a = _verify_steps(book)
    rows, side, why = book.take("a", a)
    assert why == "" and torch.equal(rows[8:12], _rows(5, 4))
    # step 1 (a's second forward) accepted 1 draft: 17, 18 at 7, 8 rejected; step 2 accepted none: 28..30 at 8..10
    assert side["input_ids"].tolist() == [17, 18, 28, 29, 30]
    assert side["pos"].tolist() == [7, 8, 8, 9, 10]
    assert side["parent"].tolist() == [6, -1, 7, -3, -4]  # the accepted position before it, or the side row before
    assert side["step"].tolist() == [1, 1, 2, 2, 2] and side["accepted"].tolist() == [1, 1, 0, 0, 0]
    assert torch.equal(side["states"], torch.cat([_rows(3, 4)[2:], _rows(4, 4)[1:]]))  # the rows as computed
    first = RowBook()
    first.side_rows = "first"
    _, side, _ = first.take("a", _verify_steps(first))
    assert side["input_ids"].tolist() == [17, 28] and side["parent"].tolist() == [6, 7]
    worst = RowBook()
    worst.side_rows, worst.side_max_accepted = "all", 0  # only the steps that accepted nothing
    _, side, _ = worst.take("a", _verify_steps(worst))
    assert side["input_ids"].tolist() == [28, 29, 30] and side["parent"].tolist() == [7, -1, -2]
    none = RowBook()
    assert none.take("a", _verify_steps(none))[1] is None
