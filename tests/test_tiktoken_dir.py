"""hstap.artifacts.tiktoken_dir through `load_tokenizer`: a Kimi-style tiktoken tokenizer directory (tiktoken.model, a remote-code
tokenizer class, tokenizer_config.json, chat_template.jinja; no tokenizer.json) read as a fast tokenizer whose ids equal
the remote class's, prepare on it, its hashes, and the refusals.

The directory is built here: a byte-level BPE trained tiktoken-style (merge the most frequent pair, its rank the next
id) on a small corpus of English, code, Chinese and Japanese split with Kimi's pattern; Kimi's special-token layout (the
256 ids after the ranks, a few named in added_tokens_decoder with gaps, `<think>`/`</think>`, tool-call markers that
are not special); a chat template that behaves as Kimi-K2.5's; and REMOTE, a tokenizer class written after the logic
of Moonshot's tokenization_kimi.py (the pattern is Kimi-K2/K2.5's, character for character). The reference side loads
that class with trust_remote_code=True (here only) and runs its plain `encode` (tiktoken, every special allowed),
which is what SGLang and vLLM feed Kimi."""

from __future__ import annotations

import base64
import json
import random
import shutil
from collections import Counter

import pytest

from hstap.common import HstapError
from hstap.data.chat import render, tokenize_conversation
from hstap.data.prepare_config import PrepareConfig
from hstap.data.prepare import load_prepared, prepare, read_meta
from hstap.artifacts.model_dir import chat_template_of, chat_template_sha256, load_tokenizer, tokenizer_sha256
from hstap.artifacts.tiktoken_dir import class_constants

REMOTE = r'''"""A tiktoken tokenizer after the logic of Moonshot's tokenization_kimi.py (Kimi-K2, Kimi-K2.5)."""

import os
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 256
    pat_str = "|".join([
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        assert os.path.isfile(vocab_file), vocab_file
        names = {i: t.content for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(base, base + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=self.pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        self.bos_id = self.special_tokens[str(bos_token)]
        self.eos_id = self.special_tokens[str(eos_token)]
        self.pad_id = self.special_tokens[str(pad_token)]
        self.unk_id = self.special_tokens[str(unk_token)]
        chars = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in chars.items()}
        self.decoder = {i: "".join(chars[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.n_words)}
        self.encoder = {v: k for k, v in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens, added_tokens_decoder=added_tokens_decoder,
                         **kwargs)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    @property
    def vocab_size(self):
        return self.n_words

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return (self.vocab_file,)
'''

TEMPLATE = (  # as Kimi-K2.5's: reasoning only after the last user message, the generation prompt opens the thinking
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>{%- endif -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}{%- endif -%}"
    "{{ m['content'] }}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}"
)

CORPUS = """The quick brown fox jumps over the lazy dog. I'm sure it's fine; we'll see what they've done. YOU'LL SEE.
def main():\n    print("hello, world")  # a comment\n    return 42\n\n\tif x  ==  y:\n\t\tpass\n
数据并行训练需要在多个设备之间同步梯度。模型在推理时使用草稿模型加速解码。世界你好，今天天气很好。
日本語のテキストも少し入れます。カタカナとひらがな。Ünïcödé naïve café résumé ΑΒΓ αβγ Ωmega straße.
Numbers: 1234567, 3.14159, 2026-05-21, 〇一二三. CAN'T WON'T Don't isn't. https://example.com/a/b?c=d&e=f
"""

# Kimi-K2.5's layout from the first special id on (its base is 163584): [BOS] [EOS] <|im_end|> <|im_user|>
# <|im_assistant|>, a gap, <|start_header_id|> <|end_header_id|>, a gap, [EOT] <|im_system|>, the tool-call markers
# (not special), a gap, <|im_middle|>, ..., <think> </think>, ..., [UNK] [PAD] in the last two.
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
            7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
            12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
            15: "<|tool_call_end|>", 17: "<|im_middle|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]"}


def train_ranks(text: str, pattern: str, size: int) -> dict[bytes, int]:
    """tiktoken-style byte BPE: the 256 bytes, then the most frequent adjacent pair (ties: the smallest) as the next
    rank, until `size` tokens or no pair occurs twice."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    words = Counter(p.encode() for p, _ in split.pre_tokenize_str(text))
    seqs = {w: [bytes([b]) for b in w] for w in words}
    ranks = {bytes([i]): i for i in range(256)}
    while len(ranks) < size:
        pairs = Counter()
        for w, s in seqs.items():
            for pair in zip(s, s[1:]):
                pairs[pair] += words[w]
        if not pairs:
            break
        (a, b), n = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if n < 2:
            break
        ranks[a + b] = len(ranks)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def build_kimi_dir(d):
    """The tokenizer files of a Kimi-K2.5 checkpoint, with a small vocabulary trained with the class's own pattern."""
    (d / "tokenization_kimi.py").write_text(REMOTE)
    pattern, _ = class_constants(d / "tokenization_kimi.py", "TikTokenTokenizer")
    ranks = train_ranks(CORPUS * 3, pattern, 700)
    assert len(ranks) > 500 and sum(map(is_han_word, ranks)) >= 3  # Han runs became tokens
    base = len(ranks)
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    decoder = {str(base + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": not c.startswith("<|tool_call")}
               for i, c in SPECIALS.items()}
    config = {"added_tokens_decoder": decoder,
              "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                            "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
              "clean_up_tokenization_spaces": False, "model_max_length": 1048576,
              "tokenizer_class": "TikTokenTokenizer"}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


def is_han_word(token: bytes) -> bool:
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return len(text) > 1 and all("\u4e00" <= c <= "\u9fff" for c in text)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return build_kimi_dir(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def slow(kimi_dir):
    """The remote class, as an engine run with --trust-remote-code loads it (tiktoken's file cache off)."""
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        tok = AutoTokenizer.from_pretrained(str(kimi_dir), trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    return tok


def texts(base: int, n: int = 400) -> list[str]:
    """Fixed cases, then random mixes of words, scripts, whitespace runs, punctuation and special tokens (`base`: the
    first special id)."""
    fixed = ["“Hello,” 世界世世世界世界——I'm ChatGPT. CAN'T wait 'til 2026.世界世界", "abc中文DEF  \n\n  x",
             "〇一二三4567 日本語のテキスト", "naïve café ΑΒΓ αβγ Ωmega", "    \n\t\t  spaces   ", "", " ", "\n",
             f"<|im_user|>user<|im_middle|>hi<|im_end|><think>x</think><|reserved_token_{base + 200}|>",
             "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
             "def f(x):\n    return x**2  # ok\n", "😀🎉 emoji\u200bzero-width e\u0301", "[BOS][EOS][PAD] <think>"]
    pool = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789世界你好数据模型训练日本語のテキスト〇一")
            + list(" \n\t\r.,;:'\"!?()[]{}<>|-_=+*/\\&^%$#@~`。，")
            + ["'s", "'T", "'re", "  ", "\n\n", "é", "ü", "Ω", "😀", "\u0301", "<|im_end|>", "<think>", "</think>",
               "<|im_middle|>", "[EOS]", "<|tool_call_end|>"])
    words = CORPUS.split()
    rng = random.Random(0)
    mixed = ["".join(rng.choice(pool) if rng.random() < 0.6 else rng.choice(["", " "]) + rng.choice(words)
                     for _ in range(rng.randint(1, 40))) for _ in range(n)]
    return fixed + mixed


def test_ids_equal_the_remote_tokenizer(kimi_dir, slow):
    tok = load_tokenizer(kimi_dir)
    assert tok.is_fast and len(tok) == len(slow) == slow.n_words and not (kimi_dir / "tokenizer.json").exists()
    base = slow.bos_id  # [BOS] is the first special id, after the ranks
    for t in texts(base):
        want = slow.encode(t)  # tiktoken, every special allowed: what the engines serve
        assert tok.backend_tokenizer.encode(t, add_special_tokens=False).ids == want, t
        assert tok(t)["input_ids"] == want == slow(t)["input_ids"], t  # no BOS added by either
        assert tok.decode(want) == t
    # every special id: the same text, the same specials, the same named ids
    assert [tok.decode([i]) for i in range(base, len(tok))] == [slow.decode([i]) for i in range(base, len(tok))]
    assert tok.special_tokens_map == slow.special_tokens_map
    assert sorted(tok.all_special_tokens) == sorted(slow.all_special_tokens)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == \
           (base + 0, base + 1, base + 255, base + 254) == (slow.bos_id, slow.eos_id, slow.pad_id, slow.unk_id)
    assert tok.convert_tokens_to_ids(["<think>", "</think>", "<|im_middle|>"]) == [base + 22, base + 23, base + 17]
    # the tool-call markers are matched as tokens but are not special (decode keeps them)
    markers = tok.convert_tokens_to_ids(["<|tool_call_begin|>", "<|im_end|>"])
    assert tok.decode(markers, skip_special_tokens=True) == "<|tool_call_begin|>"


def test_chat_template_renders_and_tokenizes_as_the_remote(kimi_dir, slow):
    tok = load_tokenizer(kimi_dir)
    assert chat_template_of(tok) == slow.chat_template == TEMPLATE
    conv = [{"role": "user", "content": "What is 世界? I'm asking."},
            {"role": "assistant", "content": "It means “world”.", "reasoning_content": "Translate 世界."},
            {"role": "user", "content": "And 你好?"},
            {"role": "assistant", "content": "Hello.\n\n  Done.", "reasoning_content": "A greeting: 你好."}]
    for msgs, gen, kw in ((conv, False, {}), (conv[:3], True, {}), (conv[:3], True, {"thinking": False})):
        text = slow.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
        assert render(tok, msgs, add_generation_prompt=gen, kwargs=kw) == text
        ids = slow.encode(text)
        assert tok.backend_tokenizer.encode(text, add_special_tokens=False).ids == ids
        assert tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False, **kw) == ids
    assert tokenize_conversation(tok, conv)[0].tolist() == slow.encode(slow.apply_chat_template(conv, tokenize=False))


def test_prepare_on_a_tiktoken_dir(kimi_dir, slow, tmp_path):
    conv = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Translate 世界 and 你好."},
            {"role": "assistant", "content": "World; hello.", "reasoning_content": "Two words: 世界, 你好."},
            {"role": "user", "content": "I'm done. CAN'T stop?"},
            {"role": "assistant", "content": "You can stop now.", "reasoning_content": "They're leaving."}]
    plain = [{"role": "user", "content": "print 42?"}, {"role": "assistant", "content": "def main():\n    return 42"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in (("r", conv), ("p", plain))))
    prepare(PrepareConfig(tokenizer=str(kimi_dir), data=[str(data)], out=str(tmp_path / "p"), max_len=512,
                          draft_vocab=64))
    rows = {r["id"]: r for r in load_prepared(tmp_path / "p")}
    tok = load_tokenizer(kimi_dir)
    # the turns the target emits: an earlier reasoning is dropped by the template (content + end of turn); the last
    # one is emitted from the end of the generation prompt ("...<think>") on, its thinking included
    emitted = {"r": ["World; hello.<|im_end|>", "They're leaving.</think>You can stop now.<|im_end|>"],
               "p": ["def main():\n    return 42<|im_end|>"]}
    for cid, msgs in (("r", conv), ("p", plain)):
        ids, mask = rows[cid]["input_ids"], rows[cid]["loss_mask"]
        assert ids == slow.encode(slow.apply_chat_template(msgs, tokenize=False))
        runs, cur = [], []
        for i, m in zip(ids, mask):
            if m:
                cur.append(i)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert [slow.decode(r) for r in runs] == emitted[cid]
    meta = read_meta(tmp_path / "p")
    assert meta["tokenizer_sha256"] == tokenizer_sha256(kimi_dir) == tokenizer_sha256(tok)
    assert meta["chat_template_sha256"] == chat_template_sha256(TEMPLATE) and meta["vocab_size"] == len(slow)
    assert sorted(p.name for p in kimi_dir.iterdir()) == ["chat_template.jinja", "tiktoken.model",
                                                          "tokenization_kimi.py", "tokenizer_config.json"]


def swap_last_ranks(d):
    *head, (a, ra), (b, rb) = [line.split() for line in (d / "tiktoken.model").read_text().splitlines()]
    lines = [*head, (a, rb), (b, ra)]
    (d / "tiktoken.model").write_text("".join(f"{t} {r}\n" for t, r in lines))


def test_hashes_are_stable_and_cover_the_tokenizer_files(kimi_dir, tmp_path):
    h = tokenizer_sha256(kimi_dir)
    assert tokenizer_sha256(load_tokenizer(kimi_dir)) == h and len(h) == 64  # a second load
    copy = shutil.copytree(kimi_dir, tmp_path / "elsewhere")
    assert tokenizer_sha256(copy) == h  # the files' content, not their place
    (copy / "chat_template.jinja").write_text(TEMPLATE.replace("You are Kimi", "You are K"))
    assert tokenizer_sha256(copy) == h  # the chat template has its own hash
    assert chat_template_sha256(chat_template_of(load_tokenizer(copy))) != chat_template_sha256(TEMPLATE)
    changed = {}
    for name, edit in (("pat_str", lambda d: (d / "tokenization_kimi.py").write_text(
                            REMOTE.replace('r"""[\\p{Han}]+""",\n', ""))),
                       ("added token", lambda d: (d / "tokenizer_config.json").write_text(
                            (d / "tokenizer_config.json").read_text().replace('"</think>"', '"</thinking>"'))),
                       ("ranks", swap_last_ranks)):
        d = shutil.copytree(kimi_dir, tmp_path / name.replace(" ", "_"))
        edit(d)
        changed[name] = tokenizer_sha256(d)
    assert len({h, *changed.values()}) == 4, changed


def test_a_kimi_k25_model_dir_reads_the_tiktoken_files(kimi_dir, slow, tmp_path):
    """A Kimi-K2.5 checkpoint's config.json says kimi_k25, for which transformers 5 (no remote code) converts
    tiktoken.model with its own default pattern; hstap reads the files and keeps the served ids."""
    d = shutil.copytree(kimi_dir, tmp_path / "kimi_k25")
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_k25",
                                               "architectures": ["KimiK25ForConditionalGeneration"]}))
    text = "I'm sure CAN'T 世界abc they'll"
    assert load_tokenizer(d, optional=True).backend_tokenizer.encode(text, add_special_tokens=False).ids \
        == slow.encode(text)


@pytest.mark.parametrize("case", ["nothing", "no_config", "no_auto_map", "no_class_file", "computed_pattern",
                                  "bad_rank_line", "unknown_eos", "outside_range"])
def test_unreadable_directories_are_refused_in_one_line(kimi_dir, tmp_path, case):
    d = tmp_path / "t"
    if case == "nothing":
        d.mkdir()
        (d / "config.json").write_text("{}")
        want = [f"{d}: no tokenizer: neither tokenizer.json nor a tiktoken tokenizer (tiktoken.model with "
                "tokenizer_config.json and its tokenizer class file)"]
    else:
        shutil.copytree(kimi_dir, d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        if case == "no_config":
            (d / "tokenizer_config.json").unlink()
            want = [f"{d / 'tokenizer_config.json'}: missing", "tiktoken.model"]
        elif case == "no_auto_map":
            del cfg["auto_map"]
            want = [f"{d / 'tokenizer_config.json'}: no auto_map.AutoTokenizer", "pat_str"]
        elif case == "no_class_file":
            (d / "tokenization_kimi.py").unlink()
            want = [f"{d / 'tokenization_kimi.py'}: missing", "tokenization_kimi.TikTokenTokenizer"]
        elif case == "computed_pattern":
            (d / "tokenization_kimi.py").write_text(REMOTE.replace('pat_str = "|".join([', 'pat_str = make("|", [', 1))
            want = [f"{d / 'tokenization_kimi.py'}: TikTokenTokenizer.pat_str: not found", "without running"]
        elif case == "bad_rank_line":
            lines = (d / "tiktoken.model").read_text().splitlines(keepends=True)
            (d / "tiktoken.model").write_text("".join(lines[:2] + ["not-base64! 2\n"] + lines[3:]))
            want = [f"{d / 'tiktoken.model'}:3: expected 'base64(token bytes) rank'"]
        elif case == "unknown_eos":
            cfg["eos_token"] = "<|endoftext|>"
            want = [f"{d / 'tokenizer_config.json'}: eos_token: '<|endoftext|>' is not one of the special tokens"]
        else:
            cfg["added_tokens_decoder"]["5"] = {"content": "<|low|>", "special": True}
            want = [f"{d / 'tokenizer_config.json'}: added_tokens_decoder['5'] ('<|low|>') is outside the special ids"]
        if case != "no_config":
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(HstapError) as e:
        load_tokenizer(d)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in want), msg
    if case != "nothing":  # a target directory refuses the same way: its tokenizer is there, and unreadable
        with pytest.raises(HstapError, match="tiktoken|tokenization_kimi|tokenizer_config"):
            load_tokenizer(d, optional=True)
