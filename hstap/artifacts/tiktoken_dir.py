"""A tiktoken tokenizer directory read as a fast tokenizer, without running its code.

Kimi-K2, Kimi-K2.5 (and Moonshot's other models) ship no tokenizer.json. Their tokenizer is a remote-code class
(`tokenization_kimi.TikTokenTokenizer`, named by tokenizer_config.json's `auto_map`) on the `tiktoken` package:
- `tiktoken.model`: one line per token, "base64(token bytes) rank", ranks 0..n-1;
- the class's `pat_str`: the regex that splits text before BPE (Kimi's keeps runs of Han characters apart from letters
  and binds English contractions to their word);
- `num_reserved_special_tokens` (256) ids after the ranks are special tokens, named by tokenizer_config.json's
  `added_tokens_decoder`, the others `<|reserved_token_ID|>`; plain `encode` matches all of them in text
  (`allowed_special="all"`), which is what a serving engine that runs the class feeds the model.

hstap builds the same tokenizer as a `tokenizers` BPE (the construction of transformers' `TikTokenConverter`: byte-level
vocabulary, the merges every token's two-part splits give, ordered by rank) behind a Split on `pat_str`, and adds the
special ids in order. `pat_str` and `num_reserved_special_tokens` are read from the class file's syntax tree (a string
literal, a `+` of literals or `"sep".join([...])` of literals), never by importing it. Nothing is written into the
directory.

Why not transformers: without trust_remote_code, transformers 5 converts a `kimi_k25` directory's tiktoken.model with
its default (cl100k-like) pattern and no Han rule: a fast tokenizer whose ids differ from the served ones on ordinary
text ("I'm" and "CAN'T" split differently, Han next to letters merges otherwise). `from_pretrained(...,
tokenizer_object=...)` converts again with that pattern and drops the object.

    from hstap.artifacts.tiktoken_dir import is_tiktoken_dir, load_tiktoken_dir
    tok = load_tiktoken_dir(Path("models/Kimi-K2.5"))   # a PreTrainedTokenizerFast
"""

from __future__ import annotations

import ast
import base64
import binascii
from pathlib import Path

from hstap.common import HstapError, one_line, read_json

TIKTOKEN_FILE = "tiktoken.model"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
LIST_SPECIALS = ("additional_special_tokens", "extra_special_tokens")


def is_tiktoken_dir(d: Path) -> bool:
    """A directory whose tokenizer is a tiktoken rank file: tiktoken.model and no tokenizer.json."""
    return (d / TIKTOKEN_FILE).is_file() and not (d / "tokenizer.json").is_file()


def load_tiktoken_dir(d: Path):
    """The fast tokenizer (`PreTrainedTokenizerFast`) of tiktoken directory `d`, with the ids its tokenizer class
    gives; its specials and chat template as tokenizer_config.json and chat_template.jinja state them. HstapError naming
    the file when a part cannot be read."""
    from transformers import PreTrainedTokenizerFast

    cfg_path = d / "tokenizer_config.json"
    config = read_tokenizer_config(cfg_path)
    cls_file, cls_name = class_file(d, config, cfg_path)
    pattern, reserved = class_constants(cls_file, cls_name)
    ranks = read_ranks(d / TIKTOKEN_FILE)
    tk = bpe_tokenizer(ranks, pattern, cls_file)
    names = special_names(config, cfg_path, len(ranks), reserved, cls_file)
    add_specials(tk, names, cfg_path)
    kw = special_kwargs(config, cfg_path, {n for n, _ in names.values()})
    if isinstance(config.get("model_max_length"), int):
        kw["model_max_length"] = config["model_max_length"]
    return PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=chat_templates(d, config),
                                   clean_up_tokenization_spaces=False, name_or_path=str(d), **kw)


# ---------------------------------------------------------------------------------------------------------------------
# The files


def read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        raise HstapError(f"{path}: missing; a tiktoken tokenizer ({TIKTOKEN_FILE}) needs it for its special tokens and "
                         "the tokenizer class (auto_map) whose split pattern it uses")
    return read_json(path)


def class_file(d: Path, config: dict, cfg_path: Path) -> tuple[Path, str]:
    """(the Python file, the class name) of tokenizer_config.json's auto_map.AutoTokenizer: "module.Class", also in a
    repository's "owner/repo--module.Class" form; the module is a file in `d`."""
    ref = (config.get("auto_map") or {}).get("AutoTokenizer") if isinstance(config.get("auto_map"), dict) else None
    if isinstance(ref, (list, tuple)):
        ref = next((r for r in ref if r), None)
    if not isinstance(ref, str) or "." not in ref:
        raise HstapError(f"{cfg_path}: no auto_map.AutoTokenizer naming the tokenizer class whose pat_str splits text "
                         f"for {TIKTOKEN_FILE}; hstap reads a tiktoken tokenizer only with it")
    module, _, name = ref.split("--")[-1].rpartition(".")
    path = d / (module.replace(".", "/") + ".py")
    if not path.is_file():
        raise HstapError(f"{path}: missing ({cfg_path.name}'s auto_map names {ref}; hstap reads its pat_str)")
    return path, name


def class_constants(path: Path, cls: str) -> tuple[str, int]:
    """(pat_str, num_reserved_special_tokens) of class `cls` in `path`, from the syntax tree; a name the class body
    assigns from is looked up among the module's assignments."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as e:
        raise HstapError(f"{path}: cannot parse: {one_line(e)}") from None
    module = assignments(tree.body)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise HstapError(f"{path}: no class {cls} (tokenizer_config.json's auto_map names it)")
    body = assignments(node.body)
    values = []
    for name, kind in (("pat_str", str), ("num_reserved_special_tokens", int)):
        try:
            value = literal(body[name], module, 0) if name in body else None
        except ValueError:
            value = None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise HstapError(f"{path}: {cls}.{name}: not found as a {kind.__name__} hstap can read without running the "
                             "file (a literal, literals joined with + or \"sep\".join([...]), or a module-level name "
                             "bound to one)")
        values.append(value)
    return values[0], values[1]


def assignments(body: list) -> dict:
    """name -> value node of the plain `name = value` / `name: T = value` statements of a body."""
    out = {}
    for n in body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            out[n.targets[0].id] = n.value
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
            out[n.target.id] = n.value
    return out


def literal(node, names: dict, depth: int):
    """The value of a constant expression: str/int literals, `+`, `"sep".join([...])`, module-level names.
    ValueError otherwise."""
    if depth > 8:
        raise ValueError("too deep")
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return literal(node.left, names, depth + 1) + literal(node.right, names, depth + 1)
    if isinstance(node, ast.Name) and node.id in names:
        return literal(names[node.id], names, depth + 1)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], (ast.List, ast.Tuple))):
        sep = literal(node.func.value, names, depth + 1)
        parts = [literal(e, names, depth + 1) for e in node.args[0].elts]
        if isinstance(sep, str) and all(isinstance(p, str) for p in parts):
            return sep.join(parts)
    raise ValueError("not a constant expression")


def read_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank of a tiktoken rank file; the ranks must be 0..n-1, each once (they are the ids)."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise HstapError(f"{path}: cannot read: {one_line(e)}") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise HstapError(f"{path}:{no}: expected 'base64(token bytes) rank'") from None
        if token in ranks:
            raise HstapError(f"{path}:{no}: token {token!r} listed twice")
        ranks[token] = rank
    if not ranks:
        raise HstapError(f"{path}: no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise HstapError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once (they are the token ids)")
    return ranks


# ---------------------------------------------------------------------------------------------------------------------
# The tokenizer


def bpe_tokenizer(ranks: dict[bytes, int], pattern: str, where: Path):
    """A `tokenizers` byte-level BPE with tiktoken's ids for `ranks` behind a Split on `pattern`. tiktoken merges the
    adjacent pair whose concatenation has the lowest rank; here every split of a token into two tokens is a merge with
    the token's rank, so the same pair wins (TikTokenConverter's construction). `ignore_merges`: a piece that is a
    token is that token, as in tiktoken."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # byte-level text: one character per byte, so a split of a token's bytes is the same split of its text
    table = bytes_to_unicode()  # byte -> character; str.translate maps the latin-1 character of each byte
    vocab = {t.decode("latin-1").translate(table): r for t, r in ranks.items()}
    merges = []
    for token, rank in vocab.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                merges.append((rank, vocab[left], vocab[right], left, right))
    merges.sort()
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    except Exception as e:  # noqa: BLE001 - the regex engine's error, about the user's file
        raise HstapError(f"{where}: pat_str: not a regex the tokenizers library compiles: {one_line(e)}") from None
    tk = Tokenizer(BPE(vocab, [(a, b) for *_, a, b in merges], fuse_unk=False, ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk


def special_names(config: dict, cfg_path: Path, base: int, reserved: int,
                  cls_file: Path) -> dict[int, tuple[str, bool]]:
    """id -> (text, special flag) of the ids base..base+reserved-1: added_tokens_decoder's names, the rest
    `<|reserved_token_ID|>` (special)."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise HstapError(f"{cfg_path}: added_tokens_decoder: expected an object id -> token")
    named = {}
    for key, tok in decoder.items():
        content = tok.get("content") if isinstance(tok, dict) else tok
        if not str(key).isdigit() or not isinstance(content, str) or not content:
            raise HstapError(f"{cfg_path}: added_tokens_decoder[{key!r}]: expected an id and a token with content")
        i = int(key)
        if not base <= i < base + reserved:
            raise HstapError(f"{cfg_path}: added_tokens_decoder[{key!r}] ({content!r}) is outside the special ids "
                             f"{base}..{base + reserved - 1} ({TIKTOKEN_FILE}'s {base} ranks, then "
                             f"{cls_file.name}'s num_reserved_special_tokens {reserved})")
        named[i] = (content, bool(tok.get("special", True)) if isinstance(tok, dict) else True)
    return {i: named.get(i, (f"<|reserved_token_{i}|>", True)) for i in range(base, base + reserved)}


def add_specials(tk, names: dict[int, tuple[str, bool]], cfg_path: Path) -> None:
    """Add the special ids in order: each takes the next id. Matched raw in text (normalized=False, no stripping), as
    tiktoken matches its specials; `special` only decides what decode(skip_special_tokens=True) drops."""
    from tokenizers import AddedToken

    for i, (content, special) in sorted(names.items()):
        token = AddedToken(content, normalized=False, special=special)
        (tk.add_special_tokens if special else tk.add_tokens)([token])
        if tk.token_to_id(content) != i:
            raise HstapError(f"{cfg_path}: added_tokens_decoder: {content!r} cannot take id {i} (it is listed twice "
                             "or is an ordinary token's text)")


def special_kwargs(config: dict, cfg_path: Path, names: set[str]) -> dict:
    """bos/eos/unk/pad and the additional special tokens of tokenizer_config.json, each one of the special ids' names
    (the tokenizer class looks each up among them)."""

    def text(v):
        return v.get("content") if isinstance(v, dict) else v

    kw = {}
    for key in NAMED_SPECIALS:
        v = text(config.get(key))
        if v is None:
            continue
        if v not in names:
            raise HstapError(f"{cfg_path}: {key}: {v!r} is not one of the special tokens (added_tokens_decoder)")
        kw[key] = v
    for key in LIST_SPECIALS:
        values = config.get(key)
        if isinstance(values, dict):  # transformers 5's {attribute name: token}
            values = list(values.values())
        if not values:
            continue
        values = [text(v) for v in values] if isinstance(values, list) else [None]
        missing = [v for v in values if v not in names]
        if missing:
            raise HstapError(f"{cfg_path}: {key}: {missing[0]!r} is not one of the special tokens "
                             "(added_tokens_decoder)")
        kw["additional_special_tokens"] = values
    return kw


def chat_templates(d: Path, config: dict):
    """The chat template as transformers reads it: chat_template.jinja and additional_chat_templates/*.jinja over
    tokenizer_config.json's `chat_template` (a string, or a list of {name, template}); a dict when there are several."""
    templates = {}
    if (d / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = read_text(d / CHAT_TEMPLATE_FILE)
    if (d / CHAT_TEMPLATE_DIR).is_dir():
        for f in sorted((d / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = read_text(f)
    if not templates:
        t = config.get("chat_template")
        if isinstance(t, list):
            return {e["name"]: e["template"] for e in t if isinstance(e, dict) and "name" in e and "template" in e}
        return t if isinstance(t, str) else None
    return templates["default"] if list(templates) == ["default"] else templates


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HstapError(f"{path}: cannot read: {one_line(e)}") from None
