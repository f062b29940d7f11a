"""Everything about reading a local HF model directory: config, tokenizer and chat template (and their hashes), the
target model (on the device and dtype `hstap.device` resolves), its embedding and lm_head, and the fingerprint a store
header records.

Every stage that touches a target goes through here (capture, train, verify, eval, generate, the engines), so "which
model is this" is decided in one place. No model hub: paths are local directories only.

A multimodal wrapper (Kimi-K2.5: `KimiK25ForConditionalGeneration`, its language model's config under `text_config`, its
tensors under `language_model.` beside a vision tower) is, to hstap, its language model: that is what is loaded, sized,
fingerprinted, captured and drafted for, and where the embedding and lm_head are read (`text_weights`).

    from hstap.artifacts.model_dir import load_target, target_fingerprint
    target, tok = load_target("models/Llama-3.1-8B-Instruct", device="cuda", dtype="bf16")
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hstap.common import HstapError, one_line, sha256_bytes
from hstap.device import resolve_device, resolve_dtype
from hstap.models.target import Target
from hstap.artifacts.quantization import LOADING_ATTRIBUTES_WARNING, load_kwargs, quantization_of
from hstap.artifacts.tiktoken_dir import TIKTOKEN_FILE, is_tiktoken_dir, load_tiktoken_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", TIKTOKEN_FILE)
FINGERPRINT_EDGE = 1 << 20  # bytes hashed at each end of a weight file


# ---------------------------------------------------------------------------------------------------------------------
# Config


def check_model_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise HstapError(f"{p}: target model directory does not exist")
    if not (p / "config.json").is_file():
        raise HstapError(f"{p}: not a HF model directory (no config.json)")
    return p


def read_config(path: str | os.PathLike):
    """The HF config of the model class config.json names: for a multimodal wrapper (Kimi-K2.5's
    `KimiK25ForConditionalGeneration`, Llava, ...) the wrapper's, whose `text_config` is the language model hstap runs
    (`check_text_config`)."""
    from transformers import AutoConfig

    p = check_model_dir(path)  # a missing directory: our line, not the hub's "Repo id must be in the form ..."
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HstapError(f"{p / 'config.json'}: cannot read the model config: {one_line(e)}") from None
    if not isinstance(raw, dict):
        raise HstapError(f"{p / 'config.json'}: cannot read the model config: not a JSON object")
    if "text_config" in raw:
        check_text_config(p, raw, "a wrapper")
    try:
        cfg = AutoConfig.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 - the user's file: whatever transformers' field checks raise, one line
        raise HstapError(f"{p / 'config.json'}: cannot read the model config: {type(e).__name__}: {one_line(e)}") \
            from None
    if "text_config" in (getattr(type(cfg), "sub_configs", None) or {}):
        check_text_config(p, raw, f"a {type(cfg).__name__}")
    return cfg


def check_text_config(p: Path, raw: dict, what: str) -> None:
    """A wrapper's config.json (`raw`) states its language model as a mapping under `text_config`: where it is
    missing, null or empty, transformers builds its class's default in its place (Kimi-K2.5's: the full 61-layer
    Kimi-K2), another model than the checkpoint's. One line naming the field."""
    tc = raw.get("text_config", "missing")
    if not isinstance(tc, dict) or not tc:
        got = "it is missing" if tc == "missing" else f"got {json.dumps(tc)[:60]}"
        raise HstapError(f"{p / 'config.json'}: text_config: {what} states its language model's config there (a "
                         f"mapping: model_type, hidden_size, num_hidden_layers, ...); {got}")


def check_text_shape(p: Path, cfg, w: TextWeights) -> None:
    """The language model's config against its checkpoint before a model is built from it: the embedding is
    (vocab_size, hidden_size) and every decoder layer the config counts is there (a DeepSeek MTP layer may follow).
    A config of another size (a `text_config` of another model) is one line naming the field, not transformers'
    size-mismatch report."""
    from safetensors import safe_open

    text = text_config(cfg)
    where = f"{p / 'config.json'}: {'text_config.' if text is not cfg else ''}"
    with safe_open(str(w.files[w.embed]), framework="pt") as h:
        shape = tuple(h.get_slice(w.embed).get_shape())
    want = (int(text.vocab_size), int(text.hidden_size))
    for i, name in enumerate(("vocab_size", "hidden_size")):
        if len(shape) != 2 or shape[i] != want[i]:
            raise HstapError(f"{where}{name}: {want[i]}, but the checkpoint's {w.embed} is "
                             f"{' x '.join(map(str, shape))} (vocab_size x hidden_size): the config of another model")
    layer = re.compile(re.escape(w.base) + r"layers\.(\d+)\.")
    have = {int(m.group(1)) for k in w.files if (m := layer.match(k))}
    n, extra = int(text.num_hidden_layers), int(getattr(text, "num_nextn_predict_layers", 0) or 0)
    if have and not n <= len(have) <= n + extra:
        raise HstapError(f"{where}num_hidden_layers: {n}, but the checkpoint holds {len(have)} decoder layers: the "
                         f"config of another model")


def text_config(cfg):
    """The language model's config: a wrapper's `text_config`, else the config itself."""
    return getattr(cfg, "text_config", None) or cfg


def load_config(path: str | os.PathLike):
    """The model's HF config; for multimodal wrappers the language model's (`text_config`), which has its shape."""
    return text_config(read_config(path))


def tied_embeddings(cfg) -> bool:
    """Whether the lm_head is the embedding, read as transformers reads it when it loads the class config.json names:
    that config's own `tie_word_embeddings` (a wrapper's, not its text_config's), its class default when config.json
    leaves it out. Kimi-K2.5 writes false at both levels."""
    return bool(getattr(cfg, "tie_word_embeddings", False))


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template


def has_tokenizer(path: str | os.PathLike) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def read_chat_template(path: str | os.PathLike) -> str:
    """The text of a Jinja chat template file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HstapError(f"{path}: cannot read chat template: {one_line(e)}") from None
    if not text.strip():
        raise HstapError(f"{path}: empty chat template")
    return text


def load_tokenizer(path: str | os.PathLike, chat_template_file: str | os.PathLike | None = None, *,
                   optional: bool = False):
    """The HF tokenizer in directory `path`, with its chat template replaced by `chat_template_file` if given.

    A tiktoken directory (Kimi-K2/K2.5: tiktoken.model and a remote-code tokenizer class, no tokenizer.json) loads as
    the fast tokenizer `hstap.artifacts.tiktoken_dir` builds from its files, with the class's ids; remote code is never run.
    Default: a fast tokenizer is required (prepare needs its offset mapping). optional=True (a target directory, which
    may come without one): None when the directory has no tokenizer files, and a slow tokenizer is accepted."""
    d = Path(path)
    if not d.is_dir():
        raise HstapError(f"{d}: tokenizer directory not found")
    if not has_tokenizer(d):
        if optional:
            return None
        raise HstapError(f"{d}: no tokenizer: neither tokenizer.json nor a tiktoken tokenizer ({TIKTOKEN_FILE} with "
                         "tokenizer_config.json and its tokenizer class file)")
    tok = load_tiktoken_dir(d) if is_tiktoken_dir(d) else _auto_tokenizer(d)
    if not optional and (not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None):
        raise HstapError(f"{d}: transformers built a slow tokenizer ({type(tok).__name__}) and there is no tiktoken "
                         f"tokenizer ({TIKTOKEN_FILE}); prepare needs a fast one (tokenizer.json) for its offsets")
    if chat_template_file is not None:
        tok.chat_template = read_chat_template(chat_template_file)
    return tok


def _auto_tokenizer(d: Path):
    """transformers' tokenizer of a directory, remote code refused (never asked for on a terminal)."""
    try:
        cls = json.loads((d / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    # The generic fast class needs no AutoTokenizer dispatch, whose import costs seconds (model registries).
    if cls in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        from transformers import PreTrainedTokenizerFast

        load, kw = PreTrainedTokenizerFast.from_pretrained, {}
    else:
        from transformers import AutoTokenizer

        load, kw = AutoTokenizer.from_pretrained, {"trust_remote_code": False}
    try:
        return load(str(d), **kw)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, it is about the user's directory
        raise HstapError(f"{d}: cannot load tokenizer: {one_line(e)}") from None


def chat_template_of(tokenizer, where: str = "tokenizer") -> str:
    """The template apply_chat_template uses; HstapError if there is none."""
    t = tokenizer.chat_template
    if isinstance(t, dict):
        t = t.get("default")
    if not isinstance(t, str) or not t.strip():
        raise HstapError(f"{where}: the tokenizer has no chat template; pass --chat-template FILE")
    return t


def chat_template_sha256(template: str) -> str:
    return sha256_bytes(template.encode("utf-8"))


def tokenizer_sha256(tokenizer) -> str:
    """sha256 of what maps text to ids: the tokenizer's serialized JSON (vocab, merges, added tokens, normalizer,
    pre-tokenizer, post-processor, decoder; transient truncation/padding settings dropped) and its special tokens,
    as sorted compact JSON. Takes a directory or a loaded tokenizer (same value for both). The chat template is not
    part of it: see `chat_template_sha256`.

    For a tiktoken directory that JSON is the one `hstap.artifacts.tiktoken_dir` builds, a function of tiktoken.model (vocab,
    merges), the tokenizer class file's pat_str and num_reserved_special_tokens, and tokenizer_config.json's
    added_tokens_decoder and bos/eos/unk/pad: the same files give the same value wherever they are."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    canonical = {"tokenizer": state, "special_tokens": dict(tokenizer.special_tokens_map)}
    return sha256_bytes(json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str))


# ---------------------------------------------------------------------------------------------------------------------
# The target model


def load_target(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: str = "fp32"):
    """Load a local HF causal LM directory -> (Target in eval mode with frozen weights, tokenizer or None).

    A multimodal wrapper (Kimi-K2.5's `KimiK25ForConditionalGeneration`, ...) loads as its language model alone, a
    causal LM of its `text_config`, from the tensors `text_weights` finds (no vision tower). A tensor of the model
    missing from the checkpoint is an error, never a random initialisation. A quantized checkpoint (INT4 W4A16
    compressed-tensors, DeepSeek-V3's block FP8: hstap.artifacts.quantization) loads as the quantized model, its
    weights unpacked to the values they stand for; another quantization is one error line.

    dtype: "fp32" | "bf16" | "auto" (fp32 on CPU, bf16 on CUDA). Attention is SDPA, or eager for architectures without
    it."""
    p = check_model_dir(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        cfg = read_config(p)
    except HstapError as e:
        raise HstapError(f"{p}: cannot load the target model: {e}") from None
    from safetensors import SafetensorError
    from transformers.utils import is_accelerate_available
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one that matters
    kw: dict = {"dtype": dt, **load_kwargs(quantization_of(p))}
    try:
        weights = text_weights(p, cfg)
        check_text_shape(p, cfg, weights)
    except HstapError as e:
        raise HstapError(f"{p}: cannot load the target model: {e}") from None
    if text_config(cfg) is not cfg:
        kw.update(text_model_kwargs(p, cfg, weights))
    if dev.type == "cuda" and is_accelerate_available():  # transformers needs accelerate for device_map
        kw["device_map"] = {"": dev.index}  # load straight into GPU memory, not through a full CPU copy
    verbosity = hf_logging.get_verbosity()
    # transformers' load report: a missing tensor is our error below; unexpected ones (a wrapper's vision tower, a
    # DeepSeek MTP layer) are left out on purpose
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f".*{LOADING_ATTRIBUTES_WARNING}", category=UserWarning)
            model, info = _from_pretrained(p, kw)
    except (OSError, ValueError, KeyError, RuntimeError, ImportError, SafetensorError) as e:  # a damaged or incomplete
        # directory, or a quantized one without its package (compressed-tensors)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise HstapError(f"{p}: cannot load the target model: {type(e).__name__}: {first}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would run them randomly initialised
        raise HstapError(f"{p}: cannot load the target model: {len(missing)} of its tensors are not in the checkpoint "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an incomplete checkpoint")
    if "device_map" not in kw:
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    return Target(model), load_tokenizer(p, optional=True)


def _from_pretrained(p: Path, kw: dict):
    """(model, loading info) of AutoModelForCausalLM with SDPA attention, or eager where the architecture has no SDPA."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(p), attn_implementation="sdpa", output_loading_info=True, **kw)
    except ValueError as e:
        if "attention" not in str(e).lower() and "sdpa" not in str(e).lower():
            raise
        return AutoModelForCausalLM.from_pretrained(str(p), attn_implementation="eager", output_loading_info=True, **kw)


def text_model_kwargs(path: str | os.PathLike, cfg, weights: TextWeights | None = None) -> dict:
    """from_pretrained arguments that load a wrapper's language model as a causal LM of its own: its text config (the
    wrapper's tie flag, its quantization when only the wrapper states one) and the renames of `text_weights`."""
    import copy

    weights = weights or text_weights(path, cfg)
    text = copy.deepcopy(text_config(cfg))
    # Kimi-K2.5's text_config says model_type "kimi_k2"; transformers builds a DeepseekV3Config from it but keeps the
    # name, and picks a model's weight conversions (per-expert tensors -> fused experts) by model_type: the class's own.
    text.model_type = type(text).model_type
    text.tie_word_embeddings = weights.tied
    if getattr(text, "quantization_config", None) is None and getattr(cfg, "quantization_config", None) is not None:
        text.quantization_config = cfg.quantization_config
    return {"config": text, "key_mapping": weights.key_mapping()}


def target_head(target_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding (V, H), lm_head (V, H)) of the target's language model, read from its safetensors (`text_weights`);
    the lm_head is the embedding only where the config ties them and the checkpoint stores no head."""
    cfg = read_config(target_dir)
    w = text_weights(target_dir, cfg)
    check_text_shape(Path(target_dir), cfg, w)
    e = w.tensor(w.embed)
    return e, (e if w.head is None else w.tensor(w.head))


# ---------------------------------------------------------------------------------------------------------------------
# Where the language model's tensors are


EMBED = "embed_tokens.weight"
HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TextWeights:
    """Where a checkpoint keeps its language model. A causal LM: `model.*` and `lm_head.weight`; Kimi-K2.5:
    `language_model.model.*` and `language_model.lm_head.weight` beside `vision_tower.*` and `mm_projector.*`; a wrapper
    saved by transformers 4.5x: `model.language_model.*` and `lm_head.weight`."""

    source: Path
    """The file that lists the tensors: the safetensors index, the one safetensors file, or the directory."""
    files: dict = field(repr=False)
    """Tensor name -> the safetensors file holding it."""
    base: str
    """Prefix of the decoder's tensors (embed_tokens, layers, norm): "model.", "language_model.model.", ..."""
    head: str | None
    """The lm_head's tensor; None: tied to the embedding and not stored."""
    tied: bool
    """The config ties the lm_head to the embedding (`tied_embeddings`)."""

    @property
    def embed(self) -> str:
        return self.base + EMBED

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as h:
            return h.get_tensor(name)

    def key_mapping(self) -> dict[str, str]:
        """Regex renames from these names to a causal LM's (`model.*`, `lm_head.*`), for from_pretrained."""
        renames = {}
        if self.base != "model.":
            renames["^" + re.escape(self.base)] = "model."
        if self.head is not None and self.head != HEAD:
            renames["^" + re.escape(self.head[: -len("weight")])] = "lm_head."
        return renames


def head_names(base: str) -> list[str]:
    """Where a causal LM whose decoder sits under `base` keeps its lm_head, nearest first: beside the decoder's module
    ("language_model.model." -> "language_model.lm_head.weight"), then each level up to the top ("lm_head.weight")."""
    parts = base.rstrip(".").split(".")[:-1]  # the decoder module's parents
    return [".".join(parts[:i]) + "." + HEAD for i in range(len(parts), 0, -1)] + [HEAD]


def text_weights(path: str | os.PathLike, cfg=None) -> TextWeights:
    """Find the language model's embedding and lm_head among the target's safetensors (`cfg`: `read_config`'s, read
    when not given). The embedding is the one `*embed_tokens.weight` outside the decoder layers (a DeepSeek MTP layer
    has its own); the head is looked up beside it (`head_names`). A head that is not there is an error unless the
    config ties it to the embedding."""
    p = Path(path)
    cfg = read_config(p) if cfg is None else cfg
    source, files = tensor_files(p)
    embeds = sorted(k for k in files if k.endswith(EMBED) and ".layers." not in "." + k)
    if not embeds:
        raise HstapError(f"{source}: no *{EMBED} among the target's tensors (the drafter reuses the embedding)")
    if len(embeds) > 1:
        raise HstapError(f"{source}: several embeddings ({', '.join(embeds)}): cannot tell which is the language "
                         "model's")
    base = embeds[0][: -len(EMBED)]
    tried = head_names(base)
    head = next((k for k in tried if k in files), None)
    tied = tied_embeddings(cfg)
    if head is None and not tied:
        raise HstapError(f"{source}: no lm_head among the target's tensors (tried {', '.join(tried)}) and "
                         f"{p / 'config.json'} does not tie it to the embedding (tie_word_embeddings false): an "
                         "incomplete checkpoint")
    return TextWeights(source, files, base, head, tied)


def tensor_files(path: Path) -> tuple[Path, dict]:
    """(the file that lists them, tensor name -> safetensors file) of a model directory."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return index, {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HstapError(f"{index}: cannot read the weight map: {type(e).__name__}: {e}") from None
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise HstapError(f"{path}: no *.safetensors weights (hstap reads the target's embedding and lm_head from them)")
    from safetensors import SafetensorError

    files = {}
    for f in shards:
        try:
            with safe_open(str(f), framework="pt") as h:
                files.update({k: f for k in h.keys()})
        except (SafetensorError, OSError) as e:
            raise HstapError(f"{f}: cannot read its safetensors header: {one_line(e)}") from None
    return (shards[0] if len(shards) == 1 else path), files


# ---------------------------------------------------------------------------------------------------------------------
# Fingerprint (the `target` block of a store header)


def weights_fingerprint(path: str | os.PathLike) -> str:
    """A fingerprint of the weight files, NOT a full hash: sha256 over, for each weight file sorted by name, its name,
    its size, its safetensors header (tensor names, dtypes, shapes, offsets) and its first and last 1 MiB.

    Why not a full hash: hashing 16 GB (8B bf16) to 1.4 TB (a 700B model) would dominate a short capture and run again
    on every resume. Renamed, resized, re-sharded, re-typed or re-shaped weights change the fingerprint; so does
    anything that touches the ends of a file. An in-place edit of bytes in the middle of a file with the same layout
    does not."""
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(f for f in p.iterdir()
                   if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES) and not f.name.startswith("."))
    if not files:  # the hash of nothing would go into a store header and refuse the complete directory later
        raise HstapError(f"{p}: no weight files ({', '.join('*' + x for x in WEIGHT_SUFFIXES)}): not a complete model "
                         "directory")
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if f.name.endswith(".safetensors") and size >= 8:
                n = int.from_bytes(fh.read(8), "little")
                if 8 + n <= min(size, 1 << 28):  # a sane header; a corrupt length just falls back to the edges
                    h.update(fh.read(n))
            fh.seek(0)
            h.update(fh.read(FINGERPRINT_EDGE))
            if size > FINGERPRINT_EDGE:
                fh.seek(max(FINGERPRINT_EDGE, size - FINGERPRINT_EDGE))
                h.update(fh.read(FINGERPRINT_EDGE))
    return f"edges-sha256:{h.hexdigest()}"


def target_fingerprint(path: str | os.PathLike, tokenizer=None) -> dict:
    """The `target` block of a store header; reads config.json, the tokenizer files and the ends of the weight files.

    tokenizer_sha256 / chat_template_sha256 are computed as `hstap prepare` does, None when the directory has no (fast)
    tokenizer or no chat template. `vocab_size` (the embedding rows) is added for the data check."""
    p = check_model_dir(path)
    raw = (p / "config.json").read_bytes()
    cfg = load_config(p)
    tok_sha = tmpl_sha = None
    if tokenizer is None:
        tokenizer = load_tokenizer(p, optional=True)
    if tokenizer is not None:
        try:
            tok_sha = tokenizer_sha256(tokenizer)
        except (AttributeError, HstapError):  # a slow tokenizer: prepare could not have used it either
            tok_sha = None
        try:
            tmpl_sha = chat_template_sha256(chat_template_of(tokenizer, str(p)))
        except HstapError:
            tmpl_sha = None
    return {"path": str(p.resolve()), "model_type": cfg.model_type, "num_layers": int(cfg.num_hidden_layers),
            "hidden_size": int(cfg.hidden_size), "vocab_size": int(cfg.vocab_size), "config_sha256": sha256_bytes(raw),
            "weights_fingerprint": weights_fingerprint(p), "tokenizer_sha256": tok_sha,
            "chat_template_sha256": tmpl_sha}
