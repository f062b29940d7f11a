"""A training checkpoint keeps the target's frozen embedding out (hstap/artifacts/drafter_dir.py): RUN/checkpoints/* and
RUN/best hold no `embed_tokens.weight`, drafter.json records where it comes from and its sha256; loading (eval,
export --to hf, a resume) puts the target's back, checked; another target's embedding is refused by name; the
engines' exports never needed it. The run's summary says what a checkpoint holds."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hstap.common import HstapError
from hstap.artifacts.drafter_dir import EMBEDDING, load_drafter, tensor_sha256
from hstap.export.config import ExportConfig
from hstap.export.stage import export
from hstap.artifacts.model_dir import target_head
from hstap.train.checkpoint import complete, load_weights
from hstap.train.log import checkpoint_sizes


def test_checkpoints_and_best_hold_no_embedding(small_run):
    run, target = small_run["run"], small_run["target"]
    embed = target_head(target)[0]
    for d in (run / "best", complete(run)[-1]):
        assert EMBEDDING not in load_file(str(d / "drafter.safetensors"))
        rec = json.loads((d / "drafter.json").read_text())["embedding"]
        assert rec == {"from": "target", "path": str(target), "shape": list(embed.shape), "dtype": "float32",
                       "sha256": tensor_sha256(embed.float())}
    line = checkpoint_sizes(complete(run)[-1], run / "best")
    assert line.startswith(f"{complete(run)[-1].name}: ") and "optimizer state" in line and "best/ " in line


def test_loading_puts_the_targets_embedding_back(small_run, tmp_path):
    run, target = small_run["run"], small_run["target"]
    embed = target_head(target)[0]
    m, _ = load_drafter(run)  # from the target directory drafter.json records
    assert torch.equal(m.embed_tokens.weight, embed.float())
    export(ExportConfig(run=str(run), to="hf", out=str(tmp_path / "hf")))  # the portable copy holds it again
    state = load_file(str(tmp_path / "hf" / "drafter.safetensors"))
    assert torch.equal(state[EMBEDDING], embed.float())
    assert "embedding" not in json.loads((tmp_path / "hf" / "drafter.json").read_text())
    m2, _ = load_drafter(tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


def test_another_targets_embedding_is_refused_and_engines_need_none(small_run, tiny_llama, tmp_path):
    moved = tmp_path / "run"
    shutil.copytree(small_run["run"], moved)
    meta_path = moved / "best" / "drafter.json"
    meta = json.loads(meta_path.read_text())
    meta["embedding"]["path"] = str(tmp_path / "gone")  # trained where the target lived; it is not here
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(HstapError, match=r"best/drafter.json: embedding: kept out of the checkpoint .*\(--target\)"):
        export(ExportConfig(run=str(moved), to="hf", out=str(tmp_path / "hf")))
    export(ExportConfig(run=str(moved), to="sglang", out=str(tmp_path / "sglang")))  # SGLang shares the target's
    with pytest.raises(HstapError, match=r"embedding: the target's embedding here .* is not the one the drafter was "
                                         r"trained with"):
        load_drafter(moved, target=str(tiny_llama))  # same shapes, other weights
    m, _ = load_drafter(moved, target=str(small_run["target"]))
    m.embed_tokens.weight.data.add_(1.0)  # a resume whose drafter holds another embedding
    with pytest.raises(HstapError, match="is not the one the drafter was trained with"):
        load_weights(moved / "best", m)
