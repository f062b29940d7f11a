"""Toy targets built offline: a byte-level BPE tokenizer with a chat template, and small random-weight HF models.

Used by the tests (tiny random configs built in-process), by `hstap demo` (which trains such a target for a fixed number of
steps, a few CPU minutes, on text that ships with Python) and by the benchmarks (Llama-3.1-8B-shaped random weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

# Same chat layout as the reference target: <|bos|><|user|>\n...<|end|>\n<|assistant|>\n...<|end|>\n
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512, out_dir: str | Path | None = None):
    """Train a byte-level BPE tokenizer (ids 0..5 are the special tokens) and wrap it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>")
    hf.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf


def sample_texts() -> list[str]:
    """A few KB of varied English/code text for tiny tokenizers in tests (no files needed)."""
    import inspect
    import json
    import textwrap

    return [textwrap.dedent(inspect.getsource(m)) for m in (json.decoder, json.encoder, textwrap)]


# The router and rope fields of DeepSeek-V3's and Kimi-K2's config.json. HF's modeling hard-codes sigmoid + noaux_tc;
# SGLang reads moe_layer_freq; vLLM reads the router's (without topk_method it refuses the checkpoint's e_score_correction_bias), and its CPU rotary kernel
# rotates MLA's (tokens, heads, 64) query wrongly unless the rope is DeepSeek's yarn, as here (docs/engines.md).
DEEPSEEK_V3_FIELDS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
                      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "original_max_position_embeddings": 4096}}


def build_random_target(out_dir: str | Path, tokenizer=None, *, model_type: str = "llama", num_layers: int = 6,
                        hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                        vocab_size: int | None = None, seed: int = 0, dtype: str = "float32", **extra):
    """Save a random-weight HF causal LM (llama | qwen2 | qwen3 | mistral | deepseek_v3 | kimi_k25) and the tokenizer
    to `out_dir`; returns the causal LM.

    deepseek_v3 is MLA + MoE (DeepSeek-V3's and Kimi-K2's architecture). kimi_k25 is the same DeepseekV3 model, built
    from the same arguments (so the same weights), saved in Kimi-K2.5's layout (`save_kimi_k25_layout`)."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    wrapped = model_type == "kimi_k25"
    model_type = "deepseek_v3" if wrapped else model_type
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else 512
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
              num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, max_position_embeddings=4096,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if model_type == "deepseek_v3":
        kw["num_key_value_heads"] = num_heads  # MLA: one latent KV per head
        kw.update(moe_intermediate_size=intermediate_size // 2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=32,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=24,
                  **copy.deepcopy(DEEPSEEK_V3_FIELDS))
    elif model_type in ("llama", "qwen2", "qwen3", "mistral"):
        kw["head_dim"] = hidden_size // num_heads
    kw.update(extra)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    # HF's default init (std 0.02) makes every layer output nearly identical; a wider init keeps layers distinguishable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    model.eval()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    if wrapped:
        save_kimi_k25_layout(out_dir, seed)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return model


KIMI_VISION = {"hidden": 16, "heads": 2, "layers": 1, "pos_emb": 4, "merge": 2}  # a tiny MoonViT (real: 1152, 16, 27, 64)


def save_kimi_k25_layout(out_dir: str | Path, seed: int = 0) -> None:
    """Turn the DeepseekV3 causal LM saved in `out_dir` into a Kimi-K2.5 checkpoint of it, the layout of
    moonshotai/Kimi-K2.5: config.json `KimiK25ForConditionalGeneration` (model_type kimi_k25) with the language model's
    config under `text_config` (model_type kimi_k2), its tensors renamed `language_model.*` (`language_model.model.*`,
    `language_model.lm_head.weight`), beside a tiny random vision tower (`vision_tower.*`, the real checkpoint's names)
    and projector (`mm_projector.*`). transformers' Kimi_K25ForConditionalGeneration loads it with no tensor missing or
    left over, and computes the causal LM's logits on text."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    d = Path(out_dir)
    text = json.loads((d / "config.json").read_text())
    state = {"language_model." + k: v for k, v in load_file(str(d / "model.safetensors")).items()}
    state.update(_kimi_vision_tensors(text["hidden_size"], seed, getattr(torch, text.get("dtype") or "float32")))
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    v = KIMI_VISION
    text["model_type"] = "kimi_k2"
    vision = {  # the real checkpoint's names, then the ones transformers' Kimi_K25VisionConfig reads
        "patch_size": 14, "init_pos_emb_height": v["pos_emb"], "init_pos_emb_width": v["pos_emb"], "init_pos_emb_time": 4,
        "merge_kernel_size": [v["merge"], v["merge"]], "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
        "pos_emb_type": "divided_fixed", "vt_hidden_size": v["hidden"], "vt_intermediate_size": 2 * v["hidden"],
        "vt_num_attention_heads": v["heads"], "vt_num_hidden_layers": v["layers"], "mm_hidden_size": v["hidden"],
        "text_hidden_size": text["hidden_size"],
        "hidden_size": v["hidden"], "intermediate_size": 2 * v["hidden"], "num_attention_heads": v["heads"],
        "num_hidden_layers": v["layers"], "pos_emb_height": v["pos_emb"], "pos_emb_width": v["pos_emb"], "pos_emb_time": 4}
    conf = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            **{k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "dtype")
               if k in text},
            "projection_hidden_size": v["hidden"], "text_config": text, "vision_config": vision,
            "transformers_version": text.get("transformers_version")}
    (d / "config.json").write_text(json.dumps(conf, indent=2) + "\n")


def _kimi_vision_tensors(text_hidden: int, seed: int, dtype) -> dict:
    """The vision tower and projector of `KIMI_VISION`'s size, in moonshotai/Kimi-K2.5's tensor names."""
    import torch

    v = KIMI_VISION
    h, m = v["hidden"], v["hidden"] * v["merge"] ** 2  # the projector takes merge x merge patches at once
    g = torch.Generator().manual_seed(seed + 1)
    shapes = {"vision_tower.patch_embed.proj.weight": (h, 3, 14, 14), "vision_tower.patch_embed.proj.bias": (h,),
              "vision_tower.patch_embed.pos_emb.weight": (v["pos_emb"], v["pos_emb"], h),
              "vision_tower.encoder.final_layernorm.weight": (h,), "vision_tower.encoder.final_layernorm.bias": (h,),
              "mm_projector.pre_norm.weight": (h,), "mm_projector.pre_norm.bias": (h,),
              "mm_projector.proj.0.weight": (m, m), "mm_projector.proj.0.bias": (m,),
              "mm_projector.proj.2.weight": (text_hidden, m), "mm_projector.proj.2.bias": (text_hidden,)}
    for i in range(v["layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        shapes.update({b + "norm0.weight": (h,), b + "norm0.bias": (h,), b + "norm1.weight": (h,), b + "norm1.bias": (h,),
                       b + "wqkv.weight": (3 * h, h), b + "wqkv.bias": (3 * h,), b + "wo.weight": (h, h), b + "wo.bias": (h,),
                       b + "mlp.fc0.weight": (2 * h, h), b + "mlp.fc0.bias": (2 * h,), b + "mlp.fc1.weight": (h, 2 * h),
                       b + "mlp.fc1.bias": (h,)})
    return {k: (torch.randn(s, generator=g) * 0.1).to(dtype) for k, s in shapes.items()}


# --- the demo's toy target: Python's own documentation as chat data ----------------------------------------------
DEMO_MODULES = ("json", "os", "os.path", "collections", "itertools", "functools", "textwrap", "string", "re", "pathlib",
                "random", "statistics", "heapq", "bisect", "csv", "argparse", "shutil", "glob", "fnmatch", "math",
                "datetime", "calendar", "hashlib", "base64", "struct", "copy", "enum", "dataclasses", "typing", "abc",
                "contextlib", "operator", "pprint", "difflib", "html", "urllib.parse", "uuid", "zlib", "gzip", "tarfile",
                "zipfile", "tempfile", "logging", "unittest", "inspect", "ast", "tokenize", "io", "time", "threading",
                "queue", "subprocess", "socket", "email", "decimal", "fractions", "array", "weakref", "types", "sqlite3")


# `extended`: more modules, and the methods of every class (builtins' included): about twice the text
MORE_MODULES = ("builtins", "asyncio", "concurrent.futures", "multiprocessing", "codecs", "locale", "signal",
                "selectors", "pickle", "shelve", "configparser", "getopt", "platform", "sysconfig", "traceback",
                "warnings", "timeit", "cmd", "shlex", "secrets", "hmac", "binascii", "mimetypes", "mailbox", "wave",
                "colorsys", "graphlib", "numbers", "cmath", "zoneinfo", "sched", "contextvars", "linecache", "filecmp",
                "stat", "pkgutil", "importlib", "runpy", "dis", "symtable", "keyword", "reprlib", "bz2", "lzma",
                "plistlib", "netrc", "xml.dom.minidom", "xml.etree.ElementTree", "html.parser", "urllib.request",
                "http.client", "http.server", "socketserver", "ipaddress", "unicodedata", "gettext", "optparse",
                "collections.abc", "string.templatelib", "pdb", "trace", "ftplib", "smtplib", "imaplib", "poplib")


# Stdlib functions a library replaces when it is imported (torch.package sets inspect.getfile to an undocumented
# function of its own): left out, so that the records do not depend on what the caller imported before.
REPLACED_BY_LIBRARIES = frozenset({"inspect.getfile"})


def stdlib_conversations(max_chars: int = 700, extended: bool = False) -> list[dict]:
    """Deterministic chat data from text that ships with every Python: stdlib docstrings and pydoc topics.

    Each record is `{"id", "conversations": [{"role": "user", ...}, {"role": "assistant", ...}]}`: the user asks what a
    documented object does (or asks about a language topic) and the assistant answers with its documentation.
    `extended` appends MORE_MODULES' objects and the methods of every class (the records before them are the same).
    The same Python gives the same records whatever the process imported first: an object a third-party library put in
    a stdlib module's place (its `__module__` outside the standard library) is skipped, and so are the names in
    REPLACED_BY_LIBRARIES, replaced or not.
    """
    import importlib
    import inspect
    import sys
    import warnings

    out: list[dict] = []
    seen: set[str] = set()

    def stdlib_own(obj) -> bool:  # not put there by a third-party library (transformers adds Logger.warning_once)
        home = getattr(obj, "__module__", None)
        return not isinstance(home, str) or home.split(".")[0] in sys.stdlib_module_names

    def add(key: str, obj) -> None:
        doc = inspect.getdoc(obj)
        if not doc or len(doc) < 40 or doc in seen:
            return
        seen.add(doc)
        out.append({"id": key, "conversations": [
            {"role": "user", "content": f"What does `{key}` do?"},
            {"role": "assistant", "content": doc[:max_chars].strip()}]})

    def objects(modules):
        for mod_name in modules:
            try:
                mod = importlib.import_module(mod_name)
            except Exception:  # noqa: BLE001 - a module missing from a minimal Python is simply skipped
                continue
            for name in sorted(dir(mod)):
                obj = getattr(mod, name, None)
                key = f"{mod_name}.{name}"
                if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)
                                                 or inspect.isbuiltin(obj)) \
                        and key not in REPLACED_BY_LIBRARIES and stdlib_own(obj):
                    yield mod_name, key, obj

    with warnings.catch_warnings():  # reading deprecated attributes (typing.io, ...) warns; the docs are still text
        warnings.simplefilter("ignore", DeprecationWarning)
        for _, key, obj in objects(DEMO_MODULES):
            add(key, obj)
    try:
        from pydoc_data.topics import topics
        for name in sorted(topics):
            text = " ".join(topics[name].split())[:max_chars]
            out.append({"id": f"topic.{name}", "conversations": [
                {"role": "user", "content": f"Explain the Python topic {name}."},
                {"role": "assistant", "content": text}]})
    except ImportError:
        pass
    if extended:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for mod_name, key, obj in list(objects(DEMO_MODULES + MORE_MODULES)):
                if mod_name in MORE_MODULES:
                    add(key, obj)
                if inspect.isclass(obj):
                    for m in sorted(vars(obj)):
                        meth = getattr(obj, m, None)
                        if not m.startswith("_") and callable(meth) and stdlib_own(meth):
                            add(f"{key}.{m}", meth)
    return out


def train_toy_target(out_dir: str | Path, tokenizer, texts: list[str], *, steps: int = 600, num_layers: int = 6,
                     hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 384,
                     seq_len: int = 256, batch_size: int = 16, lr: float = 3e-3, seed: int = 0, log=print) -> dict:
    """Train a small Llama on `texts` (next-token loss on every token) for exactly `steps` optimizer steps; save it with
    the tokenizer. Returns {"steps", "tokens", "loss", "seconds"}.

    Bounded by steps and seeded (init, window order), never by wall clock: the same call gives bitwise the same weights
    at the same torch thread count, whatever else runs on the machine."""
    import math
    import time

    import torch

    torch.manual_seed(seed)
    model = build_random_target(out_dir, None, model_type="llama", num_layers=num_layers, hidden_size=hidden_size,
                                num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                                vocab_size=len(tokenizer), seed=seed)
    model.train()
    ids = torch.tensor([t for s in texts for t in tokenizer(s, add_special_tokens=False)["input_ids"]], dtype=torch.long)
    n_win = (len(ids) - 1) // seq_len
    if n_win < 1:
        raise ValueError(f"train_toy_target: {len(ids)} tokens, fewer than one window of {seq_len + 1}")
    windows = ids[: n_win * seq_len + 1]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    warmup = min(30, max(1, steps // 10))
    t0, tokens, loss_ema = time.perf_counter(), 0, None
    for step in range(steps):
        for group in opt.param_groups:  # linear warmup, then cosine to 0 at `steps`
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, n_win, (batch_size,), generator=g) * seq_len  # (B,)
        batch = torch.stack([windows[s: s + seq_len + 1] for s in starts.tolist()])  # (B, S+1)
        logits = model(input_ids=batch[:, :-1]).logits  # (B, S, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch_size * seq_len
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            el = time.perf_counter() - t0
            log(f"  toy target step {step + 1}/{steps}: loss {loss_ema:.3f}, {tokens / el:,.0f} tok/s")
    model.eval()
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return {"steps": steps, "tokens": tokens, "loss": loss_ema, "seconds": time.perf_counter() - t0}


def next_token_accuracy(model, tokenizer, texts: list[str], max_tokens: int = 20000, seq_len: int = 256) -> dict:
    """Greedy next-token accuracy of a causal LM on `texts`: the fraction of tokens (after the first of each text, at
    most `max_tokens` in all) that its top guess predicts exactly. Returns {"accuracy", "tokens"}.

    The demo's check that a toy target is worth drafting for: a drafter can only learn to guess what the target
    itself guesses, so a target that rarely predicts real text right gives a drafter nothing to learn."""
    import torch

    right = total = 0
    with torch.no_grad():
        for s in texts:
            ids = tokenizer(s, add_special_tokens=False)["input_ids"][: seq_len + 1]
            if len(ids) < 2 or total >= max_tokens:
                continue
            x = torch.tensor([ids])  # (1, T+1)
            pred = model(input_ids=x[:, :-1]).logits.argmax(-1)  # (1, T)
            right += int((pred == x[:, 1:]).sum())
            total += len(ids) - 1
    return {"accuracy": right / total if total else 0.0, "tokens": total}
