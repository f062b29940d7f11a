"""What `hstap generate` says while it runs and when it ends.

While it runs: a progress line that moves with the tokens, not with whole conversations (on the CPU the first
conversation of a batch can take minutes): tokens generated and tokens/s, answers finished of the input's, and the
time left. The time left is (answers to go) x (tokens per finished answer so far; --max-new-tokens before the first
one ends, so the first figure is an upper bound), less the tokens of the answers in progress, at the measured rate.
How much there is to do comes from a quick pass over the input (`count_work`: records parsed, nothing kept). On a
terminal the line is rewritten in place about once a second; in a log, one line every 30 s.

At the end: the summary line (`summary_line`), and the two ends of a run that had nothing to generate, which are
errors that say why (`nothing_to_do`): prompts only, or nothing that fits --max-len.
"""

from __future__ import annotations

import sys
import time

from hstap.common import HstapError


def count_work(cfg, done: set[str]) -> tuple[int, int]:
    """(conversations, assistant turns) that a run over `cfg.data` will answer, skipping `done` ids and keeping to
    --max-samples as the run does; bad records are left for the run itself to report."""
    from hstap.data.conversations import BadRecord, expand_paths, iter_records

    convs = answers = n = 0
    for _, item in iter_records(expand_paths(cfg.data), open_turns=True):
        if isinstance(item, BadRecord):
            continue
        if cfg.max_samples is not None and n >= cfg.max_samples:
            break
        n += 1
        if item[0] in done:
            continue
        convs += 1
        answers += sum(m["role"] == "assistant" for m in item[1])
    return convs, answers


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else (f"{s // 60} min {s % 60:02d} s" if s >= 60
                                                                         else f"{s} s")


class GenerateProgress:
    """The progress line (module docstring). `update(tokens, answers, conversations)`: the run's totals so far, the
    tokens of answers in progress included; printed when due."""

    def __init__(self, conversations: int, answers: int, max_new_tokens: int, tty: bool | None = None):
        self.total_convs, self.total_answers, self.max_new = conversations, answers, max_new_tokens
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.every = 1.0 if self.tty else 30.0
        self.t0 = self.last = time.perf_counter()
        self.finished_tokens = 0  # tokens of the answers finished so far (the per-answer estimate)
        self.shown = False
        self.live = False  # updated by an engine pass by pass (else by the run, conversation by conversation)

    def start(self) -> None:
        """The clock starts now (once the model is loaded: its load is no part of the rate)."""
        self.t0 = self.last = time.perf_counter()

    def line(self, tokens: int, answers: int, conversations: int) -> str:
        secs = max(time.perf_counter() - self.t0, 1e-9)
        rate = tokens / secs
        per_answer = self.finished_tokens / answers if answers else self.max_new
        in_progress = max(0, tokens - self.finished_tokens)
        to_go = max(0.0, (self.total_answers - answers) * per_answer - in_progress)
        left = f"~{_duration(to_go / rate)} left" if rate > 0 and answers < self.total_answers else "time left: ?"
        return (f"hstap generate: {tokens:,} tokens, {rate:,.1f} tokens/s; {answers:,}/{self.total_answers:,} answers, "
                f"{conversations:,}/{self.total_convs:,} conversations; {left}"
                + (" (at most: no answer finished yet)" if not answers and rate > 0 else ""))

    def update(self, tokens: int, answers: int, conversations: int, finished_tokens: int | None = None) -> None:
        if finished_tokens is not None:
            self.finished_tokens = finished_tokens
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        text = self.line(tokens, answers, conversations)
        if self.tty:
            print("\r" + text + "\x1b[K", end="", file=sys.stderr, flush=True)
            self.shown = True
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)  # the summary line takes its place


def nothing_to_do(cfg, stats: dict, held: list, unopened: bool) -> None:
    """At the end of a run that wrote no record: an input of nothing but prompts (`held`: conversations without an
    assistant turn, not written yet), or of nothing that fits --max-len, is an error that says so, nothing written."""
    src = ", ".join(cfg.data)
    if held and unopened and stats["assistant_turns"] == 0 and not stats["already_done"]:
        raise HstapError(f"{src}: none of its {len(held)} conversation(s) has an assistant turn to generate: they are "
                         f"prompts only (as `hstap data --source mtbench` writes turn 1, which `hstap eval` reads as "
                         f"prompts); generate answers the assistant turns a conversation has, open ones included "
                         f"(`hstap data --source mtbench --turn 2`); nothing written")
    if unopened and stats["too_long"] and not stats["conversations"] and not stats["already_done"]:
        raise HstapError(f"generate: --max-len {cfg.max_len}: the first prompt of every conversation "
                         f"({stats['too_long']}) is longer: nothing to generate, nothing written ({src})")


def summary_line(cfg, stats: dict, summary: dict, wrote: bool, tap) -> str:
    """The line a finished run prints: what was written, what was cut, left out or skipped, and why."""
    secs = summary["seconds"]
    tps = f", {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else ""
    return (f"hstap generate: {stats['conversations']} conversations written ({stats['assistant_turns']} answers, "
            f"{stats['generated_tokens']:,} tokens, {stats['truncated_turns']} cut at --max-new-tokens"
            + (f", {stats['cut_at_max_len']} at --max-len" if stats["cut_at_max_len"] else "")
            + (f", {stats['dropped_turns']} turns past --max-len dropped" if stats["dropped_turns"] else "")
            + f") in {secs:.1f} s"
            f"{tps}; {stats['already_done']} already done, {stats['skipped']} skipped"
            + (f", {stats['no_assistant']} without an assistant turn (prompts only) written back unchanged"
               if stats["no_assistant"] else "")
            + (f", {stats['too_long']} left out (their first prompt does not fit --max-len)"
               if stats["too_long"] else "")
            + (f"; wrote {cfg.out}" if wrote else f"; nothing new for {cfg.out}")
            + (f"; prefilled {stats['prefilled_tokens']:,} of {stats['prompt_tokens']:,} prompt tokens "
               f"({stats['prompt_tokens'] - stats['prefilled_tokens']:,} reused from the conversations' own caches)"
               if cfg.target is not None and cfg.prefix_cache else "")
            + (f"; captured {tap.samples} samples ({tap.tokens:,} tokens) into {cfg.capture}"
               if tap is not None else ""))
