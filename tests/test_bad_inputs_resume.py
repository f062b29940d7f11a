"""Bad input, resumes: a store or an answers file is resumed only by the same work. A store's identity is its header's
target, layers and dtype and its `work` (kind, producer, source data: hstap/store/format.py); an answers file's is its
run record `<out>.config.json` (generate's settings, its input files by their fingerprint). Mixing two works is one
line naming the field, exit status 2, and both files as they were; the same work moved elsewhere resumes."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.refusals import refused

from hstap.cli import main

CAPTURE = ["--layers", "1,3,4", "--dtype", "fp32", "--device", "cpu"]
TAP = ["--layers", "1,3,4", "--capture-dtype", "fp32", "--max-new-tokens", "3"]


@pytest.fixture(scope="module")
def generated(small_run, tmp_path_factory):
    """(answers file, store) of `hstap generate --capture` on 4 of small_run's conversations."""
    root = tmp_path_factory.mktemp("generated")
    src = root / "four.jsonl"
    src.write_text("".join(small_run["chats"].read_text().splitlines(keepends=True)[:4]))
    assert main(["generate", "--target", str(small_run["target"]), "--data", str(src), "--out", str(root / "g.jsonl"),
                 "--capture", str(root / "store"), *TAP]) == 0
    return src, root / "g.jsonl", root / "store"


def test_generate_capture_into_a_capture_store_is_refused(small_run, tmp_path, capsys):
    """It used to exit 0 with "captured 0 samples": the prepared answers' states under regenerated answers."""
    store, out = small_run["store"], tmp_path / "g.jsonl"
    refused(["generate", "--target", small_run["target"], "--data", small_run["chats"], "--out", out, "--capture",
             store, *TAP], capsys, f"{store / 'manifest.json'}:1: work.kind: the store holds prepared samples "
            "(hstap capture", "this run writes generated samples (hstap generate --capture",
            "resumed only by the same work", untouched=[store, out])


def test_capture_into_a_generated_store_is_refused(small_run, generated, capsys):
    """It used to append the prepared samples to the generated ones, the header still saying "generated"."""
    _, _, store = generated
    refused(["capture", "--target", small_run["target"], "--data", small_run["prepared"], "--out", store, *CAPTURE],
            capsys, f"{store / 'manifest.json'}:1: work.kind: the store holds generated samples", "prepared samples "
            f"(hstap capture, from {small_run['prepared']})", untouched=[store])


def test_capture_resumes_only_its_own_prepared_set(small_run, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(small_run["store"], store)
    other = tmp_path / "prepared-other"  # the same tokenizer, other conversations
    (tmp_path / "two.jsonl").write_text("".join(small_run["chats"].read_text().splitlines(keepends=True)[-2:]))
    assert main(["prepare", "--tokenizer", str(small_run["target"]), "--data", str(tmp_path / "two.jsonl"),
                 "--out", str(other), "--draft-vocab", "50"]) == 0
    refused(["capture", "--target", small_run["target"], "--data", other, "--out", store, *CAPTURE], capsys,
            "manifest.json:1: work.data", f"from {other}", untouched=[store])
    moved = tmp_path / "prepared-moved"  # the same prepared set elsewhere: the same work, resumed (nothing to add)
    shutil.copytree(small_run["prepared"], moved)
    before = json.loads((store / "manifest.json").read_text())["shards"]
    assert main(["capture", "--target", str(small_run["target"]), "--data", str(moved), "--out", str(store),
                 *CAPTURE]) == 0
    assert json.loads((store / "manifest.json").read_text())["shards"] == before


def test_generate_never_resumes_a_file_it_did_not_write(small_run, tmp_path, capsys):
    """A copy of the input conversations as --out used to be "6 already done", nothing generated, exit 0."""
    copy = tmp_path / "copy.jsonl"
    shutil.copy(small_run["chats"], copy)
    refused(["generate", "--target", small_run["target"], "--data", small_run["chats"], "--out", copy], capsys,
            f"{copy}: exists and was not written by hstap generate (no run record copy.jsonl.config.json",
            untouched=[copy, tmp_path / "copy.jsonl.config.json"])


def test_generate_resumes_only_its_own_input(small_run, generated, tmp_path, capsys):
    src, out, store = generated
    record = out.with_name(out.name + ".config.json")
    refused(["generate", "--target", small_run["target"], "--data", small_run["chats"], "--out", out, "--capture",
             store, *TAP], capsys, f"{out}: existing output was generated with --data ['{src}']", "pass --new",
            untouched=[out, record, store])
    # the same input moved elsewhere (its fingerprint) resumes: nothing left to do, nothing added
    moved = tmp_path / "moved.jsonl"
    shutil.copy(src, moved)
    lines = out.read_text()
    cfg = json.loads(record.read_text())
    assert main(["generate", "--target", str(small_run["target"]), "--data", str(moved), "--out", str(out),
                 "--capture", str(store), *TAP]) == 0
    assert out.read_text() == lines and json.loads(record.read_text())["data_fingerprint"] == cfg["data_fingerprint"]


def test_work_of_a_store_older_than_the_work_block():
    from hstap.store.header import header_diff, work_of

    old = {"layers": [1], "dtype": "bf16", "hidden_size": 8}  # no `work`, no `contents`: a prepared capture
    assert work_of(old) == {"kind": "prepared", "producer": None, "data": None}
    capture = {**old, "work": {"kind": "prepared", "producer": "hstap capture", "data": {"path": "/p", "sha256": "a"}}}
    assert header_diff(old, capture) is None  # unknown producer and data are not compared
    gen = {**old, "contents": {"kind": "generated"}}
    assert header_diff(gen, capture) == ("work.kind", "generated", "prepared")
    moved = {**capture, "work": {**capture["work"], "data": {"path": "/elsewhere", "sha256": "a"}}}
    assert header_diff(capture, moved) is None  # the same prepared set (its content) moved
    other = {**capture, "work": {**capture["work"], "data": {"path": "/p", "sha256": "b"}}}
    assert header_diff(capture, other)[0] == "work.data"
