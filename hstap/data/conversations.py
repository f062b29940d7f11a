"""Conversation files -> normalised (id, messages) records, as `hstap prepare`, `eval` and `generate` read them.

Inputs: `.jsonl`, `.json` (a list, or JSON Lines), `.parquet`, `.jsonl.gz`/`.json.gz`, or directories of them
(recursive, sorted, hidden entries skipped). Errors name `file:line` (Parquet: the 1-based row). Format, per record:
ShareGPT {"conversations": [{"from": "system|human|gpt", "value"}]}, OpenAI {"messages": [{"role", "content"}]}, or
{"conversations": [{"role", "content"}]} (the reference corpus). A record's `id` is kept, else it is
`conversation_id(messages)`: sha256 of the normalised conversation as compact key-sorted JSON, 16 hex digits.
An assistant message may carry `"finish_reason"` (what `hstap generate` writes per answer): "length" (cut at the token
limit) is kept on the normalised message, so that prepare never trains on a closing token the target did not produce.
An assistant message's `"reasoning_content"` (a reasoning model's thinking, as servers return it and `hstap generate`
writes it) is kept too: chat templates that read it render it (hstap/data/reasoning.py).
An assistant content of null is a turn left open for `hstap generate` to fill (MT-bench's second turns follow the
target's own first answer, `hstap data --source mtbench --turn 2`); every other reader refuses it.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

from hstap.common import HstapError, one_line, sha256_bytes

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant"}
MAX_WARNINGS = 5  # skipped bad records printed one by one; the rest only counted


class BadRecord(HstapError):
    """One record cannot be used; `reason` is its key in meta.json's skipped counts (skippable with --on-error skip)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------------------------------------- reading


def expand_paths(paths: str | Iterable[str]) -> list[Path]:
    """Files named by `paths` (files, or directories searched recursively), in a stable order."""
    files: list[Path] = []
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES)
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not found:
                raise HstapError(f"{path}: no {'/'.join(SUFFIXES)} files in this directory")
            files += found
        elif path.is_file():
            if not path.name.endswith(SUFFIXES):
                raise HstapError(f"{path}: unsupported file type (expected {'/'.join(SUFFIXES)})")
            files.append(path)
        else:
            raise HstapError(f"{path}: no such file or directory")
    return files


def files_fingerprint(paths: str | Iterable[str], edge: int = 1 << 20) -> str:
    """A fingerprint of conversation files' contents, NOT a full hash (as `hstap.artifacts.model_dir.weights_fingerprint`):
    sha256 over each file's size and its first and last `edge` bytes, in `expand_paths` order. The same files moved
    elsewhere keep it; another file, a longer or shorter one, or one edited near either end changes it. What a resume
    compares its input with (`hstap generate`'s answers file and --capture store), at the cost of 2 MiB read a file."""
    import hashlib

    h = hashlib.sha256()
    for f in expand_paths(paths):
        size = f.stat().st_size
        h.update(f"{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(edge))
            if size > edge:
                fh.seek(max(edge, size - edge))
                h.update(fh.read(edge))
    return f"edges-sha256:{h.hexdigest()}"


def _iter_jsonl(path: Path, f: Iterable[bytes]) -> Iterator[tuple[str, Any]]:
    for n, raw in enumerate(f, 1):
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if not raw.strip():
            continue
        loc = f"{path}:{n}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield loc, BadRecord("bad_utf8", f"{loc}: not valid UTF-8 (byte {e.start} of the line)")
            continue
        try:
            yield loc, json.loads(text)
        except json.JSONDecodeError as e:
            yield loc, BadRecord("bad_json", f"{loc}: invalid JSON: {e.msg} (column {e.colno})")


_WS = re.compile(r"[ \t\n\r]*")


def iter_json_list(path: Path, data: bytes, tail: dict | None = None) -> Iterator[tuple[str, Any]]:
    """Elements of a JSON list with the line each starts on. A syntax error cannot be skipped: it ends the file with an
    error; but given `tail` (salvage) in a file cut short (no closing `]`, as ShareGPT V3 ships), it ends the list
    quietly, `tail` then holding where the complete elements end: {"line", "bytes"} (the line the incomplete element
    starts on, the bytes dropped from there)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise HstapError(f"{path}:{line}: not valid UTF-8") from None
    dec = json.JSONDecoder()
    pos = _WS.match(text, _WS.match(text).end() + 1).end()  # first element, past the '['
    line, last = 1, 0
    more = not text.startswith("]", pos)
    pos += 0 if more else 1
    while more:
        try:
            rec, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if tail is not None and not text.rstrip().endswith("]"):  # cut short, not broken inside
                tail.update(line=line + text.count("\n", last, pos), bytes=len(text[pos:].encode()))
                return
            hint = (" (the file ends inside this element: cut short? `hstap data --source sharegpt --file FILE` "
                    "keeps the complete records of a ShareGPT file)") if _WS.match(text, e.pos).end() >= len(text) \
                or e.msg.startswith("Unterminated") else ""
            raise HstapError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno}){hint}") from None
        line, last = line + text.count("\n", last, pos), pos
        yield f"{path}:{line}", rec
        pos = _WS.match(text, end).end() + 1
        if text[pos - 1:pos] == ",":
            pos = _WS.match(text, pos).end()
        elif text[pos - 1:pos] == "]":
            more = False
        else:
            raise HstapError(f"{path}:{text.count(chr(10), 0, pos - 1) + 1}: invalid JSON: expected ',' or ']'")
    if _WS.match(text, pos).end() != len(text):
        raise HstapError(f"{path}:{text.count(chr(10), 0, pos) + 1}: invalid JSON: extra data after the list")


def _iter_file(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, raw record or BadRecord) for every record of one file."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        if path.name.endswith(".parquet"):
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
            yield from ((f"{path}:{row}", rec) for row, rec in enumerate(
                chain.from_iterable(b.to_pylist() for b in batches), 1))
            return
        with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
            if ".jsonl" in path.name:
                yield from _iter_jsonl(path, f)
                return
            data = f.read()  # .json: a list, or JSON Lines (what `datasets` writes as .json)
            if data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
                yield from iter_json_list(path, data)
            else:
                yield from _iter_jsonl(path, io.BytesIO(data))
    except (OSError, EOFError, pyarrow.ArrowException) as e:
        raise HstapError(f"{path}: cannot read: {one_line(e)}") from None


def _messages(rec: Any, open_turns: bool = False) -> tuple[str | None, list[dict]]:
    """(id or None, messages normalised to [{"role": system|user|assistant, "content": str}]); raises BadRecord.
    An assistant message cut at the token limit keeps `"finish_reason": "length"`; with `open_turns`, an assistant
    content of null is an open turn (content None) for `hstap generate` to fill."""
    if not isinstance(rec, dict):
        raise BadRecord("bad_record", f"record: expected a JSON object, got {type(rec).__name__}")
    if rec.get("messages") is not None and rec.get("conversations") is not None:
        raise BadRecord("unknown_format", "record: has both 'messages' and 'conversations'")
    key = "messages" if rec.get("messages") is not None else "conversations"
    conv = rec.get(key)
    if conv is None:
        raise BadRecord("unknown_format", "record: unknown format (expected a 'conversations' or 'messages' list)")
    if not isinstance(conv, list):
        raise BadRecord("bad_record", f"{key}: expected a list of messages, got {type(conv).__name__}")
    if not conv:
        raise BadRecord("empty_conversation", f"{key}: empty conversation")
    # ShareGPT ("from"/"value") or role/content, decided by the first message; the rest must follow it.
    sharegpt = key == "conversations" and isinstance(conv[0], dict) and conv[0].get("from") is not None
    rk, ck, names = ("from", "value", SHAREGPT_ROLES) if sharegpt else ("role", "content", ROLES)
    out = []
    for i, m in enumerate(conv):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise BadRecord("bad_record", f"{where}: expected an object, got {type(m).__name__}")
        role, content = m.get(rk), m.get(ck)
        if role is None:
            raise BadRecord("bad_record", f"{where}.{rk}: missing")
        if not isinstance(role, str) or role not in names:
            raise BadRecord("bad_record", f"{where}.{rk}: unknown role {role!r} (expected one of {', '.join(names)})")
        if content is None and ck in m and names[role] == "assistant":
            if not open_turns:
                raise BadRecord("open_turn", f"{where}.{ck}: null: an assistant turn left open for `hstap generate` to "
                                             "fill (run generate on this file first)")
            out.append({"role": "assistant", "content": None})
            continue
        if content is None:
            raise BadRecord("bad_record", f"{where}.{ck}: missing")
        if not isinstance(content, str):
            raise BadRecord("bad_record", f"{where}.{ck}: expected a string, got {type(content).__name__}")
        msg = {"role": names[role], "content": content}
        fin = m.get("finish_reason")
        if fin is not None and not isinstance(fin, str):
            raise BadRecord("bad_record", f"{where}.finish_reason: expected a string, got {type(fin).__name__}")
        if fin == "length" and msg["role"] == "assistant":
            msg["finish_reason"] = "length"  # cut at the token limit: prepare trains on no closing token after it
        reasoning = m.get("reasoning_content")
        if reasoning is not None and msg["role"] == "assistant":  # a reasoning model's thinking (data/reasoning.py)
            if not isinstance(reasoning, str):
                raise BadRecord("bad_record", f"{where}.reasoning_content: expected a string, got "
                                              f"{type(reasoning).__name__}")
            msg["reasoning_content"] = reasoning
        out.append(msg)
    rid = rec.get("id")
    if rid is not None:
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
            raise BadRecord("bad_record", f"id: expected a non-empty string or integer, got {rid!r}")
        rid = str(rid)
    return rid, out


def _digest(messages: list[dict]) -> str:
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return sha256_bytes(canonical.encode("utf-8", "surrogatepass"))


def conversation_id(messages: list[dict]) -> str:
    """The stable id of a record without one: sha256 of the normalised conversation (compact sorted JSON), 16 hex."""
    return _digest(messages)[:16]


def iter_records(files: list[Path], open_turns: bool = False) -> Iterator[tuple[str, Any]]:
    """(location, (id, messages, digest)) or (location, BadRecord) for every record of `files`, in order
    (`open_turns`: `_messages`)."""
    for path in files:
        for loc, rec in _iter_file(path):
            if isinstance(rec, BadRecord):
                yield loc, rec
                continue
            try:
                rid, messages = _messages(rec, open_turns)
            except BadRecord as e:
                yield loc, BadRecord(e.reason, f"{loc}: {e}")
                continue
            digest = _digest(messages)
            yield loc, (rid if rid is not None else digest[:16], messages, digest)


def count_skip(counts: Counter, reason: str, message: str, warn: bool = True) -> None:
    """Count a skipped record; print the first few bad ones (warnings are counted under the key None)."""
    counts[reason] += 1
    if warn and counts[None] < MAX_WARNINGS:
        counts[None] += 1
        print(f"hstap: warning: skipped {message}", file=sys.stderr)


def read_conversations(paths: str | Iterable[str], on_error: str = "fail",
                       open_turns: bool = False) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) for every record of `paths`, messages as [{"role": "system|user|assistant", "content": str}]
    (an answer cut at the token limit with `"finish_reason": "length"`; `open_turns`: generate's null answers allowed).

    Bad records raise HstapError("file:line: field: problem") with on_error="fail"; with "skip" they are skipped (the
    first few are printed on stderr). Whole-file problems (missing file, broken JSON list, bad gzip) always raise.
    """
    if on_error not in ("fail", "skip"):
        raise HstapError(f"on_error: expected 'fail' or 'skip', got {on_error!r}")
    skipped: Counter = Counter()
    for _, item in iter_records(expand_paths(paths), open_turns):
        if not isinstance(item, BadRecord):
            yield item[0], item[1]
        elif on_error == "fail":
            raise HstapError(str(item))
        else:
            count_skip(skipped, item.reason, str(item))
