"""`hstap generate`: regenerate the assistant turns of a chat corpus with the target, so the drafter learns the target's
own distribution instead of whoever wrote the corpus.

    hstap generate --target TARGET_DIR --data corpus.jsonl --out regen.jsonl            # embedded HF engine
    hstap generate --server http://127.0.0.1:30000 --data corpus.jsonl --out regen.jsonl  # SGLang / vLLM / hstap serve

What is regenerated: system and user turns are kept verbatim; every existing assistant turn is replaced, in order, and
turn i is generated from the conversation *as regenerated so far* (turns before i already replaced), which is what the
target would have seen in a real multi-turn chat. No turn is added: a conversation ending in a user turn keeps that
trailing user turn unanswered, and a conversation without assistant turns is written back unchanged (both are counted).

Engines:
- embedded (`--target DIR`): the HF model in this process, CPU or GPU, greedy (`temperature 0`) or sampled
  (temperature + top_p). Continuous batching (hstap/data/continuous.py, hstap/models/slots.py): `batch_size`
  conversations are decoded together, each in a KV-cache row of `max_len` tokens that it keeps from one turn to the
  next; a finished conversation hands its row to the next one. Turn k+1's prompt is rendered afresh from the text and
  only what it adds to the row's tokens (the closing of answer k, user turn k+1, the generation prompt) is prefilled,
  so a conversation of n turns costs one prefill of its tokens, not n of its growing history (`prefilled_tokens` in
  the summary; outputs equal the re-prefill path's, tested token for token; `--prefix-cache false` prefills every
  turn whole). A turn stops at an end-of-turn/eos token (not kept in the text), at `max_new_tokens`, or where the
  conversation would pass `max_len`; the turns whose prompt no longer fits are dropped, and a conversation whose
  first prompt does not fit is left out (both counted in the summary). Targets the slot
  model does not cover (other layer kinds, a sliding window shorter than a row) run in lockstep batches
  (hstap/data/decode.py: turn k of `batch_size` conversations together, each prompt prefilled whole).
- server (`--server URL`, hstap/data/openai_client.py): any OpenAI-compatible `/v1/chat/completions` (SGLang, vLLM,
  `hstap serve`); `concurrency` conversations in flight (threads, stdlib urllib), retries with exponential
  backoff on connection errors, HTTP 5xx and 429 (honouring Retry-After), `retries` times at most, then the run stops
  (finished records are kept). Each turn sends the whole history; the reuse across turns is the server's own prefix
  cache (SGLang's radix cache, vLLM's automatic prefix caching: both on by default), which recognises it.

Reasoning models (hstap/data/reasoning.py): an answer's thinking goes where the target's chat template reads it back,
so that each later turn's prompt renders as the server renders it: into the message's `reasoning_content` when the
template reads that field (Kimi-K2.5, Qwen3; the embedded engine splits the answer at `</think>`, a server's reasoning
parser does it for `--server`, and the field is sent back with the history), else it stays in `content`.
`--chat-template-kwargs` (e.g. '{"enable_thinking": false}') goes to the template with every turn.

Sampling is reproducible per turn: the seed of each turn is derived from (`seed`, conversation id, turn index), so a
conversation's output doesn't depend on which batch or thread it landed in, nor on a resume.

Output: JSONL, one `{"id", "conversations": [{"role", "content"}]}` record per input conversation (the format
`hstap prepare` reads, same ids as the input); every generated assistant turn also carries its `"finish_reason"`:
"stop" (the target ended it) or "length" (cut at --max-new-tokens or --max-len: the text stays cut, and prepare trains
on no closing token after it, since the target never produced one). Records are appended one by one with fsync, in
completion order (which may differ from the input order; conversations the run skips are left out). Resume: rerunning the same command skips
the ids already in the output; a truncated last line left by a crash is dropped first (the file is truncated at its
last newline). `--new` starts over. The config goes to `<out>.config.json` (`out` is a file, so not
`config.json` in a directory), with the input files' fingerprint: a resume refuses to mix in outputs made with other
generation settings or another input, and an existing `out` without that record (not generate's: a copy of the input,
say) is refused, with or without --new. An input of prompts only (no assistant turn to answer), or one whose every
first prompt is longer than --max-len, is an error that says so, nothing written.

Console (hstap/data/progress.py): a progress line that moves with the tokens (tokens/s, answers done, the time left),
and a summary line at the end.

Note: the regenerated text is what the target produced, decoded; re-rendering it through the chat template and
re-tokenizing (as `prepare` does) gives the target's tokens except where the tokenizer's canonical split differs.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from hstap.common import HstapError, atomic_write_json, run_meta
from hstap.data.answers import Appender, check_resume, recover_output
from hstap.data.continuous import ContinuousEngine, Dialogue, Turn
from hstap.data.conversations import files_fingerprint
from hstap.data.decode import EmbeddedEngine
from hstap.data.generate_config import GenerateConfig
from hstap.data.openai_client import ChatClient, RequestRejected
from hstap.data.progress import GenerateProgress, count_work, nothing_to_do, summary_line
from hstap.data.reasoning import template_kwargs

STAGE = "generate"
# Settings that change what is generated: a resume with any of them changed would mix two distributions, or two
# inputs, in one file.
_RESUME_KEYS = ("data", "target", "server", "model", "max_new_tokens", "max_len", "temperature", "top_p", "seed",
                "capture", "chat_template_kwargs")


def turn_seed(seed: int, sample_id: str, turn: int) -> int:
    """Seed of one assistant turn: independent of batching, threads and resumes (31 bits: every server accepts it)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}:{turn}".encode()).digest()[:4], "little") >> 1


def _todo(cfg: GenerateConfig, done: set[str], stats: dict) -> Iterator[tuple[str, list[dict]]]:
    from hstap.data.conversations import conversation_id, read_conversations

    seen: dict[str, str] = {}  # id -> digest of its messages: an exact duplicate is skipped, as prepare does
    n = 0
    for sid, messages in read_conversations(cfg.data, on_error=cfg.on_error, open_turns=True):
        if cfg.max_samples is not None and n >= cfg.max_samples:
            return
        digest = conversation_id(messages)
        if sid in seen:
            if seen[sid] == digest:
                stats["duplicates"] += 1
                continue
            msg = f"{', '.join(cfg.data)}: id {sid!r} is used by two different conversations"
            if cfg.on_error == "fail":
                raise HstapError(msg)
            print(f"hstap generate: skipping the second: {msg}", file=sys.stderr)
            stats["skipped"] += 1
            continue
        seen[sid] = digest
        n += 1
        if sid in done:
            stats["already_done"] += 1
            continue
        yield sid, [{"role": m["role"], "content": m["content"]} for m in messages]


# -------------------------------------------------------------------------------------------------------------- runs


def _ended_before(msgs: list[dict], i: int) -> list[dict]:
    """The conversation cut before message i (a turn that no longer fits): it ends with its last answered turn."""
    msgs = msgs[:i]
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    return msgs


class _Conversation(Dialogue):
    """A conversation as the continuous engine answers it: its assistant turns in order, each from the conversation
    as regenerated so far; a turn whose prompt no longer fits the row (--max-len, or the model's context) ends it."""

    def __init__(self, sid: str, msgs: list[dict], cfg: GenerateConfig, eng: EmbeddedEngine, limit: int):
        self.sid, self.msgs, self.cfg, self.eng, self.limit = sid, msgs, cfg, eng, limit
        self.slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        self.k, self.finishes, self.tokens, self.dropped, self.row_cuts = 0, [], 0, 0, 0
        self.prompt: list[int] | None = None
        self.last: list[int] = []
        self.prompt_tokens = 0
        self.too_long = False  # its first prompt does not fit: left out (counted)

    def _turn(self) -> Turn | None:
        if self.k >= len(self.slots):
            return None
        ids = self.eng.prompt_ids(self.msgs[:self.slots[self.k]])
        if len(ids) >= self.limit:
            if self.k == 0:  # not even the first answer fits
                self.too_long = True
            else:  # the turns from here on do not fit: the conversation ends with the last answered turn
                self.dropped = len(self.slots) - self.k
                self.msgs = _ended_before(self.msgs, self.slots[self.k])
            return None
        self.prompt = ids
        self.prompt_tokens += len(ids)
        c = self.cfg
        return Turn(ids, c.max_new_tokens, c.temperature, c.top_p, turn_seed(c.seed, self.sid, self.k))

    def first(self) -> Turn | None:
        return self._turn()

    def answered(self, new_ids: list[int], finish: str) -> Turn | None:
        self.msgs[self.slots[self.k]] = self.eng.message(self.prompt, new_ids, finish)  # its thinking kept apart
        self.finishes.append(finish)
        self.row_cuts += finish == "length" and len(new_ids) < self.cfg.max_new_tokens  # cut by --max-len instead
        self.tokens += len(new_ids)
        self.last = new_ids
        self.k += 1
        return self._turn()


def _run_embedded(cfg: GenerateConfig, todo, emit, stats: dict, tap=None, progress=None) -> None:
    # Continuous batching (hstap/data/continuous.py): `batch_size` conversations in KV rows of --max-len tokens; a
    # conversation keeps its row across its turns (only what each turn adds is prefilled), a finished one hands its
    # row to the next. With a tap (--capture), the last turn's prompt and answer come with their states. Targets the
    # slot model does not cover (hstap/models/slots.py: not a Llama-family layer, a sliding window shorter than a
    # row) run in lockstep batches instead, every turn's prompt prefilled whole (one line says so).
    eng = EmbeddedEngine(cfg.target, cfg.device, cfg.dtype, template_kwargs(cfg.chat_template_kwargs))
    limit = min(cfg.max_len, eng.max_len or cfg.max_len)
    try:
        engine = ContinuousEngine(eng.target, eng.stop_ids, rows=cfg.batch_size, max_len=limit,
                                  layers=tap.layers if tap is not None else None, reuse=cfg.prefix_cache)
    except ValueError as e:
        print(f"hstap generate: {e}: lockstep batches, each turn's prompt prefilled whole", file=sys.stderr)
        return _run_lockstep(cfg, eng, todo, emit, stats, tap)
    if progress is not None:  # the line moves with every pass, not only when a conversation is done
        progress.live = True
        progress.start()
        engine.on_step = lambda: progress.update(engine.tokens_now(), engine.stats["answered_turns"],
                                                 stats["conversations"], engine.stats["generated_tokens"])
    t0 = time.perf_counter()
    for c in engine.run(_Conversation(sid, msgs, cfg, eng, limit) for sid, msgs in todo):
        stats["assistant_turns"] += len(c.finishes)
        stats["generated_tokens"] += c.tokens
        stats["truncated_turns"] += sum(f == "length" for f in c.finishes) - c.row_cuts
        stats["cut_at_max_len"] += c.row_cuts
        stats["dropped_turns"] += c.dropped
        stats["prompt_tokens"] += c.prompt_tokens
        if c.too_long:  # its first prompt does not fit: left out, counted (as prepare counts what it truncates)
            stats["too_long"] += 1
            continue
        tapped = None
        if tap is not None and c.finishes and c.fed_states is not None:
            tapped = (c.prompt, c.last, c.fed_states)
        emit(c.sid, c.msgs, no_assistant=not c.slots, tapped=tapped)
    stats["gen_seconds"] += time.perf_counter() - t0
    stats["prefilled_tokens"] += engine.stats["prefilled_tokens"]
    stats["continuous"] = dict(engine.stats)  # reused and restarted tokens, decode steps, prefill passes


def _run_lockstep(cfg: GenerateConfig, eng: EmbeddedEngine, todo, emit, stats: dict, tap=None) -> None:
    batch: list[tuple[str, list[dict]]] = []
    for item in todo:
        batch.append(item)
        if len(batch) == cfg.batch_size:
            _lockstep_batch(cfg, eng, batch, emit, stats, tap)
            batch = []
    if batch:
        _lockstep_batch(cfg, eng, batch, emit, stats, tap)


def _lockstep_batch(cfg: GenerateConfig, eng: EmbeddedEngine, batch, emit, stats: dict, tap=None) -> None:
    # Turn k of every conversation is generated in one batch; turn k+1 needs turn k's text, so turns go in order.
    # With a tap (--capture), each answered turn returns the states of its prompt and answer; the last one's is kept.
    # The --max-len rules are _Conversation's: turns that no longer fit are dropped, a first one that does not leaves
    # the conversation out.
    convs = [msgs for _, msgs in batch]
    slots = [[i for i, m in enumerate(msgs) if m["role"] == "assistant"] for msgs in convs]
    ended: dict[int, int] = {}  # conversation -> the turn whose prompt no longer fits
    tapped: dict[int, tuple] = {}  # conversation -> (prompt ids, answer ids, states) of its last answered turn
    limit = min(cfg.max_len, eng.max_len or cfg.max_len)
    for k in range(max((len(s) for s in slots), default=0)):
        rows, prompts = [], []
        for c, s in enumerate(slots):
            if k < len(s) and c not in ended:
                ids = eng.prompt_ids(convs[c][:s[k]])
                if len(ids) >= limit:
                    ended[c] = k
                    continue
                rows.append((c, s[k]))
                prompts.append(ids)
        if not rows:
            continue
        t0 = time.perf_counter()
        res = eng.complete(prompts, [min(cfg.max_new_tokens, limit - len(p)) for p in prompts],
                           [cfg.temperature] * len(rows), [cfg.top_p] * len(rows),
                           [turn_seed(cfg.seed, batch[c][0], k) for c, _ in rows],
                           tap.layers if tap is not None else None)
        stats["gen_seconds"] += time.perf_counter() - t0
        for j, ((c, i), (_, toks, fin, *st)) in enumerate(zip(rows, res)):
            if st:  # a sample is the last answered turn: its prompt holds every earlier one
                tapped[c] = (prompts[j], toks, st[0])
            convs[c][i] = eng.message(prompts[j], toks, fin)
            stats["prompt_tokens"] += len(prompts[j])
            stats["prefilled_tokens"] += len(prompts[j])
            stats["assistant_turns"] += 1
            stats["generated_tokens"] += len(toks)
            cut_by_row = fin == "length" and len(toks) < cfg.max_new_tokens
            stats["truncated_turns"] += fin == "length" and not cut_by_row
            stats["cut_at_max_len"] += cut_by_row
    for c, (sid, _) in enumerate(batch):
        k = ended.get(c)
        if k == 0:
            stats["too_long"] += 1
            continue
        if k is not None:
            stats["dropped_turns"] += len(slots[c]) - k
        msgs = convs[c] if k is None else _ended_before(convs[c], slots[c][k])
        emit(sid, msgs, no_assistant=not slots[c], tapped=tapped.get(c))


def _run_server(cfg: GenerateConfig, todo, emit, stats: dict) -> None:
    client = ChatClient(cfg.server, cfg.retries, cfg.backoff, cfg.timeout)
    model = cfg.model or client.first_model()
    stats["model"] = model
    kwargs = template_kwargs(cfg.chat_template_kwargs)

    def one(sid: str, msgs: list[dict]):
        slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        toks, fins = 0, []
        for k, i in enumerate(slots):
            try:  # the server's reasoning parser splits the thinking off: it goes back as reasoning_content
                msgs[i], n = client.reply(model, msgs[:i], cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                          turn_seed(cfg.seed, sid, k), kwargs)
            except RequestRejected as e:
                return sid, msgs, slots, toks, fins, e
            toks += n
            fins.append(msgs[i]["finish_reason"])
        return sid, msgs, slots, toks, fins, None

    def collect(fut: Future):
        sid, msgs, slots, toks, fins, err = fut.result()
        stats["assistant_turns"] += len(fins)
        stats["generated_tokens"] += toks
        stats["truncated_turns"] += sum(f == "length" for f in fins)
        if err is not None:
            if cfg.on_error == "fail":
                raise HstapError(f"generate: {sid}: {err} (pass --on-error skip to leave it out)")
            print(f"hstap generate: skipping {sid}: {err}", file=sys.stderr)
            stats["skipped"] += 1
        else:
            emit(sid, msgs, no_assistant=not slots)

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="hstap-generate")
    pending: set[Future] = set()
    try:
        for sid, msgs in todo:
            pending.add(pool.submit(one, sid, msgs))
            if len(pending) >= 2 * cfg.concurrency:  # bounded read-ahead: the input may be far larger than memory
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    collect(f)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                collect(f)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        stats["gen_seconds"] += time.perf_counter() - t0
        stats["retried"] = client.retried


def generate(cfg: GenerateConfig, make_tap: Callable[[], object] | None = None) -> dict:
    """Regenerate the assistant turns of `cfg.data` into `cfg.out` (resumable); returns the summary it printed.
    `make_tap`: with --capture, the store the answers' states go to (`hstap.capture.tap.generate` passes it: `hstap
    generate --capture` is the capture stage's composition of this one)."""
    if cfg.capture is not None and make_tap is None:
        raise HstapError("generate: --capture: the store is the capture stage's (hstap.capture.tap.generate)")
    out = Path(cfg.out)
    if out.is_dir():
        raise HstapError(f"generate: out: {out} is a directory; give a .jsonl file path")
    cfg_path = out.with_name(out.name + ".config.json")
    fingerprint = files_fingerprint(cfg.data)  # what the answers are answers to (the record keeps it)
    check_resume(cfg, _RESUME_KEYS, out, cfg_path, cfg.new, fingerprint)
    done = set() if cfg.new else recover_output(out)  # --new: the old file goes at the first record, not before
    stats = {"conversations": 0, "already_done": 0, "duplicates": 0, "skipped": 0, "no_assistant": 0,
             "assistant_turns": 0, "truncated_turns": 0, "cut_at_max_len": 0, "dropped_turns": 0, "too_long": 0,
             "generated_tokens": 0,
             "gen_seconds": 0.0}
    if cfg.target is not None:  # a server's prefill is its own (its prefix cache)
        stats.update(prompt_tokens=0, prefilled_tokens=0)

    def on_open() -> None:  # at the first record: a run that fails before leaves nothing behind (nor removes)
        if cfg.new and out.exists():  # with --capture, the tap starts its store over at the first answer too
            out.unlink()
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cfg_path, {**run_meta(STAGE, cfg), "data_fingerprint": fingerprint})

    writer = Appender(out, on_open)
    progress = GenerateProgress(*count_work(cfg, done), cfg.max_new_tokens)
    # Conversations with no assistant turn (prompts only) are written back unchanged, but only once one with an
    # answer is: an input of nothing but prompts is refused with its reason, nothing written.
    held: list[tuple[str, list[dict]]] = []

    def emit(sid: str, msgs: list[dict], no_assistant: bool, tapped: tuple | None = None) -> None:
        stats["conversations"] += 1
        stats["no_assistant"] += no_assistant
        if no_assistant and writer.f is None and not done:
            held.append((sid, msgs))
            return
        while held:
            writer.write(*held.pop(0))
        if tap is not None and tapped is not None:
            tap.add(sid, *tapped, then=lambda: writer.write(sid, msgs))  # the line once the sample is committed
        else:
            writer.write(sid, msgs)
        if not progress.live:  # else the continuous engine updates it, pass by pass
            progress.update(stats["generated_tokens"], stats["assistant_turns"], stats["conversations"],
                            stats["generated_tokens"])

    tap = make_tap() if cfg.capture is not None else None
    t0 = time.perf_counter()
    try:
        todo = _todo(cfg, done, stats)
        if cfg.target is not None:
            _run_embedded(cfg, todo, emit, stats, tap, progress)
        else:
            _run_server(cfg, todo, emit, stats)
        if tap is not None:
            tap.close()  # commits the last shard: its conversations' lines are written now
        nothing_to_do(cfg, stats, held, writer.f is None)
        while held:
            writer.write(*held.pop(0))
    finally:
        progress.close()
        writer.close()
    secs = time.perf_counter() - t0
    gen_s = stats.pop("gen_seconds")
    if tap is not None:
        stats.update(captured_samples=tap.samples, captured_tokens=tap.tokens, store=cfg.capture)
    summary = {"out": str(out), "engine": "embedded" if cfg.target is not None else "server", **stats,
               "seconds": round(secs, 3),
               "tokens_per_s": round(stats["generated_tokens"] / gen_s, 1) if gen_s > 0 else None}
    print(summary_line(cfg, stats, summary, writer.f is not None, tap))
    return summary

