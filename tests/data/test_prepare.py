"""hstap.data.prepare (`hstap prepare`): loss masks under several chat templates, outputs, CLI. The readers are
tests/data/test_conversations.py's, the vocab map rules tests/test_vocab_map.py's, the tokenizer hash tests/test_model_dir.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers.tokenizer import CHATML, variant_tokenizer

from hstap import cli
from hstap.common import HstapError
from hstap.data.conversations import conversation_id, read_conversations
from hstap.data.chat import assistant_spans, render_prompt, tokenize_conversation
from hstap.data.prepare_config import PrepareConfig
from hstap.data.prepare import load_prepared, prepare, read_meta
from hstap.artifacts.vocab_map import load_vocab_map
from hstap.artifacts.model_dir import chat_template_sha256, load_tokenizer, tokenizer_sha256

REPO = Path(__file__).resolve().parents[2]

LLAMA3 = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
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
    tok, _ = variant_tokenizer(tiny_tokenizer, tmp_path_factory, "llama3", LLAMA3, specials, "<|begin_of_text|>")
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
    tok, _ = variant_tokenizer(tiny_tokenizer, tmp_path_factory, "chatml", CHATML, ["<|im_start|>", "<|im_end|>"])
    conv = CONV[1:]  # no system message: the template injects one
    pieces = [("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", 0)]
    for m in conv:
        a = int(m["role"] == "assistant")
        pieces += [(f"<|im_start|>{m['role']}\n", 0), (m["content"], a), ("<|im_end|>", a), ("\n", 0)]
    _check(tok, conv, pieces)


def test_mask_cut_answers(tiny_tokenizer, tmp_path_factory):
    """An answer cut at generate's token limit (finish_reason "length") is trained up to the cut and no further: with a
    turn after it, its closing <|im_end|> stays in context untrained; as the last message, the sample ends at the cut."""
    tok, _ = variant_tokenizer(tiny_tokenizer, tmp_path_factory, "chatml-cut", CHATML, ["<|im_start|>", "<|im_end|>"])
    cut = {"finish_reason": "length"}
    conv = [CONV[1], {**CONV[2], **cut}, CONV[3], {**CONV[4], "finish_reason": "stop"}]
    pieces = [("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", 0)]
    for m in conv:
        a = int(m["role"] == "assistant")
        closed = int(a and m.get("finish_reason") != "length")
        pieces += [(f"<|im_start|>{m['role']}\n", 0), (m["content"], a), ("<|im_end|>", closed), ("\n", 0)]
    _check(tok, conv, pieces)
    full_ids, full_mask = tokenize_conversation(tok, CONV[1:])
    ids, mask = tokenize_conversation(tok, [*CONV[1:4], {**CONV[4], **cut}])
    assert ids.tolist() == full_ids[:-2].tolist()  # no closing <|im_end|> and newline: the sample ends at the cut
    assert mask.tolist() == full_mask[:-2].tolist() and tok.decode(ids[-1:]).endswith(".") and mask[-1] == 1


def test_mask_end_of_conversation_marker(tiny_tokenizer, tmp_path_factory):
    # The end of turn is what the template prints before the next message starts (or before the end of the whole
    # rendering): the conversation-final <|pad|> belongs to the last turn only.
    tok, _ = variant_tokenizer(tiny_tokenizer, tmp_path_factory, "tail", TAIL)
    pieces = [("<|bos|>", 0)]
    for i, m in enumerate(CONV):
        a = int(m["role"] == "assistant")
        last = i == len(CONV) - 1
        pieces += [(f"<|{m['role']}|>\n", 0), (m["content"], a), ("<|end|>", a), ("\n", int(last)),
                   *([("<|pad|>", 1)] if last else [])]
    _check(tok, CONV, pieces)


def test_mask_straddling_token(tiny_tokenizer, tmp_path_factory):
    tok, _ = variant_tokenizer(tiny_tokenizer, tmp_path_factory, "plain", PLAIN)
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


def test_a_draft_vocab_larger_than_the_answers_warns(tiny_tokenizer, tmp_path, capsys):
    tok, tok_dir = tiny_tokenizer
    data = _data_file(tmp_path, DATA)
    warned = {}
    for n in (len(tok) - 1, len(tok) + 10, None):  # a map mostly of padding; the identity map; just what was seen
        if n is None:
            n = read_meta(tmp_path / f"p{len(tok) - 1}")["draft_vocab"]["distinct_masked_tokens"]
        prepare(PrepareConfig(tokenizer=str(tok_dir), data=[str(data)], out=str(tmp_path / f"p{n}"), draft_vocab=n,
                              on_error="skip"))
        warned[n] = capsys.readouterr().err
    seen = read_meta(tmp_path / f"p{len(tok) - 1}")["draft_vocab"]["distinct_masked_tokens"]
    assert 0 < seen < len(tok) - 1
    assert (f"warning: the draft vocabulary ({len(tok) - 1}) is larger than the {seen:,} distinct tokens the answers "
            f"hold: {len(tok) - 1 - seen:,} of its slots") in warned[len(tok) - 1]
    assert "draft vocabulary" not in warned[len(tok) + 10] and "draft vocabulary" not in warned[seen]


@pytest.mark.procs
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


@pytest.mark.procs
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
