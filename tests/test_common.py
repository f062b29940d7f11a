"""hstap.common's directory publishing (`publish_dir`, `publishing_dir`): what becomes of an existing destination in
each mode, and that a failed build or a refused publish leaves the destination as it was and no temp directory. The
one-line JSON read (`read_json`) and the run-record reader (`read_record`)."""

from __future__ import annotations

import json

import pytest

from hstap.common import HstapError, publish_dir, publishing_dir, read_json, read_record, run_meta


def _dir(path, text):
    path.mkdir()
    (path / "f.txt").write_text(text)
    return path


def _listing(root):
    return sorted(p.name for p in root.iterdir())


def test_each_mode_of_an_existing_destination(tmp_path):
    out = tmp_path / "out"
    publish_dir(_dir(tmp_path / ".new1", "one"), out)  # none there: any mode publishes
    assert (out / "f.txt").read_text() == "one" and _listing(tmp_path) == ["out"]
    with pytest.raises(HstapError, match=r"out: exists, says the caller"):
        publish_dir(_dir(tmp_path / ".new2", "two"), out, refusal="exists, says the caller")
    assert (out / "f.txt").read_text() == "one" and (tmp_path / ".new2").is_dir()  # tmp stays the caller's
    publish_dir(tmp_path / ".new2", out, "remove")
    assert (out / "f.txt").read_text() == "two" and _listing(tmp_path) == ["out"]
    publish_dir(_dir(tmp_path / ".new3", "three"), out, "aside")
    assert (out / "f.txt").read_text() == "three" and _listing(tmp_path) == ["out"]  # the old one moved aside, removed
    _dir(tmp_path / ".stale", "stale")  # left by a crash between the two renames of an earlier publish
    publish_dir(_dir(tmp_path / ".new4", "four"), out, "aside", aside=tmp_path / ".stale")
    assert (out / "f.txt").read_text() == "four" and _listing(tmp_path) == ["out"]
    with pytest.raises(ValueError, match="existing must be one of"):
        publish_dir(_dir(tmp_path / ".new5", "five"), out, "overwrite")


def test_publishing_dir_builds_beside_and_cleans_up(tmp_path):
    out = tmp_path / "a" / "b" / "out"  # missing parents are made
    with publishing_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.tmp-")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x").write_text("x")
    assert (out / "sub" / "x").read_text() == "x" and _listing(out.parent) == ["out"]
    with pytest.raises(RuntimeError, match="build failed"):
        with publishing_dir(out, "aside") as tmp:
            (tmp / "y").write_text("y")
            raise RuntimeError("build failed")
    assert _listing(out) == ["sub"] and _listing(out.parent) == ["out"]  # untouched, no temp left
    with pytest.raises(HstapError, match="appeared while building"):
        with publishing_dir(out, refusal="appeared while building") as tmp:
            (tmp / "z").write_text("z")
    assert _listing(out) == ["sub"] and _listing(out.parent) == ["out"]


def test_read_json_is_an_object_or_one_line_naming_the_file(tmp_path):
    f = tmp_path / "drafter.json"
    f.write_text('{"format": "x",\n "n": 1}\n')
    assert read_json(f) == {"format": "x", "n": 1}
    for text, message in (('{"format": "x",\n "n": }', r"drafter.json:2: drafter.json is not valid JSON: Expecting value"),
                          ("[1, 2]", r"drafter.json:1: drafter.json: expected a JSON object"),
                          (b"\xff\xfe\x00", r"drafter.json: cannot read: ")):
        f.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(HstapError, match=message) as e:
            read_json(f)
        assert "\n" not in str(e.value)
    with pytest.raises(HstapError, match=r"missing.json: cannot read: .*No such file"):
        read_json(tmp_path / "missing.json", "the manifest")
    f.write_text("{")
    with pytest.raises(HstapError, match=r"drafter.json:1: the manifest is not valid JSON"):
        read_json(f, "the manifest")


def test_read_record_knows_a_run_record_from_any_other_file(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(run_meta("prepare", {"out": "x"})))
    assert read_record(f)["stage"] == "prepare"
    for text in ('{"stage": "prepare"}', '{"architectures": ["LlamaForCausalLM"]}', "[]", "{", ""):
        f.write_text(text)  # a model's config.json, a torn file, ...: not a record
        assert read_record(f) is None
    assert read_record(tmp_path / "absent.json") is None
