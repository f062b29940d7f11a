"""The prompts a decoder is measured or served on: each sample's context before its last answer, as token ids.

`load_prompts` reads them from a prepared set (hstap prepare: each sample's tokens before its last assistant run of
the loss mask, `prompt_from_mask`) or a conversations file (each conversation's turns up to its last user turn,
rendered with the target's chat template): `hstap eval`'s prompts and the serve loop's requests.
"""

from __future__ import annotations

from pathlib import Path

from hstap.common import HstapError


def prompt_from_mask(input_ids: list[int], loss_mask: list[int]) -> list[int] | None:
    """The tokens before the last assistant answer: input_ids up to the first token of the last run of 1s."""
    end = len(loss_mask) - 1
    while end >= 0 and not loss_mask[end]:
        end -= 1
    if end < 0:
        return None
    start = end
    while start > 0 and loss_mask[start - 1]:
        start -= 1
    return list(input_ids[:start]) or None


def load_prompts(data: str, tokenizer, num_prompts: int | None = None,
                 template_kwargs: dict | None = None) -> list[tuple[str, list[int]]]:
    """[(id, prompt ids)] from a prepared dataset directory or a conversations file (rendered with the chat template's
    `template_kwargs`); samples without a usable turn are skipped."""
    out: list[tuple[str, list[int]]] = []
    want = num_prompts or float("inf")
    if Path(data).is_dir():
        from hstap.data.prepare import load_prepared

        ds = load_prepared(data)
        for row in ds:
            p = prompt_from_mask(row["input_ids"], row["loss_mask"])
            if p:
                out.append((str(row["id"]), p))
            if len(out) >= want:
                break
    else:
        from hstap.data.conversations import read_conversations
        from hstap.data.chat import render_prompt

        if tokenizer is None:
            raise HstapError(f"{data}: conversations need the target's tokenizer, and the target directory has none")
        for cid, messages in read_conversations([data]):
            last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
            if last_user >= 0:
                out.append((cid, render_prompt(tokenizer, messages[:last_user + 1], template_kwargs)))
            if len(out) >= want:
                break
    if not out:
        raise HstapError(f"{data}: no usable prompt (need an assistant turn in prepared data, a user turn in JSONL)")
    return out
