"""Continuous batching for the embedded engine: many conversations, each answered turn after turn in a KV-cache row of
its own (hstap/models/slots.py), as a serving engine with a prefix cache would answer them.

    engine = ContinuousEngine(target, stop_ids, rows=512, max_len=4096)
    for dialogue in engine.run(dialogues):   # in completion order
        ...

A `Dialogue` hands the engine one `Turn` at a time: the whole prompt of that turn (token ids of the conversation so
far with the generation prompt) and its sampling settings; `answered(new_ids, finish)` gives it the answer and returns
the next turn, or None when the conversation is done. The engine keeps each conversation's tokens in its row between
turns: a turn's prompt reuses the leading tokens it shares with the row (the previous prompt and the answer the
target generated, minus a last token that was never fed) and only the rest is prefilled (the end of the previous
turn, the next user message, the generation prompt). A conversation of n turns thus costs one prefill of its tokens
in all, not n prefills of its growing history (quadratic in the turns). Where the re-rendered text tokenizes
differently from the generated ids (a BPE merge across the boundary), reuse stops there and the row's slots from
that position on are written again (`stats["restarts"]` counts such turns): every answer is exactly what
re-prefilling the whole prompt would give.

Scheduling: free rows take new conversations; rows waiting for a prefill are prefilled together (padded to the
longest, in groups of at most `prefill_tokens`) once at least `rows // 16` wait or no row is decoding; every other
step is one decode step of all rows (idle rows compute at the scratch slot and are ignored). One host read per step:
the next token of every row. Sampling: `hstap.data.decode.pick_tokens` (greedy, or temperature + top-p with each
row's own generator seeded per turn), so the random draws of an answer never depend on its batch or row (its
arithmetic may: bf16 kernels round batched rows differently, which can turn a near-tie; fp32 on the CPU is tested
equal to one-at-a-time decoding).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from hstap.data.decode import pick_tokens
from hstap.models.slots import SlotTarget


@dataclass
class Turn:
    ids: list[int]
    """The whole prompt of this turn: the conversation so far, rendered with the generation prompt."""
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


class Dialogue:
    """One conversation as the engine sees it (subclass it): `first()` -> the first Turn or None; `answered(new_ids,
    finish)` -> the next Turn or None. new_ids are the generated ids without the stop token; finish is "stop" or
    "length". A turn's prompt must leave room in the row (len(ids) < max_len); the engine caps max_new_tokens so
    that prompt + answer fit. With the engine's `layers`, a finished dialogue carries `fed` (every token the target
    was fed for it, in order: the last turn's prompt and its answer minus a last token never fed) and `fed_states`
    (aux (n, K, H), final (n, H) on the CPU: the state of token t is the one that predicted token t+1)."""

    fed: list[int] | None = None
    fed_states: tuple | None = None

    def first(self) -> Turn | None:
        raise NotImplementedError

    def answered(self, new_ids: list[int], finish: str) -> Turn | None:
        raise NotImplementedError


class DecodeSteps:
    """One decode step of every row: ids, pos (B, 1) -> logits (B, V) fp32. On CUDA each attention span gets a CUDA
    graph, captured on first use over static ids/pos buffers (a step is ~45 small kernels per layer: launching them
    one by one from Python costs more than the GPU work at a small target's size); elsewhere, or when a capture fails
    (one line says why), the step runs eagerly. Warm-up and capture run with every row at the scratch slot, so
    they write nothing a row holds."""

    def __init__(self, model: SlotTarget, target, graphs: bool):
        self.model, self.target, self.graphs = model, target, graphs
        B, dev = model.B, model.device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.full((B, 1), model.S, dtype=torch.long, device=dev)
        self.captured: dict[int, tuple] = {}  # span -> (graph, logits buffer)
        self.pool = None

    def _run(self, span: int) -> torch.Tensor:
        final = self.model.forward(self.ids, self.pos, None, span)  # (B, 1, H)
        return self.target.logits(final[:, 0]).float()  # (B, V)

    def _capture(self, span: int):
        try:
            self.ids.zero_()
            self.pos.fill_(self.model.S)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(span)
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._run(span)
            return g, out
        except RuntimeError as e:  # e.g. an op that cannot be captured: every later step runs eagerly
            self.graphs = False
            print(f"hstap generate: decode steps run eagerly (CUDA graph capture failed: {str(e).splitlines()[0]})",
                  file=sys.stderr)
            return None

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        if self.graphs and span not in self.captured:
            got = self._capture(span)
            if got is not None:
                self.captured[span] = got
        self.ids.copy_(ids, non_blocking=True)
        self.pos.copy_(pos, non_blocking=True)
        if span in self.captured:
            g, out = self.captured[span]
            g.replay()
            return out
        return self._run(span)


@dataclass
class _Row:
    dialogue: Dialogue | None = None
    cached: list[int] = field(default_factory=list)  # tokens whose keys/values are in the row, in order
    pending: list[int] = field(default_factory=list)  # tokens to prefill before decoding
    turn: Turn | None = None
    prompt_len: int = 0
    out: list[int] = field(default_factory=list)
    nxt: int | None = None  # the token to feed at the next decode step
    gen: torch.Generator | None = None


class ContinuousEngine:
    def __init__(self, target, stop_ids, rows: int = 64, max_len: int = 4096, prefill_tokens: int = 16384,
                 layers: list[int] | None = None, quantum: int = 64, graphs: bool = True, reuse: bool = True):
        """target: hstap.models.target.Target; rows: conversations decoded together; max_len: tokens per row
        (prompt + answers of one conversation); prefill_tokens: most tokens (padding included) per prefill forward;
        layers: also keep the states of every fed token (`states(dialogue)`); quantum: attention spans are rounded up
        to a multiple of it (fewer distinct shapes; at least 256 with graphs); graphs: on CUDA, replay each decode
        step from a CUDA graph captured once per attention span (DecodeSteps); reuse: False prefills every turn's
        prompt whole (the reference path: same answers, quadratic prefill)."""
        self.model = SlotTarget(target, rows, max_len, layers)
        self.target, self.S = target, max_len
        self.quantum = max(quantum, 256) if graphs and self.model.device.type == "cuda" else quantum
        self.steps = DecodeSteps(self.model, target, graphs and self.model.device.type == "cuda")
        self.stops = set(int(s) for s in stop_ids)
        self.prefill_tokens = max(prefill_tokens, max_len)
        self.rows = [_Row() for _ in range(rows)]
        self.reuse = reuse
        self.stats = {"prefilled_tokens": 0, "reused_tokens": 0, "restarts": 0, "decode_steps": 0,
                      "prefill_passes": 0, "generated_tokens": 0, "answered_turns": 0}
        self.on_step: Callable[[], object] | None = None  # called after every pass (a progress line's hook)

    def tokens_now(self) -> int:
        """Tokens generated so far, those of the answers in progress included."""
        return self.stats["generated_tokens"] + sum(len(r.out) for r in self.rows if r.dialogue is not None)

    # ---------------------------------------------------------------------------------------------------- rows
    def _start_turn(self, r: int, turn: Turn) -> None:
        row = self.rows[r]
        if len(turn.ids) >= self.S:
            raise ValueError(f"a prompt of {len(turn.ids)} tokens does not fit a row of {self.S}")
        keep = 0  # the row's leading tokens this prompt starts with (all but its last token: it must be fed)
        if self.reuse:
            for a, b in zip(row.cached, turn.ids[:-1]):
                if a != b:
                    break
                keep += 1
            if keep < len(row.cached):  # the re-rendered text tokenizes otherwise from there (a BPE merge across
                self.stats["restarts"] += 1  # the boundary): those slots are written again
        self.stats["reused_tokens"] += keep
        row.cached, row.pending = row.cached[:keep], list(turn.ids[keep:])
        row.turn, row.prompt_len, row.out, row.nxt = turn, len(turn.ids), [], None
        row.gen = torch.Generator().manual_seed(int(turn.seed)) if turn.temperature > 0 else None

    def _accept(self, r: int, token: int) -> Dialogue | None:
        """The row's next token; returns its dialogue when the conversation is over."""
        row = self.rows[r]
        limit = min(row.turn.max_new_tokens, self.S - row.prompt_len)
        if token in self.stops:
            return self._end_turn(r, "stop")
        row.out.append(token)
        if len(row.out) >= limit:
            return self._end_turn(r, "length")
        row.nxt = token
        return None

    def _end_turn(self, r: int, finish: str) -> Dialogue | None:
        row = self.rows[r]
        self.stats["generated_tokens"] += len(row.out)
        self.stats["answered_turns"] += 1
        row.nxt = None
        nxt = row.dialogue.answered(list(row.out), finish)
        if nxt is not None:
            self._start_turn(r, nxt)
            return None
        done, row.dialogue = row.dialogue, None
        if self.model.states is not None:  # the conversation's fed tokens and their states, before the row is reused
            aux, final = self.model.row_states(r, len(row.cached))
            done.fed, done.fed_states = list(row.cached), (aux.to("cpu", copy=True), final.to("cpu", copy=True))
        return done

    # ---------------------------------------------------------------------------------------------------- passes
    def _span(self, longest: int) -> int:
        q = self.quantum
        return min(self.S + 1, -(-longest // q) * q)

    def _pick(self, logits: torch.Tensor, rs: list[int]) -> list[int]:
        rows = [self.rows[r] for r in rs]
        return pick_tokens(logits, [x.turn.temperature for x in rows], [x.turn.top_p for x in rows],
                           [x.gen for x in rows]).tolist()

    def _prefill(self, rs: list[int]) -> list[Dialogue]:
        dev, done = self.model.device, []
        rs = sorted(rs, key=lambda r: len(self.rows[r].pending))
        while rs:
            T = len(self.rows[rs[-1]].pending)  # groups from the longest down: padding stays small
            n = max(1, min(len(rs), self.prefill_tokens // T))
            group, rs = rs[-n:], rs[:-n]
            T = max(len(self.rows[r].pending) for r in group)
            ids = torch.zeros(len(group), T, dtype=torch.long)
            pos = torch.full((len(group), T), self.S, dtype=torch.long)  # padding -> the scratch slot
            last = []
            for j, r in enumerate(group):
                row = self.rows[r]
                p, n0 = row.pending, len(row.cached)
                ids[j, :len(p)] = torch.tensor(p)
                pos[j, :len(p)] = torch.arange(n0, n0 + len(p))
                last.append(len(p) - 1)
            longest = max(len(self.rows[r].cached) + len(self.rows[r].pending) for r in group)
            final = self.model.forward(ids.to(dev), pos.to(dev), torch.tensor(group, device=dev), self._span(longest))
            head_in = final[torch.arange(len(group), device=dev), torch.tensor(last, device=dev)]  # (R, H)
            nxt = self._pick(self.target.logits(head_in).float(), group)
            self.stats["prefill_passes"] += 1
            for j, r in enumerate(group):
                row = self.rows[r]
                self.stats["prefilled_tokens"] += len(row.pending)
                row.cached += row.pending
                row.pending = []
                d = self._accept(r, nxt[j])
                if d is not None:
                    done.append(d)
        return done

    def _decode(self, live: list[int]) -> list[Dialogue]:
        dev = self.model.device
        ids = np.zeros((len(self.rows), 1), dtype=np.int64)  # idle rows: token 0 at the scratch slot
        pos = np.full((len(self.rows), 1), self.S, dtype=np.int64)
        ids[live, 0] = [self.rows[r].nxt for r in live]
        pos[live, 0] = [len(self.rows[r].cached) for r in live]
        logits = self.steps(torch.from_numpy(ids), torch.from_numpy(pos), self._span(int(pos[live, 0].max()) + 1))
        nxt = self._pick(logits.index_select(0, torch.tensor(live, device=dev)), live)  # (live, V) -> ids
        self.stats["decode_steps"] += 1
        done = []
        for j, r in enumerate(live):
            self.rows[r].cached.append(self.rows[r].nxt)
            d = self._accept(r, nxt[j])
            if d is not None:
                done.append(d)
        return done

    # ---------------------------------------------------------------------------------------------------- loop
    def run(self, dialogues: Iterable[Dialogue]) -> Iterator[Dialogue]:
        """Answer every dialogue, turn by turn; yields each when it is over (completion order)."""
        source = iter(dialogues)
        exhausted = False
        wait = max(1, len(self.rows) // 16)
        with torch.no_grad():
            while True:
                for r, row in enumerate(self.rows):  # free rows take new conversations
                    while row.dialogue is None and not exhausted:
                        d = next(source, None)
                        if d is None:
                            exhausted = True
                            break
                        first = d.first()
                        if first is None:
                            yield d
                            continue
                        row.dialogue, row.cached = d, []
                        self._start_turn(r, first)
                pending = [r for r, x in enumerate(self.rows) if x.dialogue is not None and x.pending]
                live = [r for r, x in enumerate(self.rows) if x.dialogue is not None and x.nxt is not None]
                if not pending and not live:
                    return
                if pending and (len(pending) >= wait or not live):
                    yield from self._prefill(pending)
                else:
                    yield from self._decode(live)
                if self.on_step is not None:
                    self.on_step()
