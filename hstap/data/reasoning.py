"""Reasoning models (Kimi-K2.5, Qwen3, DeepSeek-R1, ...): the thinking part of an answer and the chat-template switches
that turn it on or off.

A reasoning model answers `<think>` reasoning `</think>` content. How a chat template renders that back in later turns
varies: Kimi-K2.5's reads the reasoning only from an assistant message's `reasoning_content` field (no fallback: a
reasoning left inside `content` is rendered as content, after an empty think block); Qwen3's reads `reasoning_content`
and otherwise splits `<think>` back out of `content`; both print it only for the turns after the last user message
(the turn in progress) and drop it for earlier ones, unless told to keep it. So hstap keeps an answer's reasoning in
`reasoning_content` where the template reads that field (`reads_reasoning`), and in `content`, think tags and all,
where it does not; `split_answer` does the split for the embedded engine, a server's reasoning parser for `--server`
(SGLang `--reasoning-parser`, vLLM `--reasoning-parser`: the answer's `reasoning_content`, or `reasoning`).

Whether the target thinks at all is a chat-template switch the server applies to every request (`enable_thinking` for
Qwen3, `thinking` for Kimi-K2.5 and DeepSeek-V3.1): `--chat-template-kwargs '{"enable_thinking": false}'`, given
alike to `hstap generate` (sent with each request, or passed to the embedded engine's template) and `hstap prepare`
(recorded in the prepared set's meta.json; hstap/data/fits.py refuses answers generated under other kwargs).
"""

from __future__ import annotations

import json

from hstap.common import HstapError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# apply_chat_template's own parameters: a template kwarg of the same name would collide with them
_RESERVED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(spec, what: str = "--chat-template-kwargs") -> dict:
    """The chat-template kwargs of a JSON object string (a dict from a --config file; None: none)."""
    if spec is None or spec == "":
        return {}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise HstapError(f"{what}: not JSON ({e}); expected an object such as '{{\"enable_thinking\": false}}'") \
                from None
    if not isinstance(spec, dict):
        raise HstapError(f"{what}: expected a JSON object such as '{{\"enable_thinking\": false}}', got "
                         f"{type(spec).__name__}")
    clash = sorted(set(spec) & _RESERVED)
    if clash:
        raise HstapError(f"{what}: {', '.join(clash)}: a parameter of apply_chat_template, not a template variable")
    return spec


def canonical_kwargs(spec, what: str = "--chat-template-kwargs") -> str | None:
    """`spec` as compact key-sorted JSON (None for none): how configs record it, so equal kwargs compare equal."""
    kw = template_kwargs(spec, what)
    return json.dumps(kw, sort_keys=True, separators=(",", ":")) if kw else None


def reads_reasoning(template: str | None) -> bool:
    """Whether a chat template renders an assistant message's `reasoning_content` field."""
    return isinstance(template, str) and "reasoning_content" in template


def split_answer(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> tuple[str | None, str]:
    """(reasoning or None, content) of an answer the target generated after `prompt_ids`. The reasoning ends at
    `</think>` (split at its token where it is one, so that a tokenizer that marks the think tags special loses
    nothing); an opening `<think>` is dropped. An answer that opened its thinking (or whose prompt did, as a template's
    generation prompt may) and never closed it was cut inside it: all of it is reasoning, the content is empty. No
    thinking at all: (None, the whole answer). The text is decoded as generated; templates add their own separators."""
    def dec(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    vocab = tokenizer.get_vocab()
    open_id, close_id = vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE)
    if open_id is not None and close_id is not None:  # the think tags are tokens: split on ids
        opened = open_id in new_ids or _inside(prompt_ids, open_id, close_id)
        body = new_ids[new_ids.index(open_id) + 1:] if open_id in new_ids else new_ids
        if close_id in body:
            i = body.index(close_id)
            return dec(body[:i]), dec(body[i + 1:])
        return (dec(body), "") if opened else (None, dec(new_ids))
    text = dec(new_ids)
    prompt = tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False)
    opened = THINK_OPEN in text or prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
    body = text.split(THINK_OPEN, 1)[1] if THINK_OPEN in text else text
    if THINK_CLOSE in body:
        reasoning, content = body.split(THINK_CLOSE, 1)
        return reasoning, content
    return (body, "") if opened else (None, text)


def _inside(ids: list[int], open_id: int, close_id: int) -> bool:
    """Whether `ids` end inside a think block (an opening after the last closing)."""
    last_open = max((i for i, t in enumerate(ids) if t == open_id), default=-1)
    last_close = max((i for i, t in enumerate(ids) if t == close_id), default=-1)
    return last_open > last_close


def answer_message(reasoning: str | None, content: str, finish: str) -> dict:
    """The assistant message of a generated answer, its reasoning (None: none) in `reasoning_content`."""
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    msg["finish_reason"] = finish
    return msg
