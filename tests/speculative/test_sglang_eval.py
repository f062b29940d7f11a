"""`hstap eval --engine sglang` with live SGLang 0.5.23 servers (the server venv, SGLang's generic CPU path, fp32), the
drafter of tests/conftest.py's `greedy_drafted` exported `--to sglang` on the fly.

What runs here: hstap's decoder (lossless, tau > 1), SGLang without speculation on the same prompts (its greedy outputs
equal hstap's target-only outputs, token for token), and SGLang's EAGLE-3 server, which sglang 0.5.23 does not start
on its CPU path (docs/engines.md, "SGLang's EAGLE-3 and `hstap eval --engine sglang`": the triton KV-copy warm-up
that speculative decoding turns on, and no EAGLE draft attention backend for torch_native): the report and the one
error line carry SGLang's own error. Where SGLang's EAGLE-3 does run (a GPU), the same test asserts that SGLang's counts (rounds, accepted
drafts by position) equal hstap's decoder and that its outputs with the drafter equal those without."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from helpers.sglang_live import server_venv

from hstap.common import HstapError

pytestmark = pytest.mark.sglang

K, N_NEW, PROMPTS = 3, 24, 8
CPU_BLOCKERS = ("0 active drivers",  # triton: the KV-copy warm-up speculative decoding turns on (memory_pool.py)
                "EAGLE is not supported in",  # speculative/draft_utils.py: no torch_native draft attention backend
                "sgl_kernel")  # SGLANG_USE_CPU_ENGINE: the CPU build of sgl_kernel (not on PyPI)


@pytest.fixture(scope="module")
def report(vllm_llama, greedy_drafted, tmp_path_factory):
    from hstap.config import from_flags
    from hstap.speculative.config import EvalConfig
    from hstap.speculative.evaluate import evaluate

    python = server_venv()
    greedy, run, _ = greedy_drafted
    out = tmp_path_factory.mktemp("sglang-eval") / "rep"
    printed, err = io.StringIO(), None
    with contextlib.redirect_stdout(printed):
        try:
            evaluate(from_flags(EvalConfig, target=str(vllm_llama), drafter=str(run), data=str(greedy), out=str(out),
                                k=K, max_new_tokens=N_NEW, device="cpu", engine="sglang", num_prompts=PROMPTS,
                                sglang_python=python))
        except HstapError as e:
            err = str(e)
    return json.loads((out / "report.json").read_text()), err, printed.getvalue(), out


def test_sglang_without_speculation_equals_hstaps_decoding(report):
    rep, _, printed, out = report
    s = rep["sglang"]
    assert s["version"] == "0.5.23" and s["batched_prompts"] == PROMPTS
    assert rep["lossless"] is True and rep["methods"]["eagle"]["tau"] > 1.2  # hstap's side: a drafter worth testing
    assert s["target_equal_hstap"] == PROMPTS
    for p in rep["prompts"]:  # SGLang's greedy target == hstap's speculative output == hstap's target-only output
        assert p["sglang_target_output_ids"] == p["output_ids"] and len(p["output_ids"]) > 0
    assert f"outputs equal hstap's target-only decoding on {PROMPTS}/{PROMPTS} prompts" in printed
    conf = json.loads((out / "sglang-drafter" / "config.json").read_text())  # exported for SGLang on the fly
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_sglang_eagle3_counts_equal_hstaps_or_the_reason_it_cannot_run(report):
    rep, err, printed, out = report
    s = rep["sglang"]
    sp = s["speculative"]
    if sp["ran"]:  # SGLang's EAGLE-3 ran (not on SGLang 0.5.23's CPU path): its counts must be hstap's
        a = s["agreement"]
        assert err is None and s["accepted"] > 0
        assert a["rounds_equal"] and a["accepted_per_pos_equal"], (s["accepted_per_pos"], a["hstap_accept_counts"])
        assert s["lossless"] is True and a["outputs_equal_hstap"] == PROMPTS
        return
    assert sp["device"] == "cpu" and any(b in sp["error"] for b in CPU_BLOCKERS), sp["error"]
    assert (out / "sglang-eagle3.log").is_file() and "--speculative-algorithm EAGLE3" in \
        (out / "sglang-eagle3.log").read_text()
    assert err is not None and err.startswith("--engine sglang: SGLang's EAGLE-3 server did not run: ")
    assert sp["error"] in err and "docs/engines.md" in err and str(out / "report.json") in err
    assert "SGLang EAGLE-3 (k=3): did not run:" in printed


def test_accepted_by_position_from_sglangs_histogram():
    """SGLang's `spec_correct_drafts_histogram[j]` counts the rounds that accepted j drafts
    (Req.update_spec_correct_drafts_histogram, srt/managers/schedule_batch.py); draft position i was accepted in every
    round that took more than i."""
    from hstap.speculative.sglang import spec_counts

    assert spec_counts({"spec_verify_ct": 5, "spec_correct_drafts_histogram": [1, 2, 0, 2]}, 3) == (5, [4, 2, 2])
    assert spec_counts({"spec_verify_ct": 2, "spec_correct_drafts_histogram": [2]}, 3) == (2, [0, 0, 0])
    assert spec_counts({}, 2) == (0, [0, 0])  # a request SGLang never verified (finished at its prefill)


def test_a_missing_server_python_is_refused_before_the_long_runs(vllm_llama, greedy_drafted, tmp_path):
    from hstap.config import from_flags
    from hstap.speculative.config import EvalConfig
    from hstap.speculative.evaluate import evaluate

    greedy, run, _ = greedy_drafted
    with pytest.raises(HstapError, match=r"--sglang-python: .*/nowhere/python does not exist"):
        evaluate(from_flags(EvalConfig, target=str(vllm_llama), drafter=str(run), data=str(greedy),
                            out=str(tmp_path / "r"), k=K, device="cpu", engine="sglang", num_prompts=2,
                            sglang_python=str(tmp_path / "nowhere" / "python")))
    assert not (tmp_path / "r" / "report.json").exists()
