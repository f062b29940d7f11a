"""hstap.data (`hstap prepare`): readers, loss masks under several chat templates, outputs, vocab map, CLI."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hstap import cli
from hstap.common import HstapError
from hstap.conversations import conversation_id, read_conversations
from hstap.data import (PrepareConfig, assistant_spans, build_vocab_map, check_vocab_map, load_prepared, load_vocab_map,
                        prepare, read_meta, render_prompt, tokenize_conversation)
from hstap.model_dir import chat_template_sha256, load_tokenizer, tokenizer_sha256

REPO = Path(__file__).resolve().parent.parent

LLAMA3 = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (  # Qwen2.5: a default system prompt when the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN = (  # no special tokens and nothing after the content: header space and content merge into one BPE token
    "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}"
    "Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
TAIL = (  # reference layout plus a marker only at the very end of the conversation
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}<|pad|>{% endif %}"
)

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a tuple?"},
    {"role": "assistant", "content": "An immutable sequence."},
    {"role": "user", "content": "And a list?"},
    {"role": "assistant", "content": "A mutable one, written [1, 2]."},
]


def _variant(tiny_tokenizer, tmp_path_factory, name, template, specials=(), bos=None):
    """A copy of the toy tokenizer with extra special tokens and another chat template, saved and reloaded."""
    tok = load_tokenizer(tiny_tokenizer[1])
    tok.add_tokens(list(specials), special_tokens=True)
    if bos:
        tok.bos_token = bos
    tok.chat_template = template
    d = tmp_path_factory.mktemp(name)
    tok.save_pretrained(str(d))
    return load_tokenizer(d), d


def _expected(tok, pieces):
    """ids and mask built by tokenizing each rendered piece on its own: (text, 1 if the assistant emits it)."""
    ids, mask = [], []
    for text, flag in pieces:
        piece = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        ids += piece
        mask += [flag] * len(piece)
    return "".join(t for t, _ in pieces), ids, mask


def _check(tok, messages, pieces):
    text, want_ids, want_mask = _expected(tok, pieces)
    assert tok.apply_chat_template(messages, tokenize=False) == text  # the hand-built pieces are the template's
    ids, mask = tokenize_conversation(tok, messages)
    assert ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    return ids, mask


def test_mask_reference_template(ref_target):
    tok = load_tokenizer(ref_target)
    pieces = [("<|bos|>", 0)]
    for m in CONV:
        a = int(m["role"] == "assistant")
        pieces += [(f"<|{m['role']}|>\n", 0), (m["content"], a), ("<|end|>", a), ("\n", 0)]
    ids, mask = _check(tok, CONV, pieces)
    end = tok.convert_tokens_to_ids("<|end|>")
    assert [int(m) for i, m in zip(ids, mask) if i == end] == [0, 0, 1, 0, 1]  # only assistant turns' <|end|>
    # Eval prompts are a prefix of the training sequence; the mask starts right after them.
    prompt = render_prompt(tok, CONV[:-1])
    assert ids[:len(prompt)].tolist() == prompt and mask[len(prompt) - 1] == 0 and mask[len(prompt)] == 1


def test_mask_llama3_template_with_trim(tiny_tokenizer, tmp_path_factory):
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok, _ = _variant(tiny_tokenizer, tmp_path_factory, "llama3", LLAMA3, specials, "<|begin_of_text|>")
    conv = [{"role": "user", "content": "  Name a number. "},
            {"role": "assistant", "content": "\n Seven is one.  \n"},  # trimmed by the template
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Eight."}]
    pieces = [("<|begin_of_text|>", 0)]
    for m in conv:
        a = int(m["role"] == "assistant")
        pieces += [(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", 0), (m["content"].strip(), a),
                   ("<|eot_id|>", a)]
    _check(tok, conv, pieces)
    text, spans = assistant_spans(tok, conv)
    assert [(text[a:b], text[b:c]) for a, b, c in spans] == [("Seven is one.", "<|eot_id|>"), ("Eight.", "<|eot_id|>")]


def test_mask_chatml_template_with_default_system(tiny_tokenizer, tmp_path_factory):
    tok, _ = _variant(tiny_tokenizer, tmp_path_factory, "chatml", CHATML, ["<|im_start|>", "<|im_end|>"])
    conv = CONV[1:]  # no system message: the template injects one
    pieces = [("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", 0)]
    for m in conv:
        a = int(m["role"] == "assistant")
        pieces += [(f"<|im_start|>{m['role']}\n", 0), (m["content"], a), ("<|im_end|>", a), ("\n", 0)]
    _check(tok, conv, pieces)


def test_mask_end_of_conversation_marker(tiny_tokenizer, tmp_path_factory):
    # The end of turn is what the template prints before the next message starts (or before the end of the whole
    # rendering): the conversation-final <|pad|> belongs to the last turn only.
    tok, _ = _variant(tiny_tokenizer, tmp_path_factory, "tail", TAIL)
    pieces = [("<|bos|>", 0)]
    for i, m in enumerate(CONV):
        a = int(m["role"] == "assistant")
        last = i == len(CONV) - 1
        pieces += [(f"<|{m['role']}|>\n", 0), (m["content"], a), ("<|end|>", a), ("\n", int(last)),
                   *([("<|pad|>", 1)] if last else [])]
    _check(tok, CONV, pieces)


def test_mask_straddling_token(tiny_tokenizer, tmp_path_factory):
    tok, _ = _variant(tiny_tokenizer, tmp_path_factory, "plain", PLAIN)
    conv = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "answering now"}]
    text = tok.apply_chat_template(conv, tokenize=False)
    assert text == "User: Say it.\nAssistant: answering now\n"
    ids, mask = tokenize_conversation(tok, conv)
    # Character starts from decoding each token alone (ASCII text), independent of the offset mapping.
    starts = np.cumsum([0] + [len(tok.decode([int(i)])) for i in ids])
    assert "".join(tok.decode([int(i)]) for i in ids) == text
    c0, c1 = text.index("answering"), text.index(" now") + 4
    want = [int(s < c1 and e > c0) for s, e in zip(starts[:-1], starts[1:])]
    assert mask.tolist() == want
    first = int(np.argmax(mask))
    assert starts[first] == c0 - 1  # the first masked token carries the header's space: it straddles, and counts
    assert mask[-1] == 0 and tok.decode([int(ids[-1])]) == "\n"  # nothing after the content is part of the turn


def test_template_that_hides_content_is_refused(tiny_tokenizer, tmp_path):
    bad = tmp_path / "t.jinja"
    bad.write_text("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": CONV}) + "\n")
    with pytest.raises(HstapError, match=r"t\.jinja: messages\[1\]: .*exactly once"):
        prepare(PrepareConfig(tokenizer=str(tiny_tokenizer[1]), data=[str(data)], out=str(tmp_path / "o"),
                              chat_template=str(bad)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "t.jinja"]


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


DATA = [
    {"id": "a", "messages": [{"role": "user", "content": "Tell me about the json module."},
                             {"role": "assistant", "content": "The json module encodes and decodes JSON text."}]},
    {"conversations": [{"from": "human", "value": "Dump it."}, {"from": "gpt", "value": "Use json.dumps(obj)."},
                       {"from": "human", "value": "Load it."}, {"from": "gpt", "value": "Use json.loads(s)."}]},
    {"id": "long", "conversations": [{"role": "user", "content": "Repeat: " + "the decoder " * 40},
                                     {"role": "assistant", "content": "the decoder " * 40}]},  # truncated away
    {"id": "noasst", "messages": [{"role": "user", "content": "Only a question?"}]},
    {"id": "a", "messages": [{"role": "user", "content": "Tell me about the json module."},
                             {"role": "assistant", "content": "The json module encodes and decodes JSON text."}]},
    {"id": "b", "conversations": [{"role": "system", "content": "Short."}, {"role": "user", "content": "Indent?"},
                                  {"role": "assistant", "content": "Pass indent=2 to json.dumps for nested output."}]},
]


def _data_file(tmp_path, records, extra_lines=()):
    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(extra_lines))
    return f


def test_prepare_outputs(tiny_tokenizer, tmp_path, capsys):
    tok, tok_dir = tiny_tokenizer
    data = _data_file(tmp_path, DATA, ['{"id": "a", "messages": [{"role": "user", "content": "other"}]}\n',
                                       "not json\n"])
    cfg = PrepareConfig(tokenizer=str(tok_dir), data=[str(data)], out=str(tmp_path / "p"), max_len=40,
                        draft_vocab=30, on_error="skip")
    summary = prepare(cfg)
    printed = capsys.readouterr()
    assert "covers" in printed.out and f"skipped {data}:8: invalid JSON" in printed.err
    assert f"skipped {data}:7: id: 'a' is already used by an earlier, different conversation" in printed.err

    ds = load_prepared(tmp_path / "p")
    assert ds.column_names == ["id", "input_ids", "loss_mask"]
    turns = [("user", "Dump it."), ("assistant", "Use json.dumps(obj)."), ("user", "Load it."),
             ("assistant", "Use json.loads(s).")]
    h = conversation_id([{"role": r, "content": c} for r, c in turns])
    assert ds["id"] == ["a", h, "b"]
    full = [tokenize_conversation(tok, m) for _, m in read_conversations(str(data), on_error="skip")]
    full = [full[0], full[1], full[5]]  # written: the others are skipped
    for row, (ids, mask) in zip(ds, full):
        assert row["input_ids"] == ids[:40].tolist() and row["loss_mask"] == mask[:40].tolist()
    meta = read_meta(tmp_path / "p")
    c = meta["counts"]
    assert (c["read"], c["written"]) == (8, 3)
    assert c["skipped"] == {"bad_json": 1, "conflicting_id": 1, "duplicate": 1, "no_assistant": 1, "truncated_away": 1}
    assert c["truncated"] == sum(len(ids) > 40 for ids, _ in full) > 0
    assert c["total_tokens"] == sum(map(len, ds["input_ids"])) and c["masked_tokens"] == sum(map(sum, ds["loss_mask"]))
    assert meta["vocab_size"] == len(tok) and meta["tokenizer_sha256"] == tokenizer_sha256(tok_dir)
    assert meta["chat_template_sha256"] == chat_template_sha256(tok.chat_template)
    assert summary["written"] == 3 and summary["coverage_pct"] == meta["draft_vocab"]["coverage_pct"]

    # token_freq and the vocab map, recomputed from the dataset.
    counts = Counter(i for row in ds for i, m in zip(row["input_ids"], row["loss_mask"]) if m)
    from safetensors.numpy import load_file
    freq = load_file(str(tmp_path / "p" / "token_freq.safetensors"))["token_freq"]
    assert freq.dtype == np.int64 and len(freq) == len(tok)
    assert dict(counts) == {i: int(n) for i, n in enumerate(freq) if n}
    hot = sorted(sorted(counts, key=lambda i: (-counts[i], i))[:30])
    if len(hot) < 30:
        hot = sorted(hot + [i for i in range(len(tok)) if i not in counts][:30 - len(hot)])
    d2t, t2d = load_vocab_map(tmp_path / "p")
    assert d2t.tolist() == [t - i for i, t in enumerate(hot)] and t2d.nonzero().flatten().tolist() == hot
    coverage = 100 * sum(counts[i] for i in hot) / sum(counts.values())
    assert meta["draft_vocab"]["coverage_pct"] == pytest.approx(coverage, abs=1e-3)
    cfgj = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfgj["stage"] == "prepare" and cfgj["config"]["max_len"] == 40

    with pytest.raises(HstapError, match="already exists"):
        prepare(cfg)
    with pytest.raises(HstapError, match=rf"^{data}:7: id: 'a' is already used"):
        prepare(PrepareConfig(tokenizer=str(tok_dir), data=[str(data)], out=str(tmp_path / "q")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "p"]  # no temp dir left behind


def test_num_proc_gives_identical_output(tiny_tokenizer, tmp_path):
    recs = [{"messages": [{"role": "user", "content": f"Question {i} about item {i * 7}?"},
                          {"role": "assistant", "content": f"Answer {i}: " + "value " * (i % 9)}]} for i in range(300)]
    data = _data_file(tmp_path, recs)
    outs = []
    for n in (1, 2):
        prepare(PrepareConfig(tokenizer=str(tiny_tokenizer[1]), data=[str(data)], out=str(tmp_path / f"p{n}"),
                              num_proc=n, draft_vocab=50))
        outs.append(load_prepared(tmp_path / f"p{n}").to_dict())
    assert outs[0] == outs[1] and len(outs[0]["id"]) == 300
    for name in ("token_freq.safetensors", "vocab_map.safetensors"):
        assert (tmp_path / "p1" / name).read_bytes() == (tmp_path / "p2" / name).read_bytes()


def test_vocab_map_rules():
    freq = np.array([0, 5, 3, 5, 0, 1, 0, 0], dtype=np.int64)
    d2t, t2d = build_vocab_map(freq, 3)  # counts 5, 5, 3: ids 1, 3, 2
    assert (d2t + np.arange(3)).tolist() == [1, 2, 3] and t2d.nonzero()[0].tolist() == [1, 2, 3]
    d2t, t2d = build_vocab_map(freq, 2)  # the two 5s
    assert (d2t + np.arange(2)).tolist() == [1, 3]
    d2t, _ = build_vocab_map(np.array([0, 1, 1, 0, 2]), 2)  # tie between ids 1 and 2: the lower id wins
    assert (d2t + np.arange(2)).tolist() == [1, 4]
    d2t, t2d = build_vocab_map(freq, 6)  # 4 seen tokens, filled with the lowest unused ids 0 and 4
    assert (d2t + np.arange(6)).tolist() == [0, 1, 2, 3, 4, 5]
    d2t, t2d = build_vocab_map(freq, 100)  # clamped to V: identity
    assert d2t.tolist() == [0] * 8 and t2d.all()
    check_vocab_map(d2t, t2d, 8)
    import torch
    check_vocab_map(torch.tensor([1, 2]), torch.tensor([0, 1, 0, 1, 0], dtype=torch.bool), 5)
    for d, t, v, what in [([1, 0], [0, 1, 1, 0], 4, "strictly increasing"), ([3, 4], [0, 0, 0, 1, 1], 5, "leave"),
                          ([0, 1], [1, 0, 1, 1], 4, "exactly"), ([0], [1, 0], 3, "length 3"), ([-1], [1], 1, "leave")]:
        with pytest.raises(HstapError, match=what):
            check_vocab_map(np.array(d), np.array(t, dtype=bool), v)


def test_tokenizer_hash(ref_target, tiny_tokenizer, tmp_path_factory):
    a = tokenizer_sha256(ref_target)
    assert a == tokenizer_sha256(load_tokenizer(ref_target)) and len(a) == 64
    assert tokenizer_sha256(tiny_tokenizer[1]) != a
    # The chat template has its own hash; added tokens change the tokenizer's.
    chatml, _ = _variant(tiny_tokenizer, tmp_path_factory, "chatml2", CHATML, ["<|im_start|>", "<|im_end|>"])
    other, _ = _variant(tiny_tokenizer, tmp_path_factory, "tmpl", CHATML)
    assert tokenizer_sha256(other) == tokenizer_sha256(tiny_tokenizer[1]) != tokenizer_sha256(chatml)


def test_reference_example_and_no_template(ref_target, tiny_tokenizer, tmp_path):
    s = prepare(PrepareConfig(tokenizer=str(ref_target), data=[str(REPO / "examples" / "tiny_chat.jsonl")],
                              out=str(tmp_path / "p")))
    assert (s["read"], s["written"], s["skipped_total"], s["draft_vocab"]) == (20, 20, 0, 8192)
    tok = load_tokenizer(tiny_tokenizer[1])
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path / "nt"))
    with pytest.raises(HstapError, match="no chat template; pass --chat-template"):
        prepare(PrepareConfig(tokenizer=str(tmp_path / "nt"), data=[str(REPO / "examples" / "tiny_chat.jsonl")],
                              out=str(tmp_path / "q")))


def test_cli_end_to_end_and_replay(tiny_tokenizer, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths: config.json must hold absolute ones to replay from anywhere
    data = _data_file(tmp_path, DATA[:2] + DATA[5:])
    os.symlink(tiny_tokenizer[1], tmp_path / "tok")
    assert cli.main(["prepare", "--tokenizer", "tok", "--data", "data.jsonl", "--out", "p", "--max-len", "64",
                     "--draft-vocab", "40"]) == 0
    monkeypatch.chdir(REPO)
    assert cli.main(["prepare", "--config", str(tmp_path / "p" / "config.json"), "--out", str(tmp_path / "r")]) == 0
    assert load_prepared(tmp_path / "p").to_dict() == load_prepared(tmp_path / "r").to_dict()
    for name in ("token_freq.safetensors", "vocab_map.safetensors", "meta.json"):
        assert (tmp_path / "p" / name).read_bytes() == (tmp_path / "r" / name).read_bytes()
    assert read_meta(tmp_path / "r")["max_len"] == 64

    # The real command line on a file with a bad record: exit status 2, one line naming file:line, nothing left.
    data.write_text(data.read_text() + '{"messages": [{"role": "user"}]}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "hstap.cli", "prepare", "--tokenizer", "tok", "--data", "data.jsonl",
                        "--out", "bad"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"hstap: error: {data}:4: messages[0].content: missing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "p", "r", "tok"]
