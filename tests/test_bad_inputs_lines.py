"""Bad input, lines where tracebacks were: a shard with a damaged header (safetensors' own error, raised by train's
pre-flight before the checksum pass), an engine that is not installed (checked before anything is written: a real
process in which vLLM and SGLang cannot be imported), convert without the gguf package, an --out that is a file. Each is
one `hstap: error:` line, exit status 2, and nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.refusals import refused, snapshot

REPO = Path(__file__).resolve().parent.parent
BLOCKER = '''import os
import sys

_BLOCKED = os.environ["HSTAP_TEST_NOT_INSTALLED"].split(",")


class _NotInstalled:
    """A meta path finder that makes the packages of HSTAP_TEST_NOT_INSTALLED look not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def without(tmp_path: Path, *modules: str) -> dict:
    """An environment whose Python cannot import `modules` (a sitecustomize on PYTHONPATH), this tree's hstap."""
    block = tmp_path / "not-installed"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": f"{block}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
            "HSTAP_TEST_NOT_INSTALLED": ",".join(modules)}


def without_engines(tmp_path: Path) -> dict:
    """An environment whose Python cannot import vllm nor sglang."""
    return without(tmp_path, "vllm", "sglang")


def refused_in_a_process(argv: list, env: dict, *expect: str, untouched=()) -> str:
    """`refused`, for `python -m hstap.cli ARGV` run as a process of its own."""
    before = snapshot(*untouched)
    r = subprocess.run([sys.executable, "-m", "hstap.cli", *map(str, argv)], capture_output=True, text=True, env=env,
                       timeout=600)
    lines = [x for x in r.stderr.splitlines() if x.startswith("hstap: error:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for e in expect:
        assert e in lines[0], (e, lines[0])
    assert snapshot(*untouched) == before, "a refused run wrote or rewrote something"
    return lines[0]


def test_a_flipped_byte_in_a_shard_header_is_one_line_naming_the_shard(small_run, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(small_run["store"], store)
    shard = sorted((store / "shards").glob("*.safetensors"))[0]
    b = bytearray(shard.read_bytes())
    i = b.index(b'"dtype":"') + len(b'"dtype":"')  # inside the JSON header: safetensors itself can no longer read it
    b[i] ^= 0x05
    shard.write_bytes(bytes(b))
    run = tmp_path / "run"
    refused(["train", "--store", store, "--target", small_run["target"], "--out", run, "--steps", "1", "--device",
             "cpu", "--compile", "false", "--tensorboard", "false"], capsys,
            f"{shard}: sha256 differs from the one recorded", "the store is damaged", untouched=[run, store])


def test_a_shard_whose_tensors_do_not_match_its_entry_is_one_line(small_run, tmp_path):
    """The reader's check of what it opened (a shard replaced by another one, whose checksum was recorded too)."""
    import pytest

    from hstap.common import HstapError
    from hstap.store.reader import open_store

    store = tmp_path / "store"
    shutil.copytree(small_run["store"], store)
    s = open_store(store)
    e = dict(s.manifest["shards"][0], tokens=s.manifest["shards"][0]["tokens"] + 1)
    with pytest.raises(HstapError, match=r"r000-000000.safetensors: not a readable shard \(tensor input_ids is not"):
        s.read_shard(e)


@pytest.mark.procs
def test_serve_loop_without_vllm_checks_before_writing(small_run, tmp_path):
    out = tmp_path / "loop"
    refused_in_a_process(["serve-loop", "--target", small_run["target"], "--prompts", small_run["chats"], "--out",
                          out], without_engines(tmp_path), "serve-loop: vLLM cannot be imported by this Python",
                         "No module named 'vllm'", untouched=[out])


@pytest.mark.procs
def test_eval_engines_not_installed_are_refused_before_the_local_runs(small_run, tmp_path):
    env = without_engines(tmp_path)
    args = ["eval", "--target", small_run["target"], "--drafter", small_run["run"], "--data", small_run["chats"],
            "--max-new-tokens", "2", "--num-prompts", "1", "--device", "cpu"]
    out = tmp_path / "eval-vllm"
    refused_in_a_process([*args, "--out", out, "--engine", "vllm"], env, "--engine vllm: vLLM cannot be imported",
                         untouched=[out])
    out = tmp_path / "eval-sglang"
    refused_in_a_process([*args, "--out", out, "--engine", "sglang", "--sglang-python", sys.executable], env,
                         f"--engine sglang: {sys.executable} has no sglang package", untouched=[out])


@pytest.mark.procs
def test_convert_without_the_gguf_package_is_one_line(tmp_path, capsys):
    """--gguf FILE says what --package NAME says of a missing package: its install line, before any model loads."""
    f, out = tmp_path / "model.gguf", tmp_path / "model"
    f.write_bytes(b"GGUF" + bytes(60))
    refused_in_a_process(["convert", "--gguf", f, "--out", out], without(tmp_path, "gguf"),
                         "convert: needs the 'gguf' package", "pip install gguf", untouched=[out])
    refused(["convert", "--package", "", "--out", out], capsys, "convert: --package: empty", untouched=[out])


def test_an_out_that_is_a_file_is_one_line(small_run, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    for argv in (["serve-loop", "--target", small_run["target"], "--prompts", small_run["chats"]], ["demo"]):
        refused([*argv, "--out", f], capsys, f"{f}: --out: exists and is not a directory", untouched=[f])
