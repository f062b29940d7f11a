"""`hstap generate`'s progress line (hstap/data/progress.py): it moves with the tokens while the first conversations
are still being answered (the continuous engine reports every pass), shows tokens/s and a time left estimated from
what is left of the input; the input's work is counted as the run counts it."""

from __future__ import annotations

import json

import torch

from hstap.data.continuous import ContinuousEngine, Dialogue, Turn
from hstap.data.progress import GenerateProgress, count_work
from hstap.artifacts.model_dir import load_target


class _OneTurn(Dialogue):
    def __init__(self, prompt, new):
        self.prompt, self.new = prompt, new

    def first(self):
        return Turn(list(self.prompt), self.new)

    def answered(self, new_ids, finish):
        return None


def test_the_engine_reports_tokens_before_any_conversation_is_done(tiny_llama):
    target, _ = load_target(str(tiny_llama), device="cpu", dtype="fp32")
    g = torch.Generator().manual_seed(0)
    convs = [_OneTurn(torch.randint(3, target.vocab_size, (6,), generator=g).tolist(), 12) for _ in range(2)]
    eng = ContinuousEngine(target, [], rows=2, max_len=64)  # no stop id: every answer runs its 12 tokens
    seen = []
    eng.on_step = lambda: seen.append((eng.tokens_now(), eng.stats["answered_turns"]))
    done = list(eng.run(convs))
    assert len(done) == 2 and seen[-1] == (24, 2)
    before = [t for t, answered in seen if answered == 0]
    assert len(before) >= 10 and before == sorted(before) and before[-1] > before[0]  # moving, one pass at a time


def test_the_line_says_rate_answers_and_time_left():
    p = GenerateProgress(conversations=4, answers=8, max_new_tokens=100, tty=False)
    p.t0 -= 10.0  # 10 s in
    first = p.line(tokens=50, answers=0, conversations=0)
    assert "50 tokens, 5.0 tokens/s; 0/8 answers, 0/4 conversations" in first
    assert "~2 min 30 s left (at most: no answer finished yet)" in first  # (8 x 100 - 50) / 5
    p.finished_tokens = 40  # two answers of 20 tokens finished, 10 tokens into the next ones
    assert "~22 s left" in p.line(tokens=50, answers=2, conversations=1)  # (6 x 20 - 10) / 5
    assert "time left: ?" in p.line(tokens=0, answers=0, conversations=0)


def test_count_work_counts_what_the_run_answers(tmp_path):
    f = tmp_path / "in.jsonl"
    recs = [{"id": f"c{i}", "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
             * (1 + i % 2)} for i in range(5)]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs) + "not json\n")

    class Cfg:
        data, max_samples = [str(f)], None

    assert count_work(Cfg, set()) == (5, 7)  # 1 + 2 + 1 + 2 + 1 answers; the bad line left to the run
    assert count_work(Cfg, {"c1"}) == (4, 5)
    Cfg.max_samples = 3
    assert count_work(Cfg, {"c0"}) == (2, 3)  # --max-samples counts the done ones, as the run does
