"""hstap.artifacts.model_dir: the target fingerprint (config, weights, tokenizer, template), load_target's errors, and
the tokenizer hash."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from helpers.tokenizer import CHATML, variant_tokenizer

from hstap.common import HstapError
from hstap.artifacts.model_dir import load_target, load_tokenizer, target_fingerprint, tokenizer_sha256, weights_fingerprint


def test_fingerprint_and_load_errors(tiny_llama, tiny_deepseek, tmp_path):
    fp = target_fingerprint(tiny_llama)
    assert fp["config_sha256"] == hashlib.sha256((tiny_llama / "config.json").read_bytes()).hexdigest()
    assert fp["num_layers"] == 6 and fp["hidden_size"] == 64 and fp["model_type"] == "llama"
    assert fp["tokenizer_sha256"] and fp["chat_template_sha256"]
    assert fp == target_fingerprint(tiny_llama)
    assert fp["weights_fingerprint"] != target_fingerprint(tiny_deepseek)["weights_fingerprint"]
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    assert weights_fingerprint(copy) == fp["weights_fingerprint"]
    w = copy / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1  # one bit in the last tensor
    w.write_bytes(bytes(data))
    assert weights_fingerprint(copy) != fp["weights_fingerprint"]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (copy / f).unlink(missing_ok=True)
    nt = target_fingerprint(copy)
    assert nt["tokenizer_sha256"] is None and nt["chat_template_sha256"] is None
    assert load_target(copy)[1] is None

    with pytest.raises(HstapError, match="does not exist"):
        load_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HstapError, match="no config.json"):
        load_target(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(HstapError, match="cannot load the target model"):
        load_target(tmp_path / "empty")


def test_tokenizer_hash(ref_target, tiny_tokenizer, tmp_path_factory):
    a = tokenizer_sha256(ref_target)
    assert a == tokenizer_sha256(load_tokenizer(ref_target)) and len(a) == 64
    assert tokenizer_sha256(tiny_tokenizer[1]) != a
    # The chat template has its own hash; added tokens change the tokenizer's.
    chatml, _ = variant_tokenizer(tiny_tokenizer, tmp_path_factory, "chatml2", CHATML, ["<|im_start|>", "<|im_end|>"])
    other, _ = variant_tokenizer(tiny_tokenizer, tmp_path_factory, "tmpl", CHATML)
    assert tokenizer_sha256(other) == tokenizer_sha256(tiny_tokenizer[1]) != tokenizer_sha256(chatml)
