"""hstap.data.conversations: every input format read to the same normalised records, stable ids, and bad records named by
file:line (skippable)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest

from hstap.common import HstapError
from hstap.data.conversations import conversation_id, read_conversations


def _write_inputs(d: Path) -> list[tuple[str | None, list[dict]]]:
    """The same kinds of conversation in every supported format; returns the expected (id, messages)."""
    sg = {"id": "sg", "conversations": [{"from": "system", "value": "S."}, {"from": "human", "value": "Q1"},
                                        {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"},
                                        {"from": "gpt", "value": "A2"}]}
    oa = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]}
    rc = {"id": 7, "conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    (d / "a.jsonl").write_text(json.dumps(sg) + "\n\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps(oa) + "\n")
    (d / "c.json").write_text("[\n" + json.dumps(rc) + "\n]\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pm = [{"role": "user", "content": "p?"}, {"role": "assistant", "content": "p!"}]
    pq.write_table(pa.Table.from_pylist([{"id": "pq", "messages": pm}]), d / "d.parquet")
    sg_msgs = [{"role": r, "content": c} for r, c in
               [("system", "S."), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")]]
    return [("sg", sg_msgs), (None, oa["messages"]), ("7", rc["conversations"]), ("pq", pm)]


def test_read_formats_and_ids(tmp_path):
    expected = _write_inputs(tmp_path)
    got = list(read_conversations([str(tmp_path)]))  # a directory: files in sorted order
    canonical = json.dumps(expected[1][1], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    made = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert got == [(rid or made, msgs) for rid, msgs in expected]
    assert conversation_id(expected[1][1]) == made


BAD = [  # (file content, line, message pattern)
    ('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [}\n', 2, r"invalid JSON: .*\(column 15\)"),
    ('{"text": "hello"}\n', 1, r"record: unknown format"),
    ('\n{"messages": [{"content": "a"}]}\n', 2, r"messages\[0\]\.role: missing"),
    ('{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt"}]}\n', 1,
     r"conversations\[1\]\.value: missing"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}\n', 1,
     r"messages\[1\]\.role: unknown role 'tool'"),
    ('{"messages": [{"role": "user", "content": ["a"]}]}\n', 1, r"messages\[0\]\.content: expected a string"),
    ('{"conversations": []}\n', 1, r"conversations: empty conversation"),
    (b'{"messages": [{"role": "user", "content": "a"}]}\n{"messages": "\xff\xfe"}\n', 2, r"not valid UTF-8"),
]


@pytest.mark.parametrize("content,line,pattern", BAD)
def test_bad_records_name_file_and_line(tmp_path, content, line, pattern):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(HstapError) as e:
        list(read_conversations(str(f)))
    msg = str(e.value)
    assert msg.startswith(f"{f}:{line}: ") and "\n" not in msg
    assert re.search(pattern, msg), msg
    good = sum(1 for ln in f.read_bytes().splitlines() if ln.strip()) - 1  # every case has one bad record
    assert len(list(read_conversations(str(f), on_error="skip"))) == good


def test_json_list_error_line(tmp_path):
    f = tmp_path / "l.json"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    f.write_text("[\n  " + json.dumps(good) + ",\n\n  " + json.dumps({"messages": [{"role": "user"}]}) + "\n]")
    with pytest.raises(HstapError, match=rf"^{f}:4: messages\[0\]\.content: missing$"):
        list(read_conversations(str(f)))
    f.write_text("[\n" + json.dumps(good) + ",\n" + json.dumps(good)[:-1] + "\n]")
    with pytest.raises(HstapError, match=rf"^{f}:4: invalid JSON"):
        list(read_conversations(str(f)))
