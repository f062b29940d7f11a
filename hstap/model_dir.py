"""Everything about reading a local HF model directory: device and dtype, config, tokenizer and chat template (and
their hashes), the target model, its embedding and lm_head, and the fingerprint a store header records.

Every stage that touches a target goes through here (capture, train, verify, eval, generate, the engines), so "which
model is this" is decided in one place. No model hub: paths are local directories only.

    from hstap.model_dir import load_target, target_fingerprint
    target, tok = load_target("models/Llama-3.1-8B-Instruct", device="cuda", dtype="bf16")
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from hstap.common import HstapError, one_line, sha256_bytes
from hstap.models.target import Target

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
FINGERPRINT_EDGE = 1 << 20  # bytes hashed at each end of a weight file


# ---------------------------------------------------------------------------------------------------------------------
# Device and dtype


def auto_device(device: str | torch.device) -> str:
    """The device a --device value names: "auto" -> "cuda" where torch sees a GPU, else "cpu"; any other as given."""
    if str(device) != "auto":
        return str(device)
    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_dtype(dtype: str, device: str | torch.device) -> str:
    """The compute dtype a --dtype value names on `device` (a --device value): "auto" -> "bf16" on CUDA (what serving
    engines run), "fp32" on the CPU (exact, tests); any other as given."""
    if dtype != "auto":
        return dtype
    return "bf16" if torch.device(auto_device(device)).type == "cuda" else "fp32"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto_device(device)` as a torch.device; "cuda" without an index -> the current CUDA device."""
    device = auto_device(device)
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HstapError(f"--device: {device} requested but CUDA is not available (torch {torch.__version__})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise HstapError(f"--device: expected cpu, cuda or auto, got {device!r}")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto_dtype(dtype, device)` as a torch.dtype."""
    dtype = auto_dtype(dtype, device)
    if dtype not in COMPUTE_DTYPES:
        raise HstapError(f"--compute-dtype: expected auto, fp32 or bf16, got {dtype!r}")
    return COMPUTE_DTYPES[dtype]


# ---------------------------------------------------------------------------------------------------------------------
# Config


def check_model_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise HstapError(f"{p}: target model directory does not exist")
    if not (p / "config.json").is_file():
        raise HstapError(f"{p}: not a HF model directory (no config.json)")
    return p


def load_config(path: str | os.PathLike):
    """The model's HF config; for multimodal wrappers the language model's (`text_config`), which has its shape."""
    from transformers import AutoConfig

    p = check_model_dir(path)  # a missing directory: our line, not the hub's "Repo id must be in the form ..."
    try:
        cfg = AutoConfig.from_pretrained(str(p))
    except (OSError, ValueError, KeyError) as e:
        raise HstapError(f"{p / 'config.json'}: cannot read the model config: {type(e).__name__}: {e}") from None
    return getattr(cfg, "text_config", None) or cfg


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

    Default: a fast tokenizer is required (prepare needs its offset mapping). optional=True (a target directory, which
    may come without one): None when the directory has no tokenizer files, and a slow tokenizer is accepted."""
    d = Path(path)
    if not d.is_dir():
        raise HstapError(f"{d}: tokenizer directory not found")
    if optional and not has_tokenizer(d):
        return None
    try:
        cls = json.loads((d / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    # The generic fast class needs no AutoTokenizer dispatch, whose import costs seconds (model registries).
    if cls in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        from transformers import PreTrainedTokenizerFast as AutoTokenizer
    else:
        from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, it is about the user's directory
        raise HstapError(f"{d}: cannot load tokenizer: {one_line(e)}") from None
    if not optional and (not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None):
        raise HstapError(f"{d}: a fast tokenizer (tokenizer.json) is needed for offset mapping")
    if chat_template_file is not None:
        tok.chat_template = read_chat_template(chat_template_file)
    return tok


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
    part of it: see `chat_template_sha256`."""
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

    dtype: "fp32" | "bf16" | "auto" (fp32 on CPU, bf16 on CUDA). Attention is SDPA, or eager for architectures without
    it."""
    p = check_model_dir(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one that matters
    kw: dict = {"dtype": dt}
    if dev.type == "cuda" and is_accelerate_available():  # transformers needs accelerate for device_map
        kw["device_map"] = {"": dev.index}  # load straight into GPU memory, not through a full CPU copy
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(p), attn_implementation="sdpa", **kw)
        except ValueError as e:
            if "attention" not in str(e).lower() and "sdpa" not in str(e).lower():
                raise
            model = AutoModelForCausalLM.from_pretrained(str(p), attn_implementation="eager", **kw)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:  # a damaged or incomplete directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise HstapError(f"{p}: cannot load the target model: {type(e).__name__}: {first}") from None
    if "device_map" not in kw:
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    return Target(model), load_tokenizer(p, optional=True)


def target_head(target_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding (V, H), lm_head (V, H)) read from the target's safetensors; lm_head = embedding when tied."""
    from safetensors import safe_open

    p = Path(target_dir)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        where = {k: p / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        where = {}
        for f in sorted(p.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                where.update({k: f for k in h.keys()})
    embed = "model.embed_tokens.weight" if "model.embed_tokens.weight" in where else next(
        (k for k in sorted(where) if k.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise HstapError(f"{p}: no *embed_tokens.weight in the target's safetensors (the drafter reuses the embedding)")
    head = "lm_head.weight" if "lm_head.weight" in where else embed  # absent = tied to the embedding

    def get(k):
        with safe_open(str(where[k]), framework="pt") as h:
            return h.get_tensor(k)

    e = get(embed)
    return e, (e if head == embed else get(head))


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
