"""Training checkpoints in one process: save -> load restores weights, optimizer and RNG bitwise; --keep prunes;
`recover` undoes a crash in the middle of a save; a resume must repeat the run's RESUME_KEYS; `truncate_metrics`."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from helpers.drafter import tiny_setup
from safetensors.torch import load_file

from hstap.common import HstapError
from hstap.models.drafter import Eagle3Drafter
from hstap.train import checkpoint
from hstap.train.ttt import TTTModel, step_rows, target_distribution

CONFIG = {"world_size": 1, "grad_accum": 1, "batch_tokens": 600, "seed": 0, "ttt": 2, "eval_frac": 0.0, "lr": 2e-3,
          "warmup_ratio": 0.05, "min_lr_ratio": 0.1, "ttt_decay": 0.6, "loss": "ce+hard", "loss_mix": 0.5,
          "lk_decay": 3.0}


def _trained(steps: int = 2):
    """A drafter after `steps` AdamW steps of TTT (so that every optimizer state is set), with its params and opt."""
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup()
    model = TTTModel(d, ttt=2)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    tb = target_distribution(final, lm, L, W, hot, t2d)
    denom = torch.tensor([float(step_rows(tb, ids.shape[1], k)[0].numel()) for k in range(2)])
    for _ in range(steps):
        loss, _ = model(ids, aux, tb, denom)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return d, params, opt


def _save(run, step, d, params, opt, keep=3, best=False):
    state = {"step": step, "config": CONFIG, "param_names": [str(i) for i in range(len(params))]}
    checkpoint.save(run, step, d, params, opt, state, {"store": {"layers": []}}, keep, 0, False, best)


def _fresh():
    d = Eagle3Drafter(tiny_setup()[0].config)
    params = [p for p in TTTModel(d, ttt=2).parameters() if p.requires_grad]
    return d, params, torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def test_save_then_load_restores_weights_optimizer_and_rng_bitwise(tmp_path):
    d, params, opt = _trained()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    _save(tmp_path, 2, d, params, opt)
    want = (torch.rand(4), random.random(), np.random.rand())  # what the uninterrupted process draws next

    (ckpt,) = checkpoint.complete(tmp_path)
    assert ckpt.name == "step_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["drafter.json", "drafter.safetensors", "optimizer.safetensors",
                                                       "rng.safetensors", "trainer_state.json"]
    d2, params2, opt2 = _fresh()
    d2.set_vocab_map(d.d2t, d.t2d)  # as train's init_drafter gives the resumed drafter the run's map
    state = checkpoint.read_state(ckpt, dict(CONFIG))
    checkpoint.load_weights(ckpt, d2)
    assert state["step"] == 2 and state["config"] == CONFIG and "rng" in state
    for (n, a), b in zip(d.state_dict().items(), d2.state_dict().values()):
        assert torch.equal(a, b), n
    torch.manual_seed(123)  # scrambled: load_rest must bring the saved streams back
    random.seed(123)
    np.random.seed(123)
    checkpoint.load_rest(ckpt, state, 0, params2, opt2)
    got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["state"].keys() == s2["state"].keys() and len(s1["state"]) == len(params)
    for i in s1["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)


def test_resume_must_repeat_the_runs_resume_keys(tmp_path):
    d, params, opt = _trained(1)
    _save(tmp_path, 1, d, params, opt)
    (ckpt,) = checkpoint.complete(tmp_path)
    for k in checkpoint.RESUME_KEYS:
        other = CONFIG[k] + ("x" if isinstance(CONFIG[k], str) else 1)
        with pytest.raises(HstapError, match=re.escape(f"{k} was {CONFIG[k]}; resume with the same value")):
            checkpoint.read_state(ckpt, {**CONFIG, k: other})
    # a checkpoint from before the objective settings were recorded was trained with the soft CE and decay 0.8
    f = ckpt / "trainer_state.json"
    state = json.loads(f.read_text())
    f.write_text(json.dumps({**state, "config": {k: v for k, v in state["config"].items()
                                                 if k not in ("ttt_decay", "loss", "loss_mix", "lk_decay")}}))
    with pytest.raises(HstapError, match="ttt_decay was 0.8; resume with the same value"):
        checkpoint.read_state(ckpt, CONFIG)
    assert checkpoint.read_state(ckpt, {**CONFIG, "ttt_decay": 0.8, "loss": "ce"})["step"] == 1


def test_resume_into_another_draft_vocabulary_is_one_error(tmp_path):
    d, params, opt = _trained(1)
    _save(tmp_path, 1, d, params, opt)
    (ckpt,) = checkpoint.complete(tmp_path)
    d2 = _fresh()[0]
    t2d = d.t2d.clone()  # (V,)
    cold = torch.arange(t2d.numel())[~t2d][0]  # a cold id takes the first hot id's place: same size, other ids
    t2d[int(d.d2t[0])], t2d[cold] = False, True
    hot = torch.nonzero(t2d)[:, 0]  # (Vd,)
    d2.set_vocab_map(hot - torch.arange(hot.numel()), t2d)
    with pytest.raises(HstapError, match=r"drafter.safetensors: d2t/t2d: the run was trained on a draft vocabulary "
                                         r"map of \d+ ids \(sha256 \w+\), this resume resolves another one of \d+ ids"):
        checkpoint.load_weights(ckpt, d2)


def test_keep_prunes_to_the_newest_and_best_is_a_copy_without_optimizer(tmp_path):
    d, params, opt = _trained(1)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, d, params, opt, keep=2, best=step == 2)
    assert [c.name for c in checkpoint.complete(tmp_path)] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    best = tmp_path / "best"
    assert sorted(p.name for p in best.iterdir()) == ["drafter.json", "drafter.safetensors", "trainer_state.json"]
    assert json.loads((best / "trainer_state.json").read_text())["step"] == 2
    assert not (tmp_path / ".best.tmp").exists() and not (tmp_path / ".best.old").exists()


def test_recover_undoes_a_crashed_save(tmp_path):
    d, params, opt = _trained(1)
    _save(tmp_path, 1, d, params, opt, best=True)
    # A save killed half-way: a temp step dir without trainer_state.json, and best renamed away but not replaced.
    half = tmp_path / "checkpoints" / ".tmp_step_00000002"
    half.mkdir()
    (half / "optimizer.safetensors").write_bytes(b"\0" * 10)
    (tmp_path / "best").rename(tmp_path / ".best.old")
    (tmp_path / ".best.tmp").mkdir()
    assert [c.name for c in checkpoint.complete(tmp_path)] == ["step_00000001"]  # the half-written one never counts
    checkpoint.recover(tmp_path)
    assert not half.exists() and not (tmp_path / ".best.tmp").exists() and not (tmp_path / ".best.old").exists()
    assert load_file(str(tmp_path / "best" / "drafter.safetensors")).keys() == \
        load_file(str(tmp_path / "checkpoints" / "step_00000001" / "drafter.safetensors")).keys()
    assert [c.name for c in checkpoint.complete(tmp_path)] == ["step_00000001"]


def test_truncate_metrics_drops_lines_after_the_step_and_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "eval": True, "sim_tau": 0.5},
             {"step": 3, "loss": 2.0}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "lo')
    checkpoint.truncate_metrics(path, 2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:3]
    checkpoint.truncate_metrics(tmp_path / "absent.jsonl", 2)  # nothing to truncate: no error, no file
    assert not (tmp_path / "absent.jsonl").exists()


def test_init_from_loads_a_drafter_of_the_same_config_and_refuses_another(tmp_path):
    """`train --init-from`: the weights of an hstap drafter directory (serve-loop's served drafter), bit for bit; a
    drafter of another config is one error naming the fields."""
    from hstap.artifacts.drafter_dir import save_drafter

    d = _trained(1)[0]
    save_drafter(tmp_path / "src", d)
    d2 = _fresh()[0]
    d2.set_vocab_map(d.d2t, d.t2d)  # the run's vocab map (train --vocab-map): the one the drafter was trained with
    checkpoint.load_init(tmp_path / "src", d2)
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), d2.state_dict().values()))
    other = tiny_setup(num_layers=2)[0]
    with pytest.raises(HstapError, match=r"drafter.json: --init-from: its drafter differs from this run's in "
                                         r"\['num_layers'\]"):
        checkpoint.load_init(tmp_path / "src", other)
