"""The demo's toy target: training bounded by steps and a seed (bitwise reproducible), and the quality check that says
when a target is too weak to draft for."""

import pytest
import torch
from safetensors.torch import load_file

from hstap.demo.stage import MIN_TOY_ACCURACY, check_toy_target
from hstap.demo.toy import build_random_target, next_token_accuracy, train_toy_target

TINY = dict(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seq_len=32, batch_size=4,
            lr=1e-2)


def _weights(d):
    return load_file(str(d / "model.safetensors"))


def test_toy_target_is_bounded_by_steps_and_bitwise_reproducible(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer[0]
    texts = ["The quick brown fox jumps over the lazy dog. " * 8] * 4
    a = train_toy_target(tmp_path / "a", tok, texts, steps=5, seed=3, log=lambda s: None, **TINY)
    b = train_toy_target(tmp_path / "b", tok, texts, steps=5, seed=3, log=lambda s: None, **TINY)
    train_toy_target(tmp_path / "c", tok, texts, steps=5, seed=4, log=lambda s: None, **TINY)
    assert a["steps"] == b["steps"] == 5 and a["tokens"] == 5 * 4 * 32 and a["loss"] == b["loss"]
    wa, wb, wc = _weights(tmp_path / "a"), _weights(tmp_path / "b"), _weights(tmp_path / "c")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # same seed: the same bits
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)  # another seed: another model
    with pytest.raises(ValueError, match="fewer than one window"):
        train_toy_target(tmp_path / "d", tok, ["short"], steps=1, log=lambda s: None, **TINY)


def test_next_token_accuracy_tells_a_trained_target_from_a_random_one(tiny_tokenizer, tmp_path, capsys):
    tok = tiny_tokenizer[0]
    text = "def f(x):\n    return x + 1\n" * 12  # perfectly predictable after one period
    train_toy_target(tmp_path / "good", tok, [text] * 8, steps=60, seed=0, log=lambda s: None, **TINY)
    build_random_target(tmp_path / "bad", tok, num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1,
                        intermediate_size=64)
    from transformers import AutoModelForCausalLM

    good = next_token_accuracy(AutoModelForCausalLM.from_pretrained(str(tmp_path / "good")), tok, [text])
    bad = next_token_accuracy(AutoModelForCausalLM.from_pretrained(str(tmp_path / "bad")), tok, [text])
    assert good["tokens"] == bad["tokens"] == len(tok(text, add_special_tokens=False)["input_ids"]) - 1
    assert good["accuracy"] > 0.8 and bad["accuracy"] < MIN_TOY_ACCURACY
    # the demo's check prints the figure with its meaning, and says plainly when the target is too weak
    records = [{"id": "x", "conversations": [{"role": "user", "content": "Say it."},
                                             {"role": "assistant", "content": text}]}]
    r = check_toy_target(str(tmp_path / "bad"), records)
    out = capsys.readouterr().out
    assert r["weak"] and "too weak to draft for" in out and "next-token accuracy" in out
    r = check_toy_target(str(tmp_path / "good"), records)
    assert not r["weak"] and "WARNING" not in capsys.readouterr().out


def test_stdlib_conversations_extended_adds_methods_after_the_same_records():
    from hstap.demo.toy import stdlib_conversations

    base, ext = stdlib_conversations(), stdlib_conversations(extended=True)
    assert ext[:len(base)] == base and len(ext) > 1.5 * len(base)  # the default set (tests, benchmarks) is unchanged
    assert len({r["id"] for r in ext}) == len(ext) and ext == stdlib_conversations(extended=True)  # deterministic
    assert any(r["id"] == "json.JSONDecoder.decode" for r in ext)  # a method of a class
