"""The continuous engine (hstap/data/continuous.py over hstap/models/slots.py): multi-turn answers equal re-prefilling
each turn's whole prompt (generate_batch, one conversation at a time) token for token, a conversation's tokens are
prefilled once across its turns, the states it keeps equal a recompute, and a sampled answer does not depend on the
number of rows."""

from __future__ import annotations

import torch

from hstap.data.continuous import ContinuousEngine, Dialogue, Turn
from hstap.data.decode import generate_batch

USER = [7, 8, 9, 10, 11]  # the next user message's tokens, appended after each answer


class Conv(Dialogue):
    def __init__(self, prompt, turns, new, temperature=0.0, seed=0):
        self.ids, self.turns, self.new, self.t, self.seed = list(prompt), turns, new, temperature, seed
        self.outs, self.finishes = [], []

    def _turn(self):
        return Turn(list(self.ids), self.new, self.t, 1.0, self.seed + len(self.outs))

    def first(self):
        return self._turn() if self.turns else None

    def answered(self, new_ids, finish):
        self.outs.append(list(new_ids))
        self.finishes.append(finish)
        if len(self.outs) == self.turns:
            return None
        self.ids += list(new_ids) + USER
        return self._turn()


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _reference(target, prompt, turns, new, stops):
    ids, outs, fins = list(prompt), [], []
    for _ in range(turns):
        (o, fin), = generate_batch(target, [ids], new, stops)
        outs.append(o)
        fins.append(fin)
        ids = ids + o + USER
    return outs, fins


def test_multi_turn_equals_reprefill_and_prefills_once(target):
    stops = [2]
    convs = [Conv(p, turns=1 + i % 3, new=6 + i % 4) for i, p in enumerate(_prompts(7, target.vocab_size))]
    eng = ContinuousEngine(target, stops, rows=3, max_len=128, layers=[0, 1])
    done = list(eng.run(convs))
    assert sorted(map(id, done)) == sorted(map(id, convs))
    for c in convs:
        outs, fins = _reference(target, c.ids[:len(_prompts(7, target.vocab_size)[convs.index(c)])], c.turns, c.new,
                                stops)
        assert c.outs == outs and c.finishes == fins
    # Each conversation's tokens are prefilled once: the first prompt, then per later turn the answer's last token
    # (never fed: the turn ended on it) and the user message. Nothing is re-prefilled.
    firsts = sum(len(p) for p in _prompts(7, target.vocab_size))
    later = sum((len(USER) + (f == "length")) for c in convs for f in c.finishes[:-1])
    assert eng.stats["restarts"] == 0
    assert eng.stats["prefilled_tokens"] == firsts + later
    # the states kept for the last turn equal a prefill recompute of every token fed
    for c in convs:
        aux, final = c.fed_states
        a2, f2, _ = target.capture(torch.tensor([c.fed]), [0, 1])
        assert c.fed == (c.ids + c.outs[-1])[:len(c.fed)] and len(c.fed) >= len(c.ids)
        torch.testing.assert_close(aux, a2[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, f2[0], rtol=1e-4, atol=1e-4)


def test_restart_when_the_prompt_does_not_continue_the_row(target):
    class Edited(Conv):  # turn 2's prompt rewrites the answer: the row starts over
        def answered(self, new_ids, finish):
            nxt = super().answered(new_ids, finish)
            if nxt is not None:
                j = len(nxt.ids) - len(USER) - len(new_ids)  # the answer's first token, which was fed
                nxt.ids[j] = 3 if nxt.ids[j] != 3 else 4
                self.ids = list(nxt.ids)
            return nxt

    c = Edited(_prompts(1, target.vocab_size)[0], turns=2, new=5)
    eng = ContinuousEngine(target, [2], rows=2, max_len=64)
    list(eng.run([c]))
    assert eng.stats["restarts"] == 1
    (o, _), = generate_batch(target, [c.ids], 5, [2])
    assert c.outs[1] == o


def test_sampling_does_not_depend_on_rows(target):
    runs = []
    for rows in (1, 4):
        convs = [Conv(p, turns=2, new=6, temperature=1.0, seed=10 * i) for i, p in
                 enumerate(_prompts(5, target.vocab_size, seed=1))]
        list(ContinuousEngine(target, [2], rows=rows, max_len=96).run(convs))
        runs.append([c.outs for c in convs])
    assert runs[0] == runs[1]


def test_answer_cut_at_the_row(target):
    c = Conv(_prompts(1, target.vocab_size)[0], turns=1, new=100)
    list(ContinuousEngine(target, [2], rows=1, max_len=len(c.ids) + 4).run([c]))
    assert c.finishes == ["length"] and len(c.outs[0]) == 4
