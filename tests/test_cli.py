"""The dataclass -> CLI generator: flag spellings, help from field docstrings, --config replay, errors."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from hstap.cli import COMMANDS, field_docs, make_config
from hstap.common import HstapError, run_meta


@dataclass
class ToyConfig:
    data: list[str]
    """Input files."""
    out: str
    """Output directory."""
    max_len: int = 2048
    """Longest sample kept."""
    lr: float = 1e-4
    """Peak learning rate."""
    resume: bool = False
    """Resume from the last checkpoint."""
    layers: str | None = None
    """Comma-separated layer ids."""
    dtype: str = field(default="bf16", metadata={"choices": ["bf16", "fp8", "fp32"]})
    """Storage dtype."""


def test_field_docs_are_the_help():
    docs = field_docs(ToyConfig)
    assert docs["max_len"] == "Longest sample kept." and docs["dtype"] == "Storage dtype."
    assert set(docs) == {"data", "out", "max_len", "lr", "resume", "layers", "dtype"}


def test_flag_spellings_and_types():
    a = make_config("toy", ToyConfig, ["--data", "a.jsonl", "b.jsonl", "--out", "o", "--max-len", "10", "--toy.lr", "3e-4",
                                       "--resume", "--layers", "1,2", "--dtype", "fp8"])
    assert a == ToyConfig(data=["a.jsonl", "b.jsonl"], out="o", max_len=10, lr=3e-4, resume=True, layers="1,2", dtype="fp8")
    b = make_config("toy", ToyConfig, ["--data", "x", "--out", "o", "--max_len", "7", "--resume", "false"])
    assert b.max_len == 7 and b.resume is False


def test_config_file_replay_and_override(tmp_path):
    cfg = ToyConfig(data=["x.jsonl"], out="o", max_len=99, lr=0.5, resume=True)
    meta = tmp_path / "config.json"
    meta.write_text(json.dumps(run_meta("toy", cfg)))
    assert make_config("toy", ToyConfig, ["--config", str(meta)]) == cfg
    assert make_config("toy", ToyConfig, ["--config", str(meta), "--toy.max_len", "5"]).max_len == 5
    y = tmp_path / "run.yaml"
    y.write_text("toy:\n  data: [a]\n  out: o\n  lr: 0.25\n")
    assert make_config("toy", ToyConfig, ["--config", str(y)]).lr == 0.25
    y.write_text("data: [a]\nout: o\nbogus: 1\n")
    with pytest.raises(HstapError, match="unknown field 'bogus'"):
        make_config("toy", ToyConfig, ["--config", str(y)])
    meta.write_text(json.dumps(run_meta("other", cfg)))
    with pytest.raises(HstapError, match="belongs to stage 'other'"):
        make_config("toy", ToyConfig, ["--config", str(meta)])


def test_bad_flags_exit_2():
    with pytest.raises(SystemExit) as e:
        make_config("toy", ToyConfig, ["--out", "o"])  # --data missing
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        make_config("toy", ToyConfig, ["--data", "x", "--out", "o", "--dtype", "int4"])


def test_every_command_builds_its_parser():
    import importlib

    from hstap.cli import build_parser, stage_entry

    for name, (mod, cls, fn, helptext) in COMMANDS.items():
        m = importlib.import_module(mod)
        assert callable(stage_entry(name))
        klass = getattr(m, cls)
        docs = field_docs(klass)
        p = build_parser(name, klass, helptext)
        undocumented = [f for f in klass.__dataclass_fields__ if f not in docs]
        assert not undocumented, f"{name}: fields without a docstring: {undocumented}"
        assert p.format_help()


@pytest.mark.procs
def test_console_entry_point():
    r = subprocess.run([sys.executable, "-m", "hstap.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "prepare" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hstap.cli", "nosuch"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command" in r.stderr


@pytest.mark.procs
@pytest.mark.parametrize("argv", [
    ["train", "--config", "missing.json"],              # a config file that is not there
    ["train", "--steps", "x"],                           # a value of the wrong type
    ["eval", "--target", "t", "--data", "d", "--out", "o", "--mode", "bogus"],  # not a choice
    ["train", "--out", "o"],                             # required options missing
    ["capture", "--no-such-flag"],                       # unknown option
])
def test_errors_are_one_line_with_exit_2(argv, tmp_path):
    """No traceback and no 15-line usage block: at most argparse's one-line usage, then one `error:` line."""
    r = subprocess.run([sys.executable, "-m", "hstap.cli", *argv], capture_output=True, text=True, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(lines) <= 2, r.stderr
    assert [x for x in lines if "error:" in x] == lines[-1:], r.stderr
    assert len(lines) == 1 or lines[0].startswith(f"usage: hstap {argv[0]} [options]")


@pytest.mark.procs
@pytest.mark.slow
def test_cpus_busy_sees_other_processes_and_the_cli_then_waits_passively():
    """Two CPU-bound processes beside the CLI: it counts their CPUs, and a stage run then gets OMP_WAIT_POLICY=PASSIVE
    (idle OpenMP threads sleep instead of fighting them for the cores)."""
    from hstap.cli import cpus_busy

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        assert cpus_busy(0.3) >= 0.5
        probe = ("import os, sys, hstap.cli as c; sys.argv = ['hstap', 'prepare', '--help'];\n"
                 "try: c.main()\nexcept SystemExit: pass\nprint('POLICY', os.environ.get('OMP_WAIT_POLICY'))")
        p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"})
        assert "POLICY PASSIVE" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    finally:
        for q in loops:
            q.kill()
            q.wait()


@pytest.mark.procs
def test_dash_values_and_errors_raised_in_dataloader_workers():
    """`--layers -1,3,4` reaches the option as its value, for the stage's own check to name (argparse alone: "expected
    one argument"); an option followed by another option is still argparse's error. An HstapError raised in a real
    DataLoader worker process is re-raised by the loader wrapped in the worker's traceback: the CLI prints its line."""
    import torch

    from hstap.common import user_message

    a = make_config("toy", ToyConfig, ["--data", "x", "--out", "o", "--layers", "-1,3,4", "--max-len", "-5"])
    assert a.layers == "-1,3,4" and a.max_len == -5
    with pytest.raises(SystemExit):
        make_config("toy", ToyConfig, ["--data", "x", "--out", "o", "--layers", "--resume"])

    class Bad(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            raise HstapError("/s/shards/r000-000001.safetensors: sha256 differs")

    with pytest.raises(HstapError) as e:
        next(iter(torch.utils.data.DataLoader(Bad(), num_workers=1)))
    assert "\n" in str(e.value) and user_message(e.value) == "/s/shards/r000-000001.safetensors: sha256 differs"
    assert user_message(HstapError("a  plain\nline")) == "a plain line"


_LIGHT = """
import contextlib, io, json, sys
from hstap.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    out.append([argv[:2], rc, err.getvalue(), sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules)])
print(json.dumps(out))
"""


@pytest.mark.procs
def test_help_and_missing_inputs_are_answered_before_torch_loads(tmp_path):
    """`hstap STAGE --help`, and a missing input path, are answered from the stage's config module alone (no torch,
    numpy nor transformers: seconds on a busy machine), for every stage."""
    nx = str(tmp_path / "nowhere")
    missing = [["train", "--store", nx, "--target", nx, "--out", "o"],
               ["prepare", "--tokenizer", nx, "--data", "x", "--out", "o"],
               ["generate", "--target", nx, "--data", "x", "--out", "o"],
               ["capture", "--target", nx, "--data", "x", "--out", "o"],
               ["export", "--run", nx, "--to", "hf", "--out", "o"],
               ["eval", "--target", nx, "--data", "x", "--out", "o"],
               ["verify", "--store", nx],
               ["convert", "--gguf", nx, "--out", "o"],
               ["serve-loop", "--target", nx, "--prompts", "x", "--out", "o"],
               ["demo", "--target", nx]]
    argvs = [[name, "--help"] for name in COMMANDS] + missing
    r = subprocess.run([sys.executable, "-c", _LIGHT, json.dumps(argvs)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = json.loads(r.stdout)
    for argv, rc, err, heavy in runs:
        assert not heavy, f"hstap {' '.join(argv)} loaded {heavy}"
    for argv, rc, err, _ in runs[len(COMMANDS):]:
        assert rc == 2 and err.startswith(f"hstap: error: {nx}: --") and err.count("\n") == 1, (argv, err)
    assert all(rc == 0 for _, rc, _, _ in runs[:len(COMMANDS)])
