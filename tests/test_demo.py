"""`hstap demo` end to end on a small random target and a few conversations (the toy-target stage is exercised by the
README command itself; here it is skipped with --target to keep the CPU suite short)."""

import json
import subprocess
import sys

from hstap.toy import build_random_target, stdlib_conversations


def test_demo_runs_every_stage_and_reports_a_lossless_tau(tiny_tokenizer, tmp_path):
    target = tmp_path / "target"
    build_random_target(target, tiny_tokenizer[0], num_layers=8, hidden_size=64)  # 8 layers: default taps [1, 3, 4]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in stdlib_conversations(max_chars=200)[:40]))
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "hstap.cli", "demo", "--out", str(out), "--target", str(target),
                        "--data", str(data), "--max-samples", "40", "--train-steps", "3", "--ttt", "2",
                        "--eval-prompts", "2", "--max-new-tokens", "8", "--device", "cpu"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "demo.json").read_text())
    assert summary["conversations"] == {"train": 38, "eval": 2}
    assert summary["eval"]["lossless"] is True and summary["eval"]["tau"] >= 1.0
    assert (out / "store" / "manifest.json").exists() and (out / "eval" / "report.json").exists()
    for stage in ("prepared", "store", "run", "eval"):
        assert json.loads((out / stage / "config.json").read_text())["stage"] in ("prepare", "capture", "train", "eval")
    assert "hstap demo: tau =" in r.stdout
    # a second run over the same --out replaces the earlier demo; a foreign directory is refused
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    r = subprocess.run([sys.executable, "-m", "hstap.cli", "demo", "--out", str(foreign), "--target", str(target)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not an earlier hstap demo" in r.stderr and (foreign / "keep.txt").exists()
