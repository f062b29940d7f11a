"""Bad input, outputs: `--overwrite` (and the demo, and `capture --new`, and `generate --new`) replaces only what hstap
wrote, whose run record says so (hstap/artifacts/outputs.py); an output that is, or holds, the run's input is refused; a file
that is not a report hstap wrote is replaced only with --overwrite. Each refusal is one line, exit status 2, and the
user's files stay as they were (`helpers.refusals.refused`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers.refusals import refused

from hstap.cli import main


def _user_dir(path, n: int = 8):
    """A directory of the user's data files (what --overwrite must never remove)."""
    path.mkdir()
    for i in range(n):
        (path / f"part-{i:02d}.jsonl").write_text(json.dumps({"row": i}) + "\n")
    return path


def test_export_overwrite_never_removes_a_directory_it_did_not_write(small_run, tmp_path, capsys):
    run, target = small_run["run"], small_run["target"]
    data = _user_dir(tmp_path / "data")
    refused(["export", "--run", run, "--to", "vllm", "--out", data, "--overwrite", "--target", target], capsys,
            f"{data}: --out: holds files hstap did not write", "nothing there was touched", untouched=[data])
    # an output of another stage is not export's to replace either
    refused(["export", "--run", run, "--to", "vllm", "--out", small_run["prepared"], "--overwrite"], capsys,
            "holds an output of hstap prepare", untouched=[small_run["prepared"]])
    # a file
    (tmp_path / "f").write_text("x")
    refused(["export", "--run", run, "--to", "sglang", "--out", tmp_path / "f", "--overwrite"], capsys,
            "exists and is not a directory", untouched=[tmp_path / "f"])


def test_export_out_is_never_its_own_input(small_run, capsys):
    run = small_run["run"]
    for out, what in ((run / "best", "is the input --run"), (run, "holds the input --run")):
        refused(["export", "--run", run, "--to", "sglang", "--out", out, "--overwrite"], capsys, f"{out}: --out: "
                f"{what}", untouched=[run])
    ckpt = next((run / "checkpoints").iterdir())  # another drafter of the run: train's, not "files hstap did not write"
    refused(["export", "--run", run, "--to", "sglang", "--out", ckpt, "--overwrite"], capsys,
            f"{ckpt}: --out: holds an output of hstap train", untouched=[run])


def test_export_replaces_its_own_earlier_export_only_with_overwrite(small_run, tmp_path, capsys):
    run, out = small_run["run"], tmp_path / "exported"
    assert main(["export", "--run", str(run), "--to", "sglang", "--out", str(out)]) == 0
    refused(["export", "--run", run, "--to", "sglang", "--out", out], capsys,
            "holds an earlier hstap export output; pass --overwrite", untouched=[out])
    assert main(["export", "--run", str(run), "--to", "vllm", "--out", str(out), "--overwrite",
                 "--target", str(small_run["target"])]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Eagle3Speculator"]
    (tmp_path / "empty").mkdir()  # an empty directory holds nothing to lose
    assert main(["export", "--run", str(run), "--to", "sglang", "--out", str(tmp_path / "empty")]) == 0


def test_verify_report_replaces_only_its_own_report(small_run, tmp_path, capsys):
    store = small_run["store"]
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    for over in ([], ["--overwrite"]):  # a file of the user's: never, whatever --overwrite says
        refused(["verify", "--store", store, "--report", notes, *over], capsys,
                f"{notes}: --report: exists and is a file hstap did not write", untouched=[notes])
    # the store's own manifest: neither a report nor the report's to replace (it is the input)
    manifest = store / "manifest.json"
    refused(["verify", "--store", store, "--report", manifest, "--overwrite"], capsys, f"{manifest}: --report:",
            untouched=[store])
    rep = tmp_path / "report.json"
    assert main(["verify", "--store", str(store), "--report", str(rep)]) == 0
    assert json.loads(rep.read_text())["stage"] == "verify"
    refused(["verify", "--store", store, "--report", rep], capsys,
            "holds an earlier hstap verify report; pass --overwrite", untouched=[rep])
    assert main(["verify", "--store", str(store), "--report", str(rep), "--overwrite"]) == 0  # its own: replaced
    refused(["verify", "--store", store, "--report", tmp_path], capsys, "--report: is a directory",
            untouched=[tmp_path / "report.json"])


def _outputs(small_run, out, free) -> list[list]:
    """A command line of each stage that writes `out` (its output flag last but one), all else valid (`free`: a
    writable directory for generate's answers beside a --capture store)."""
    t, run, store, chats, prep = (small_run[k] for k in ("target", "run", "store", "chats", "prepared"))
    return [["data", "--source", "sharegpt", "--file", chats, "--out", out],
            ["convert", "--gguf", chats, "--out", out],
            ["prepare", "--tokenizer", t, "--data", chats, "--out", out],
            ["generate", "--target", t, "--data", chats, "--max-new-tokens", "2", "--out", out],
            ["generate", "--target", t, "--data", chats, "--out", free / "a.jsonl", "--capture", out],
            ["capture", "--target", t, "--data", prep, "--out", out],
            ["train", "--target", t, "--store", store, "--steps", "1", "--out", out],
            ["export", "--run", run, "--to", "sglang", "--out", out],
            ["eval", "--target", t, "--drafter", run, "--data", chats, "--out", out],
            ["serve-loop", "--target", t, "--prompts", chats, "--out", out],
            ["verify", "--store", store, "--report", out],
            ["demo", "--out", out]]


def test_every_output_that_cannot_be_written_is_one_line_before_any_work(small_run, tmp_path, capsys):
    """A parent that is a file, or a FIFO where a file goes: refused by name before the stage loads, nothing made."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for argv in _outputs(small_run, blocker / "sub" / "out", tmp_path):
        refused(argv, capsys, f"{argv[-2]}: {blocker} is not a directory", untouched=[blocker])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv in _outputs(small_run, fifo, tmp_path):
        kind = "file" if argv[0] in ("data", "verify") or argv[-2:] == ["--out", fifo] and argv[0] == "generate" \
            else "directory"
        refused(argv, capsys, f"{fifo}: {argv[-2]}: exists and is not a {'regular file' if kind == 'file' else kind}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only directory")
def test_every_output_in_a_read_only_directory_is_one_line(small_run, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for argv in _outputs(small_run, ro / "out", tmp_path):
            refused(argv, capsys, f"{argv[-2]}: cannot write in {ro} (permission denied)", untouched=[ro])
    finally:
        ro.chmod(0o755)


def test_verify_report_in_a_new_directory(small_run, tmp_path):
    rep = tmp_path / "reports" / "today" / "verify.json"
    assert main(["verify", "--store", str(small_run["store"]), "--report", str(rep)]) == 0
    assert json.loads(rep.read_text())["stage"] == "verify"


def test_eval_and_serve_loop_never_write_into_a_directory_of_the_users(small_run, tmp_path, capsys):
    data = _user_dir(tmp_path / "data")
    target, run, chats = small_run["target"], small_run["run"], small_run["chats"]
    refused(["eval", "--target", target, "--drafter", run, "--data", chats, "--out", data, "--overwrite"], capsys,
            f"{data}: --out: holds files hstap did not write", untouched=[data])
    refused(["eval", "--target", target, "--drafter", run, "--data", chats, "--out", run], capsys,
            "--out: is the input --drafter", untouched=[run])
    refused(["serve-loop", "--target", target, "--prompts", chats, "--out", data, "--overwrite"], capsys,
            f"{data}: --out: holds files hstap did not write", untouched=[data])


def test_capture_never_writes_nor_wipes_a_directory_that_is_not_a_store(small_run, tmp_path, capsys):
    target, prepared = small_run["target"], small_run["prepared"]
    data = _user_dir(tmp_path / "data")
    for new in ([], ["--new"]):
        refused(["capture", "--target", target, "--data", prepared, "--out", data, "--dtype", "fp32", "--layers", "1,3,4", *new], capsys,
                f"{data}: holds 'part-00.jsonl' and no manifest.json: not an hstap store", untouched=[data])
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "my-own-manifest", "files": []}\n')
    (other / "shards").mkdir()
    (other / "shards" / "keep.bin").write_bytes(b"\0" * 8)
    refused(["capture", "--target", target, "--data", prepared, "--out", other, "--dtype", "fp32", "--layers", "1,3,4",
             "--new"], capsys,
            f"{other / 'manifest.json'}:1: format: expected 'hstap-store'", untouched=[other])


def test_generate_new_never_removes_a_file_it_did_not_write(small_run, tmp_path, capsys):
    mine = tmp_path / "answers.jsonl"
    shutil.copy(small_run["chats"], mine)
    refused(["generate", "--target", small_run["target"], "--data", small_run["chats"], "--out", mine, "--new"],
            capsys, f"{mine}: exists and was not written by hstap generate", untouched=[mine])


def test_check_out_dir_cases(tmp_path):
    from hstap.common import write_run_config
    from hstap.artifacts.outputs import check_out_dir

    assert check_out_dir(tmp_path / "new", "serve-loop", False) is False
    (tmp_path / "empty").mkdir()
    assert check_out_dir(tmp_path / "empty", "serve-loop", False) is False
    own = tmp_path / "own"
    own.mkdir()
    write_run_config(own, "serve-loop", {"out": str(own)})
    (own / "served.jsonl").write_text("")
    assert check_out_dir(own, "serve-loop", True) is True  # an earlier serve-loop: replaced with --overwrite


def test_a_run_record_of_another_stage_is_not_this_ones(tmp_path):
    from hstap.common import HstapError, write_run_config
    from hstap.artifacts.outputs import check_out_dir

    d = tmp_path / "d"
    d.mkdir()
    write_run_config(d, "eval", {"out": str(d)})
    with pytest.raises(HstapError, match="holds an output of hstap eval"):
        check_out_dir(d, "serve-loop", True)
    with pytest.raises(HstapError, match="holds an earlier hstap eval output; pass --overwrite"):
        check_out_dir(d, "eval", False)
    assert check_out_dir(d, "eval", None) is True


def test_a_store_is_created_beside_a_waiting_trainer_but_never_in_a_users_shards(tmp_path):
    from hstap.common import HstapError
    from hstap.store.manifest import check_store_dir

    waiting = tmp_path / "waiting"  # `train --follow --consume` claims the store's window before it exists
    waiting.mkdir()
    (waiting / "consumer.json").write_text('{"format": "hstap-store-consumer"}')
    (waiting / "vllm-events").mkdir()
    assert check_store_dir(waiting) is False
    mine = tmp_path / "mine"
    (mine / "shards").mkdir(parents=True)
    (mine / "shards" / "photos.tar").write_bytes(b"x")
    with pytest.raises(HstapError, match="holds 'shards' and no manifest.json: not an hstap store"):
        check_store_dir(mine)
