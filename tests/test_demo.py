"""`hstap demo` end to end on a few conversations with a toy target trained for two steps (the README command runs
the full-size demo): every stage, the toy-target check, the final table (no raw dict), the plots, and --out rules."""

import json
import subprocess
import sys

import pytest

from hstap.demo.toy import stdlib_conversations

pytestmark = [pytest.mark.procs, pytest.mark.slow]


def test_demo_runs_every_stage_and_reports_a_lossless_tau(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in stdlib_conversations(max_chars=200)[:40]))
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "hstap.cli", "demo", "--out", str(out), "--data", str(data),
                        "--max-samples", "40", "--target-steps", "2", "--generate-tokens", "8", "--train-steps", "3",
                        "--train.ttt", "2", "--eval-prompts", "2", "--max-new-tokens", "8", "--device", "cpu"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "demo.json").read_text())
    assert summary["conversations"] == {"train": 38, "eval": 2} and summary["toy_target"]["steps"] == 2
    assert summary["toy_target"]["tokens"] == 2 * 8 * 256  # bounded by steps: 2 steps of 8 windows of 256
    assert summary["toy_target"]["weak"] is True and "too weak to draft for" in r.stdout  # two steps: said plainly
    assert summary["eval"]["lossless"] is True and summary["eval"]["tau"] >= 1.0
    assert (out / "store" / "manifest.json").exists() and (out / "eval" / "report.json").exists()
    for stage in ("prepared", "store", "run", "eval"):
        assert json.loads((out / stage / "config.json").read_text())["stage"] in ("prepare", "capture", "train", "eval")
    for png in (out / "eval" / "acceptance.png", out / "run" / "curves.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the console: one table row per stage at the end, figures formatted, never a raw dict
    assert not [x for x in r.stdout.splitlines() if x.lstrip().startswith("{")]
    table = r.stdout.split("=== hstap demo: done ===")[1]
    for stage in ("target", "generate", "prepare", "capture", "train", "eval"):
        assert f"\n  {stage} " in table
    assert "hstap demo: tau = " in table and "tokens per target forward" in table
    # a second run over the same --out replaces the earlier demo; a foreign directory is refused
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    r = subprocess.run([sys.executable, "-m", "hstap.cli", "demo", "--out", str(foreign)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "holds files hstap did not write" in r.stderr and (foreign / "keep.txt").exists()
