"""hstap.common's directory publishing (`publish_dir`, `publishing_dir`): what becomes of an existing destination in
each mode, and that a failed build or a refused publish leaves the destination as it was and no temp directory."""

from __future__ import annotations

import pytest

from hstap.common import HstapError, publish_dir, publishing_dir


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
