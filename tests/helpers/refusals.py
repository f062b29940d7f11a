"""What a refusal owes the user, asserted by the stages' bad-input tests: `hstap ...` run in-process (`hstap.cli.main`)
exits with status 2, prints one `hstap: error:` line (no traceback) that names the file, field or flag, and leaves
the paths it was given byte for byte as they were (a missing one still missing: no new directory)."""

from __future__ import annotations

from pathlib import Path


def snapshot(*paths) -> dict:
    """{path: None when missing, the file's bytes, or {relative path: bytes} of every file under a directory}."""
    out: dict = {}
    for p in map(Path, paths):
        if not p.exists():
            out[str(p)] = None
        elif p.is_file():
            out[str(p)] = p.read_bytes()
        else:
            out[str(p)] = {str(f.relative_to(p)): (f.read_bytes() if f.is_file() else "dir") for f in sorted(p.rglob("*"))}
    return out


def refused(argv: list[str], capsys, *expect: str, untouched=()) -> str:
    """Run `hstap <argv>`; assert exit 2, exactly one error line holding every string of `expect`, and `untouched`
    unchanged. Returns the error line."""
    from hstap.cli import main

    before = snapshot(*untouched)
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("hstap: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for e in expect:
        assert e in lines[0], (e, lines[0])
    assert snapshot(*untouched) == before, "a refused run wrote or rewrote something"
    return lines[0]
