"""Bad input, the smaller surprises of a first hour: `generate` on prompts only, or on conversations none of which fit
--max-len (it used to exit 0 having written nothing, naming a file it did not write), `--layers` without `--capture`
(ignored), `demo --train.lr 0` (refused only after the toy target trained), `serve-loop` with a missing or empty prompts
file (an empty --out left), `convert --gguf DIR` ("no such file"), a missing input path (refused only after torch and
transformers loaded, the CLI now checks it first). Each is one line, exit status 2, nothing written."""

from __future__ import annotations

import json

from helpers.refusals import refused

from hstap.cli import main


def _prompts_only(path, n: int = 3):
    """What `hstap data --source mtbench` writes for turn 1: one user turn per conversation, no assistant turn."""
    path.write_text("".join(json.dumps({"id": f"q{i}", "conversations": [{"role": "user", "content": f"question {i}"}]})
                            + "\n" for i in range(n)))
    return path


def test_generate_on_prompts_only_says_why_and_writes_nothing(small_run, tmp_path, capsys):
    src, out = _prompts_only(tmp_path / "turn1.jsonl"), tmp_path / "answers.jsonl"
    refused(["generate", "--target", small_run["target"], "--data", src, "--out", out, "--max-new-tokens", "2"],
            capsys, f"{src}: none of its 3 conversation(s) has an assistant turn to generate", "prompts only",
            "--turn 2", "nothing written", untouched=[out, tmp_path / "answers.jsonl.config.json"])


def test_generate_writes_prompts_back_beside_answers_and_says_so(small_run, tmp_path, capsys):
    src = _prompts_only(tmp_path / "mixed.jsonl")
    with open(src, "a") as f:
        f.write(small_run["chats"].read_text().splitlines(keepends=True)[0])
    out = tmp_path / "answers.jsonl"
    assert main(["generate", "--target", str(small_run["target"]), "--data", str(src), "--out", str(out),
                 "--max-new-tokens", "2"]) == 0
    assert len(out.read_text().splitlines()) == 4
    assert "3 without an assistant turn (prompts only) written back unchanged" in capsys.readouterr().out


def test_generate_when_nothing_fits_max_len(small_run, tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    refused(["generate", "--target", small_run["target"], "--data", small_run["chats"], "--out", out, "--max-len",
             "10"], capsys, "generate: --max-len 10: the first prompt of every conversation (12) is longer",
            "nothing written", untouched=[out, tmp_path / "answers.jsonl.config.json"])


def test_generate_layers_without_capture(small_run, tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    refused(["generate", "--target", small_run["target"], "--data", small_run["chats"], "--out", out, "--layers",
             "1,3,4"], capsys, "--layers 1,3,4: taps layers into a --capture store", untouched=[out])


def test_demo_checks_every_flag_before_any_work(tmp_path, capsys):
    out = tmp_path / "demo"
    refused(["demo", "--train.lr", "0", "--out", out], capsys, "demo: --train.lr: must be a finite number > 0",
            untouched=[out])
    refused(["demo", "--k", "0", "--out", out], capsys, "--k", untouched=[out])


def test_serve_loop_without_prompts_leaves_no_out(small_run, tmp_path, capsys):
    out = tmp_path / "loop"
    (tmp_path / "empty.jsonl").write_text("")
    refused(["serve-loop", "--target", small_run["target"], "--prompts", tmp_path / "missing.jsonl", "--out", out],
            capsys, "missing.jsonl: --prompts: does not exist", untouched=[out])
    refused(["serve-loop", "--target", small_run["target"], "--prompts", tmp_path / "empty.jsonl", "--out", out],
            capsys, "empty.jsonl: no usable prompt", untouched=[out])


def test_convert_says_a_directory_is_one(tmp_path, capsys):
    refused(["convert", "--gguf", tmp_path, "--out", tmp_path / "model"], capsys,
            f"{tmp_path}: --gguf: is a directory; give the .gguf file itself", untouched=[tmp_path / "model"])


def test_missing_inputs_are_refused_before_the_stage_loads(tmp_path, capsys):
    """The CLI's own check (hstap.stage_paths.INPUT_PATHS), before the stage's module imports torch and transformers."""
    nx = tmp_path / "nowhere"
    for argv, flag in ((["capture", "--target", nx, "--data", tmp_path, "--out", tmp_path / "s"], "--target"),
                       (["export", "--run", nx, "--to", "vllm", "--out", tmp_path / "e"], "--run"),
                       (["prepare", "--tokenizer", tmp_path, "--data", nx, "--out", tmp_path / "p"], "--data"),
                       (["verify", "--a", tmp_path, "--b", nx], "--b")):
        refused(argv, capsys, f"{nx}: {flag}: does not exist", untouched=[tmp_path])


def test_float_settings_are_finite_and_named_as_given(tmp_path, capsys):
    """nan and inf are no setting (`--lr inf` trained a drafter of NaNs and exited 0, `--lr nan` was a traceback), nor
    a negative decay or store bound; a refused field is named as the user gave it: the flag as typed (the serve loop's
    --train-lr, not train's --lr) or the --config file and its key (the demo's train section)."""
    import pytest

    from hstap.common import HstapError
    from hstap.train.config import HyperParams

    out, t = tmp_path / "o", tmp_path
    for v in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as e:
            main(["train", "--target", str(t), "--store", str(t), "--out", str(out), "--lr", v])
        assert e.value.code == 2 and f"expected a finite number, got '{v}'" in capsys.readouterr().err
        with pytest.raises(HstapError, match="train: --lr: must be a finite number > 0"):
            HyperParams(lr=float(v))
    refused(["train", "--target", t, "--store", t, "--out", out, "--ttt-decay", "-0.5"], capsys,
            "train: --ttt-decay: must be a finite number >= 0, got -0.5", untouched=[out])
    refused(["serve-loop", "--target", t, "--prompts", t, "--out", out, "--train-lr", "-1"], capsys,
            "serve-loop: --train-lr: must be a finite number > 0, got -1.0", untouched=[out])
    refused(["serve-loop", "--target", t, "--prompts", t, "--out", out, "--max-store-gb", "-1"], capsys,
            "serve-loop: --max-store-gb: must be a finite number > 0, got -1.0", untouched=[out])
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("train:\n  lr: .nan\n")
    refused(["demo", "--config", cfg, "--out", out], capsys, f"{cfg}: train.lr: expected a finite number, got nan")
    cfg.write_text("train:\n  ttt_decay: -1\n  lr: 0.01\n")
    refused(["demo", "--config", cfg, "--out", out], capsys, f"{cfg}: train.ttt_decay: must be a finite number >= 0",
            untouched=[out])


def test_an_input_that_is_a_fifo_is_refused_by_name(small_run, tmp_path, capsys):
    """A FIFO as --prompts (it said "no such file"), as --data: refused before the stage loads."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = tmp_path / "o"
    refused(["serve-loop", "--target", small_run["target"], "--prompts", fifo, "--out", out], capsys,
            f"{fifo}: --prompts: is not a regular file", untouched=[out])
    refused(["eval", "--target", small_run["target"], "--data", fifo, "--out", out], capsys,
            f"{fifo}: --data: is not a regular file", untouched=[out])
