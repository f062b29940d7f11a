"""Reasoning targets: prepare's ids and loss mask with the thinking of the answers, generate carrying each answer's
reasoning into the next turn's prompt (embedded engine and through `hstap serve`), the chat-template kwargs
(`enable_thinking`) in rendering, meta.json and the fit check.

The chat template behaves as Kimi-K2.5's does (no reasoning template ships in the venv): it reads an assistant
message's `reasoning_content` (nowhere else), wraps it in <think>...</think> for the turns after the last user message
and prints an empty <think></think> for earlier ones unless `preserve_thinking`, and its generation prompt opens the
thinking (`<think>`) unless `enable_thinking` is false (`<think></think>`: the answer comes at once)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from hstap.common import HstapError
from hstap.data.chat import render, render_prompt, tokenize_conversation
from hstap.data.reasoning import split_answer

REASONING_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}"
    "{% if m['role'] == 'assistant' %}"
    "{% if m.get('reasoning_content') is not none and ((preserve_thinking is defined and preserve_thinking)"
    " or loop.index0 > ns.last_user) %}{{ '<think>' + m['reasoning_content'] + '</think>' }}"
    "{% else %}{{ '<think></think>' }}{% endif %}{% endif %}"
    "{{ m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% else %}{{ '<think>' }}"
    "{% endif %}{% endif %}"
)

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "reasoning_content": "Think of arrays first.", "content": "A sequence."},
        {"role": "user", "content": "And a dict?"},
        {"role": "assistant", "reasoning_content": "Keys map to values here.", "content": "A mapping."}]


@pytest.fixture(scope="module")
def reasoning_target(tiny_tokenizer, tmp_path_factory):
    """A 4-layer random Llama whose tokenizer carries the reasoning template (and the tokenizer alone: its dir)."""
    from transformers import PreTrainedTokenizerFast

    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("reasoning-target")
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_tokenizer[1]))
    tok.chat_template = REASONING_TEMPLATE
    build_random_target(d, tok, model_type="llama", num_layers=4, hidden_size=64)
    return d, PreTrainedTokenizerFast.from_pretrained(str(d))


def masked_runs(tok, ids, mask) -> list[str]:
    """The text of each run of consecutive loss-masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_mask_counts_the_thinking_the_template_renders(reasoning_target):
    _, tok = reasoning_target
    for kwargs, runs in (
            # the first answer's reasoning is dropped (before the last user message): its content and end of turn
            # only; the last answer from its generation prompt on: reasoning, </think>, content, end of turn
            ({}, ["A sequence.<|end|>", "Keys map to values here.</think>A mapping.<|end|>"]),
            ({"preserve_thinking": True}, ["Think of arrays first.</think>A sequence.<|end|>",
                                           "Keys map to values here.</think>A mapping.<|end|>"])):
        ids, mask = tokenize_conversation(tok, CONV, kwargs)
        want = tok.apply_chat_template(CONV, tokenize=True, return_dict=False, **kwargs)  # what the template renders
        assert ids.tolist() == list(want)
        assert masked_runs(tok, ids, mask) == runs, kwargs
    dropped = render(tok, CONV)
    assert "Think of arrays first." not in dropped and "<|assistant|>\n<think></think>A sequence." in dropped
    # an answer cut at the token limit inside its thinking: trained up to the cut, the sample ends there
    cut = [*CONV[:4], {"role": "assistant", "reasoning_content": "Keys map", "content": "", "finish_reason": "length"}]
    ids, mask = tokenize_conversation(tok, cut)
    assert masked_runs(tok, ids, mask)[-1] == "Keys map" and tok.decode(ids.tolist()).endswith("<think>Keys map")


def test_enable_thinking_renders_differently(reasoning_target):
    _, tok = reasoning_target
    on = tok.decode(render_prompt(tok, CONV[:2]))
    off = tok.decode(render_prompt(tok, CONV[:2], {"enable_thinking": False}))
    assert on.endswith("<|assistant|>\n<think>") and off.endswith("<|assistant|>\n<think></think>")
    answer = {"role": "assistant", "content": "A sequence."}  # thinking off: the answer only, no reasoning
    ids, mask = tokenize_conversation(tok, [*CONV[:2], answer], {"enable_thinking": False})
    assert masked_runs(tok, ids, mask) == ["A sequence.<|end|>"]


def test_split_answer(reasoning_target):
    _, tok = reasoning_target
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompt_open = render_prompt(tok, CONV[:2])  # ends in <think>: the target starts inside its thinking
    prompt_off = render_prompt(tok, CONV[:2], {"enable_thinking": False})
    assert split_answer(tok, prompt_open, enc("Arrays first.</think>A sequence.")) == ("Arrays first.", "A sequence.")
    assert split_answer(tok, prompt_off, enc("<think>Hm.</think>Yes.")) == ("Hm.", "Yes.")
    assert split_answer(tok, prompt_open, enc("Arrays, then")) == ("Arrays, then", "")  # cut inside the thinking
    assert split_answer(tok, prompt_off, enc("A sequence.")) == (None, "A sequence.")
    special = type(tok).from_pretrained(tok.name_or_path)  # think tags as special tokens: skipped when decoded
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    o, c = special.convert_tokens_to_ids(["<think>", "</think>"])
    got = split_answer(special, [1], [o, *special.encode("Hm.", add_special_tokens=False), c,
                                      *special.encode("Yes.", add_special_tokens=False)])
    assert got == ("Hm.", "Yes.") and special.decode([o, c], skip_special_tokens=True) == ""


class PromptSpy:
    """Records every prompt an EmbeddedEngine renders (its messages and ids); the real method still renders them."""

    def __init__(self, monkeypatch):
        from hstap.data.decode import EmbeddedEngine

        self.calls: list[tuple[list[dict], list[int]]] = []
        real = EmbeddedEngine.render

        def render_spy(eng, messages, kwargs):
            ids = real(eng, messages, kwargs)
            self.calls.append(([dict(m) for m in messages], ids))
            return ids
        monkeypatch.setattr(EmbeddedEngine, "render", render_spy)


@pytest.mark.parametrize("engine", ["embedded", "server"])
def test_generate_carries_reasoning_into_the_next_prompt(reasoning_target, tmp_path, monkeypatch, engine):
    from hstap.data.generate_config import GenerateConfig
    from hstap.data.generate import generate

    target, tok = reasoning_target
    src = tmp_path / "in.jsonl"
    # two answers in a row after one question (a tool loop's shape): the first one's thinking is the turn in progress
    # when the second is asked for, and the template renders it back; the second conversation keeps it by kwarg
    recs = [{"id": "loop", "conversations": [{"role": "user", "content": "Count to three."},
                                             {"role": "assistant", "content": "old"},
                                             {"role": "assistant", "content": "old"}]},
            {"id": "chat", "conversations": [*[{k: v for k, v in m.items() if k != "reasoning_content"}
                                               for m in CONV]]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    spy = PromptSpy(monkeypatch)
    kw = dict(data=[str(src)], max_new_tokens=6, temperature=1.0, seed=3)
    server = None
    if engine == "server":
        from hstap.data.serve import ServeConfig, Server

        server = Server(ServeConfig(target=str(target), port=0))
        server.start()
        kw["server"] = f"http://127.0.0.1:{server.port}"
    else:
        kw["target"] = str(target)
    try:
        outs, calls = {}, {}
        for name, kwargs in (("plain", None), ("keep", '{"preserve_thinking": true}')):
            out = tmp_path / f"{engine}-{name}.jsonl"
            spy.calls = calls[name] = []
            with contextlib.redirect_stdout(io.StringIO()):
                generate(GenerateConfig(out=str(out), chat_template_kwargs=kwargs, **kw))
            outs[name] = {r["id"]: r["conversations"] for r in map(json.loads, out.read_text().splitlines())}
    finally:
        if server is not None:
            server.shutdown()
    for name, sid, first, second in (("plain", "loop", 1, 2), ("keep", "chat", 2, 4)):
        msgs = outs[name][sid]
        answer = msgs[first]
        # the random target never closes its thinking within 6 tokens: all of it is reasoning, cut at the limit
        assert answer["finish_reason"] == "length" and answer["content"] == "" and answer["reasoning_content"]
        # the prompt of the next answer, as the engine rendered it (the server gets the message without finish_reason)
        prompts = [tok.decode(ids) for m, ids in calls[name] if len(m) == second
                   and {k: v for k, v in m[first].items() if k != "finish_reason"}
                   == {k: v for k, v in answer.items() if k != "finish_reason"}]
        assert len(prompts) == 1, (name, [m for m, _ in calls[name]])
        assert f"<|assistant|>\n<think>{answer['reasoning_content']}</think><|end|>" in prompts[0]
    # without the kwarg, the chat's first answer is before the last question: its thinking is not rendered back
    chat = outs["plain"]["chat"]
    later = [tok.decode(ids) for m, ids in calls["plain"] if len(m) == 4]
    assert len(later) == 1 and chat[2]["reasoning_content"] not in later[0]
    assert "<|assistant|>\n<think></think><|end|>" in later[0]


def test_fit_check_refuses_other_template_kwargs(reasoning_target, tmp_path, capsys):
    from hstap.cli import main
    from hstap.data.generate_config import GenerateConfig
    from hstap.data.generate import generate
    from hstap.data.prepare import read_meta

    target, _ = reasoning_target
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "conversations": CONV[:3]}) + "\n")
    answers = tmp_path / "answers.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        generate(GenerateConfig(data=[str(src)], out=str(answers), target=str(target), max_new_tokens=4,
                                chat_template_kwargs='{"enable_thinking": false}'))
    capsys.readouterr()
    code = main(["prepare", "--tokenizer", str(target), "--data", str(answers), "--out", str(tmp_path / "p1")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and not (tmp_path / "p1").exists()
    assert err[0].startswith(f"hstap: error: {answers} (hstap generate, answers.jsonl.config.json): "
                             'chat_template_kwargs: made with {"enable_thinking": false}, this run renders with none')
    assert "--chat-template-kwargs '{\"enable_thinking\": false}'" in err[0]
    with pytest.raises(HstapError, match="not a template variable"):
        GenerateConfig(data=[str(src)], out=str(tmp_path / "x.jsonl"), target=str(target),
                       chat_template_kwargs='{"add_generation_prompt": true}')
    code = main(["prepare", "--tokenizer", str(target), "--data", str(answers), "--out", str(tmp_path / "p2"),
                 "--chat-template-kwargs", '{"enable_thinking":false}'])
    assert code == 0 and read_meta(tmp_path / "p2")["chat_template_kwargs"] == {"enable_thinking": False}


def test_eval_renders_conversations_with_the_template_kwargs(reasoning_target, tmp_path, capsys):
    """`hstap eval --chat-template-kwargs`, as generate and prepare take it: a conversations file's prompts are rendered
    with it (thinking off here, as the server would run the target); a prepared set's must be the ones prepare used."""
    from helpers.refusals import refused

    from hstap.cli import main, make_config
    from hstap.data.prompts import load_prompts
    from hstap.speculative.config import EvalConfig

    target, tok = reasoning_target
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "conversations": CONV[:3]}) + "\n")
    argv = ["--target", str(target), "--data", str(src), "--out", str(tmp_path / "e"), "--chat-template-kwargs",
            '{"enable_thinking": false}']
    cfg = make_config("eval", EvalConfig, argv)
    assert cfg.chat_template_kwargs == '{"enable_thinking":false}'
    off = load_prompts(str(src), tok, None, {"enable_thinking": False})
    assert off == [("a", render_prompt(tok, CONV[:2], {"enable_thinking": False}))] != load_prompts(str(src), tok)
    assert main(["eval", *argv, "--max-new-tokens", "2", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["prepare", "--tokenizer", str(target), "--data", str(src), "--out", str(tmp_path / "p")]) == 0
    refused(["eval", *argv[:2], "--data", tmp_path / "p", "--out", tmp_path / "e2", *argv[-2:]], capsys,
            "meta.json (hstap prepare): chat_template_kwargs: made with none, this run renders with "
            '{"enable_thinking": false}', untouched=[tmp_path / "e2"])
