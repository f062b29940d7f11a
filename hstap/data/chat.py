"""A conversation through the target's chat template: the rendered text, its token ids, and which of them the assistant
emits (the loss mask rule of `hstap prepare`, its module docstring; used by prepare, generate's embedded engine, eval).

Every rendering passes the template the messages' `role`, `content` and, on an assistant message, its
`reasoning_content` (hstap/data/reasoning.py), plus the chat-template kwargs the server runs with
(`--chat-template-kwargs`, e.g. `{"enable_thinking": false}`).

Reasoning. An assistant turn whose reasoning the template prints (found with a sentinel, as its content is) is emitted
by the target from the end of its generation prompt on: the opening think tag where the template's generation prompt
leaves it to the model, the reasoning, the closing tag, the content and the end of turn all count in the mask (the
drafter learns the thinking tokens the target will serve). The turn's generation prompt is the conversation up to it
rendered with `add_generation_prompt`; where that is not a prefix of the whole rendering, the turn starts at its
reasoning. A turn whose reasoning the template drops (Kimi-K2.5's and Qwen3's for turns before the last user message)
keeps the content rule. A turn cut at the token limit inside its thinking (empty content) is trained up to the cut,
the end of its reasoning.
"""

from __future__ import annotations

import os
from itertools import chain

import numpy as np

from hstap.common import one_line
from hstap.data.conversations import BadRecord


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, kwargs: dict | None = None) -> str:
    """The chat template's text of `messages` (role, content, an assistant's reasoning_content) with `kwargs`."""
    msgs = []
    for m in messages:  # what a template sees: no finish_reason
        msg = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content") is not None:
            msg["reasoning_content"] = m["reasoning_content"]
        msgs.append(msg)
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - template code can raise anything (raise_exception, TypeError, ...)
        raise BadRecord("template_error", f"chat template: {one_line(e)}") from None


def _sentinel(text: str) -> str:
    s = "\ue000hstap\ue001"  # private-use characters: survive trim/strip and never occur in real text
    while s in text:
        s += "\ue001"
    return s


def _find_once(text: str, s: str, k: int, what: str = "content") -> int:
    i = text.find(s)
    if i < 0 or text.find(s, i + 1) >= 0:
        raise BadRecord("template_error", f"messages[{k}]: the chat template does not print the assistant {what} "
                                          "exactly once, so it cannot be located")
    return i


def _locate(tokenizer, messages: list[dict], k: int, field: str, full: str, kwargs: dict | None):
    """(start, end, the messages with the sentinel, the sentinel) of message k's `field` in the rendering `full`,
    found by rendering again with the field replaced by a sentinel; None when the template does not print the field
    for this message (only a reasoning may be dropped)."""
    sent = _sentinel(full)
    alt = [*messages[:k], {**messages[k], field: sent}, *messages[k + 1:]]
    marked = render(tokenizer, alt, kwargs=kwargs)
    if field != "content" and sent not in marked:
        return None
    i = _find_once(marked, sent, k, field)
    before, after = marked[:i], marked[i + len(sent):]
    if len(before) + len(after) > len(full) or not full.startswith(before) or not full.endswith(after):
        raise BadRecord("template_error", f"messages[{k}]: the chat template prints the rest of the conversation "
                                          f"differently when this assistant {field} changes; cannot locate it")
    return len(before), len(full) - len(after), alt, sent


def assistant_spans(tokenizer, messages: list[dict], kwargs: dict | None = None) -> tuple[str, list[tuple[int, int, int]]]:
    """The rendered conversation and, per assistant message, (start, end, end-of-turn end) character offsets in it:
    what the target emits starts at `start` (its content, or where its thinking begins: the module docstring) and its
    content ends at `end` (prepare's module docstring has the rule; an answer cut at the token limit has no
    end-of-turn: end-of-turn end = end, which for a cut inside the thinking is the end of the reasoning). Raises
    BadRecord when the template defeats the rule."""
    full = render(tokenizer, messages, kwargs=kwargs)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end, alt, sent = _locate(tokenizer, messages, k, "content", full, kwargs)
        after = full[end:]
        if k + 1 < len(messages):
            cut = render(tokenizer, alt[:k + 1], kwargs=kwargs)
            closing = cut[_find_once(cut, sent, k) + len(sent):].rstrip()
        else:
            closing = after.rstrip()
        was_cut = m.get("finish_reason") == "length"
        eot = os.path.commonprefix([after, closing]).rstrip() if not was_cut else ""
        if m.get("reasoning_content") is not None:
            r = _locate(tokenizer, messages, k, "reasoning_content", full, kwargs)
            if r is not None:  # the template prints this turn's reasoning: the target emitted it
                prompt = render(tokenizer, messages[:k], add_generation_prompt=True, kwargs=kwargs)
                r_start, r_end = r[0], r[1]
                begin = len(prompt) if full.startswith(prompt) and len(prompt) <= r_start else r_start
                if was_cut and not m["content"]:  # cut inside the thinking: trained up to the cut
                    spans.append((begin, r_end, r_end))
                    continue
                start = min(start, begin)
        spans.append((start, end, end + len(eot)))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], kwargs: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids (T,) int32, loss_mask (T,) int8) of a normalised conversation, untruncated. An answer cut at the
    token limit (`finish_reason` "length") is trained up to its cut and no further: no end-of-turn, and no token that
    reaches past its content (a BPE merge of its last characters with the template's closing text is not a token the
    target produced); when it is the conversation's last message the sample ends there, else the template's closing
    stays in context, untrained, since the next turn follows it."""
    text, spans = assistant_spans(tokenizer, messages, kwargs)
    # The backend directly: same ids as tokenizer(text, add_special_tokens=False) (what apply_chat_template does),
    # without the Python-side overhead, and never the parallel batch path (workers are the parallelism).
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int32)  # (T,)
    offsets = np.fromiter(chain.from_iterable(enc.offsets), np.int64, 2 * len(ids)).reshape(-1, 2)  # (T, 2) char spans
    starts = offsets[:, 0]  # (T,)
    ends = np.maximum(offsets[:, 1], starts + 1)  # (T,) a zero-width token counts as one character wide
    mask = np.zeros(len(ids), dtype=np.int8)  # (T,)
    cut = [m.get("finish_reason") == "length" for m in messages if m["role"] == "assistant"]
    for (start, end, eot_end), was_cut in zip(spans, cut):
        if was_cut:
            mask[(starts < end) & (ends > start) & (ends <= end)] = 1  # content up to the cut, nothing past it
            continue
        mask[(starts < end) & (ends > start)] = 1  # carries a content character
        eot = np.flatnonzero((starts >= end) & (ends <= eot_end))  # entirely inside the end-of-turn text
        while len(eot) and text[starts[eot[-1]]:ends[eot[-1]]].isspace():
            eot = eot[:-1]
        mask[eot] = 1
    if spans and cut[-1] and messages[-1]["role"] == "assistant":  # the last message was cut: the sample ends there
        n = int(np.searchsorted(ends, spans[-1][1], side="right"))  # tokens ending at or before the cut
        ids, mask = ids[:n], mask[:n]
    return ids, mask


def render_prompt(tokenizer, messages: list[dict], kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` under the chat template with the generation prompt (what eval/generate feed the target).
    Tokenized exactly like prepare's training sequences."""
    text = render(tokenizer, messages, add_generation_prompt=True, kwargs=kwargs)
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
