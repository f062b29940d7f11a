"""Stage configs are what the user asked, as parsed: frozen, never changed by a run (a real tiny train run's
RUN/config.json equals the parsed config; what it resolved is RUN/plan.json, beside it), replayed and resumed from
config.json (an earlier, flat one too); a `--config` file is checked field by field as strictly as the command line (one
line naming the file and the field, exit status 2, nothing written); layer lists take the same forms in capture and
train; train's sections keep every flag's name."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
from helpers.train import build_assets

from hstap.cli import COMMANDS, main, make_config, options


@pytest.fixture(scope="module")
def assets(tiny_tokenizer, tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("configs"), tiny_tokenizer[0], n=16)


def test_every_stage_config_and_section_is_frozen():
    from hstap.train.config import TrainConfig, TrainInputs

    for stage, (mod, cls_name, _, _) in COMMANDS.items():
        cls = getattr(importlib.import_module(mod), cls_name)
        assert cls.__dataclass_params__.frozen, stage
        for path, *_ in options(cls):
            if len(path) > 1:  # a nested section's class
                section = type(getattr(cls, "__dataclass_fields__")[path[0]].default_factory())
                assert section.__dataclass_params__.frozen, (stage, path[0])
    cfg = TrainConfig(out="o", target="t", inputs=TrainInputs(store="s"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.devices.ce_chunk = 4096  # type: ignore[misc]


def _error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_train_run_records_its_config_as_parsed_and_its_plan_beside_it(assets, tmp_path, capsys):
    from hstap.train.config import TrainConfig
    from hstap.train.data import auto_ce_chunk

    run = tmp_path / "run"
    argv = ["--store", str(assets["store"]), "--target", str(assets["target"]), "--out", str(run), "--steps", "2",
            "--batch-tokens", "600", "--ttt", "2", "--eval-frac", "0", "--log-every", "1", "--skip-verify",
            "--device", "cpu", "--tensorboard", "false"]
    parsed = make_config("train", TrainConfig, argv)
    assert main(["train", *argv]) == 0
    asked = json.loads((run / "config.json").read_text())["config"]
    assert asked == dataclasses.asdict(parsed)  # the config as parsed, nothing resolved written into it
    assert asked["devices"]["ce_chunk"] == 0 and asked["inputs"]["draft_vocab"] == 0  # 0: auto, as asked
    plan = json.loads((run / "plan.json").read_text())
    assert plan["ce_chunk"] == auto_ce_chunk(400) and plan["draft_vocab"] == 96  # the prepared set's map, via the store
    assert plan["aux_layers"] == [1, 3, 4] and plan["store_indices"] == [0, 1, 2]
    assert plan["resume"] is None and plan["resume_step"] == 0 and plan["vocab_map"]["sha256"]
    # config.json replays the run; --resume continues it (trainer_state.json's config is checked against it)
    assert make_config("train", TrainConfig, ["--config", str(run / "config.json")]) == parsed
    assert main(["train", "--config", str(run / "config.json"), "--resume", "--steps", "3"]) == 0
    plan = json.loads((run / "plan.json").read_text())
    assert plan["resume_step"] == 2 and plan["resume"].endswith("step_00000002")
    assert (run / "checkpoints" / "step_00000003" / "trainer_state.json").is_file()
    assert json.loads((run / "config.json").read_text())["config"] == dataclasses.asdict(
        dataclasses.replace(parsed, resume=True, hyper=dataclasses.replace(parsed.hyper, steps=3)))
    state = json.loads((run / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["config"]["lr"] == parsed.hyper.lr and "hyper" not in state["config"]  # flat, as checkpoints were
    capsys.readouterr()


TRAIN_FLAGS = ("steps", "epochs", "ttt", "ttt_decay", "loss", "loss_mix", "lk_decay", "lr", "min_lr_ratio",
               "warmup_ratio", "weight_decay", "grad_clip", "grad_accum", "batch_tokens", "eval_every", "save_every",
               "keep", "log_every", "out", "target", "store", "data", "online", "vocab_map", "draft_vocab",
               "aux_layers", "draft_layers", "eval_store", "eval_frac", "resume", "skip_verify", "device", "dtype",
               "attn", "compile", "fsdp", "workers", "ce_chunk", "init_lm_head", "init_from", "seed", "peak_tflops",
               "tensorboard", "follow", "consume", "keep_shards", "replay_fraction", "holdout_frac", "anchor_store",
               "anchor_fraction")
"""`hstap train`'s flags before its config had sections (one flat config of these fields)."""
ADDED_FLAGS = ("allow_other_variant", "side_branches", "side_context")
"""`hstap train`'s flags added since."""


def test_train_sections_keep_every_flag_and_an_earlier_flat_config_json_replays(tmp_path):
    from hstap.cli import build_parser
    from hstap.common import run_meta
    from hstap.config import flag_values, from_flags
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.train.config import TrainConfig

    parser = build_parser("train", TrainConfig, "")
    for name in TRAIN_FLAGS:  # each flag under its name, its section's spelling beside it
        assert "--" + name.replace("_", "-") in parser._option_string_actions, name
    assert "--hyper.lr" in parser._option_string_actions and "--stream.keep-shards" in parser._option_string_actions
    sl = build_parser("serve-loop", ServeLoopConfig, "")
    for name in ("keep_shards", "holdout_frac", "replay_fraction", "anchor_store", "anchor_fraction"):
        assert "--" + name.replace("_", "-") in sl._option_string_actions, name  # the serve loop's, as before
    argv = ["--store", "s", "--target", "t", "--out", "o", "--lr", "0.01", "--follow", "--consume", "--keep-shards",
            "3", "--vocab-map", "v", "--eval-frac", "0", "--no-compile", "--train.ttt", "2", "--hyper.steps", "7"]
    cfg = make_config("train", TrainConfig, argv)
    assert (cfg.hyper.lr, cfg.hyper.ttt, cfg.hyper.steps, cfg.stream.keep_shards, cfg.devices.compile) == (
        0.01, 2, 7, 3, False)
    flat = flag_values(cfg)
    assert sorted(flat) == sorted(TRAIN_FLAGS + ADDED_FLAGS) and from_flags(TrainConfig, **flat) == cfg
    old = tmp_path / "old.json"  # RUN/config.json as a train of one flat config wrote it
    old.write_text(json.dumps({"stage": "train", "hstap_version": "0", "config": flat}))
    assert make_config("train", TrainConfig, ["--config", str(old)]) == cfg
    new = tmp_path / "config.json"  # as one writes it now: each section nested under its name
    new.write_text(json.dumps(run_meta("train", cfg)))
    assert set(json.loads(new.read_text())["config"]) == {
        "out", "target", "inputs", "drafter", "devices", "resume", "seed", "tensorboard", "follow", "consume",
        "stream", "hyper"}
    assert make_config("train", TrainConfig, ["--config", str(new), "--lr", "0.02"]) == dataclasses.replace(
        cfg, hyper=dataclasses.replace(cfg.hyper, lr=0.02))
    with pytest.raises(Exception, match="unknown field 'hyper.store'"):  # a field in another section than its own
        new.write_text(json.dumps({"target": "t", "out": "o", "hyper": {"store": "s"}}))
        make_config("train", TrainConfig, ["--config", str(new)])


@pytest.mark.parametrize("stage, values, says", [
    ("train", {"steps": 2.5}, "steps: expected an integer, got 2.5"),  # once ran 3 steps and succeeded
    ("train", {"steps": "ten"}, "steps: expected an integer, got 'ten'"),
    ("train", {"lr": "0.003"}, "lr: expected a number, got '0.003'"),
    ("train", {"resume": "no"}, "resume: expected true or false, got 'no'"),  # once read as true
    ("train", {"draft_vocab": True}, "draft_vocab: expected an integer, got True"),
    ("train", {"device": "gpu"}, "device: expected one of auto, cpu, cuda, got 'gpu'"),
    ("train", {"aux_layers": "1,,3"}, "aux_layers: an empty item in '1,,3'"),
    ("train", {"aux_layers": [1, "x"]}, "aux_layers: expected layer ids"),
    ("train", {"target": None}, "target: expected a string, got null"),
    ("train", {"hyper": {"lr": "fast"}}, "hyper.lr: expected a number, got 'fast'"),
    ("train", {"devices.workers": 1.5}, "devices.workers: expected an integer, got 1.5"),
    ("train", {"stream": []}, "stream: expected a mapping of stream's fields, got []"),
    ("serve-loop", {"keep_shards": "4"}, "keep_shards: expected an integer, got '4'"),
    ("serve-loop", {"stream": {"holdout_frac": True}}, "stream.holdout_frac: expected a number, got True"),
    ("capture", {"layers": [1, 3.5]}, "layers: expected layer ids"),
    ("serve-loop", {"train": {"ttt": "3"}}, "train.ttt: expected an integer, got '3'"),
    ("serve-loop", {"train.lr": "fast"}, "train.lr: expected a number, got 'fast'"),
    ("serve-loop", {"train": 3}, "train: expected a mapping of train's fields, got 3"),
])
def test_config_file_values_are_checked_field_by_field(stage, values, says, tmp_path, capsys):
    out = tmp_path / "out"
    base = {"train": {"store": str(tmp_path / "s"), "target": str(tmp_path / "t")},
            "capture": {"target": str(tmp_path / "t"), "data": str(tmp_path / "d")},
            "serve-loop": {"target": str(tmp_path / "t"), "prompts": str(tmp_path / "p")}}[stage]
    f = tmp_path / "c.json"
    f.write_text(json.dumps({**base, "out": str(out), **values}))
    assert main([stage, "--config", str(f)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"hstap: error: {f}: ") and says in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # nothing written


def test_layer_lists_take_the_same_forms_in_capture_and_train(tmp_path, capsys):
    from hstap.capture.config import CaptureConfig
    from hstap.config import from_flags, lookup
    from hstap.train.config import TrainConfig

    for stage, cls, name, base in (("capture", CaptureConfig, "layers", {"target": "t", "data": "d", "out": "o"}),
                                   ("train", TrainConfig, "aux_layers", {"target": "t", "store": "s", "out": "o"})):
        f = tmp_path / f"{stage}.json"
        for given in ([1, 3, 4], "1,3,4"):
            f.write_text(json.dumps({**base, name: given}))
            assert lookup(make_config(stage, cls, ["--config", str(f)]), name) == "1,3,4"
        assert lookup(make_config(stage, cls, [f"--{name.replace('_', '-')}", "1,3,4", *sum(
            ([f"--{k}", v] for k, v in base.items()), [])]), name) == "1,3,4"
        assert lookup(from_flags(cls, **base, **{name: [1, 3, 4]}), name) == "1,3,4"  # in Python too
    y = tmp_path / "run.yaml"  # YAML 1.1 reads 3e-3 as a string; a config file reads it as the number it is
    y.write_text("target: t\nstore: s\nout: o\nlr: 3e-3\naux_layers: [1, 3]\n")
    cfg = make_config("train", TrainConfig, ["--config", str(y)])
    assert cfg.hyper.lr == 0.003 and cfg.inputs.aux_layers == "1,3"
    # an empty item on the command line is an error naming the flag, before anything is written
    for stage, flag, extra in (("capture", "--layers", ["--data", str(tmp_path / "d")]),
                               ("train", "--aux-layers", ["--store", str(tmp_path / "s")])):
        out = tmp_path / f"{stage}-out"
        assert main([stage, "--target", str(tmp_path / "t"), "--out", str(out), flag, "1,,3", *extra]) == 2
        line = _error_line(capsys)
        assert line.startswith(f"hstap: error: {stage}: {flag}: an empty item in '1,,3'"), line
        assert not out.exists()


def test_a_section_takes_flags_file_values_and_keeps_its_overrides(tmp_path):
    from hstap.demo.config import TRAIN as DEMO_TRAIN
    from hstap.demo.config import DemoConfig
    from hstap.serve_loop.config import TRAIN, ServeLoopConfig
    from hstap.train.config import HyperParams

    base = ["--target", "t", "--prompts", "p", "--out", "o"]
    cfg = make_config("serve-loop", ServeLoopConfig, base)
    assert cfg.train == HyperParams(**TRAIN) and cfg.train.lr == HyperParams().lr  # train's default unless overridden
    f = tmp_path / "sl.json"
    f.write_text(json.dumps({"train": {"epochs": 2, "lr": 0.001}, "serve-loop.train.save_every": 4}))
    cfg = make_config("serve-loop", ServeLoopConfig, [*base, "--config", str(f), "--train.lr", "0.01", "--train-ttt",
                                                      "4"])
    assert (cfg.train.epochs, cfg.train.lr, cfg.train.ttt, cfg.train.save_every) == (2, 0.01, 4, 4)
    assert cfg.train.batch_tokens == TRAIN["batch_tokens"]  # the loop's override stays where not given
    demo = make_config("demo", DemoConfig, ["--train-steps", "3", "--train.ttt", "2"])
    assert (demo.train.steps, demo.train.ttt, demo.train.batch_tokens) == (3, 2, DEMO_TRAIN["batch_tokens"])
    meta = tmp_path / "config.json"  # a serve-loop's config.json replays with its section
    from hstap.common import run_meta
    meta.write_text(json.dumps(run_meta("serve-loop", cfg)))
    assert make_config("serve-loop", ServeLoopConfig, ["--config", str(meta)]) == cfg


def test_the_serve_loops_trainer_starts_from_a_train_config(tmp_path):
    """The loop's trainer: its train section plus what the loop fixes, as `hstap train --config` reads it back."""
    from hstap.common import run_meta
    from hstap.serve_loop.config import STREAM, TRAIN, ServeLoopConfig
    from hstap.serve_loop.stage import trainer_config
    from hstap.train.config import HyperParams, StreamParams, TrainConfig

    d0 = tmp_path / "drafter0"
    cfg = ServeLoopConfig(target=str(tmp_path / "t"), prompts="p", out=str(tmp_path / "w"), seed=7,
                          stream=StreamParams(**(STREAM | {"keep_shards": 6})),
                          train=HyperParams(**(TRAIN | {"lr": 1e-3, "epochs": 2})))
    t = trainer_config(cfg, tmp_path / "w", d0, 2, "cpu")  # a start drafter of 2 decoder layers
    assert (t.follow, t.consume, t.inputs.eval_frac, t.drafter.draft_layers, t.seed, t.tensorboard) == (
        True, True, 0.0, 2, 7, False)
    assert t.hyper is cfg.train and t.stream is cfg.stream  # the loop's sections, as they are
    assert (t.stream.keep_shards, t.stream.holdout_frac) == (6, STREAM["holdout_frac"])
    assert (t.hyper.lr, t.hyper.epochs, t.hyper.ttt, t.hyper.save_every, t.hyper.log_every) == (
        1e-3, 2, TRAIN["ttt"], TRAIN["save_every"], 1)
    assert t.drafter.init_from == str(d0) and t.inputs.vocab_map == str(tmp_path / "w" / "vocab_map.safetensors")
    f = tmp_path / "run.config.json"
    f.write_text(json.dumps(run_meta("train", t)))
    assert make_config("train", TrainConfig, ["--config", str(f)]) == t


@pytest.mark.parametrize("stage, flag", [("train", "--warmup-ratio"), ("train", "--eval-frac"),
                                         ("train", "--replay-fraction"), ("train", "--holdout-frac"),
                                         ("train", "--anchor-fraction"), ("serve-loop", "--rollback-ratio")])
def test_every_fraction_is_in_zero_one(stage, flag, tmp_path, capsys):
    """Each [0, 1) fraction refuses 1 (nothing would be left for the rest) and a negative value, one line naming it."""
    base = {"train": ["--store", str(tmp_path / "s"), "--target", str(tmp_path / "t")],
            "serve-loop": ["--target", str(tmp_path / "t"), "--prompts", str(tmp_path / "p")]}[stage]
    for bad in ("1.0", "-0.1"):
        assert main([stage, *base, "--out", str(tmp_path / "out"), flag, bad]) == 2
        line = _error_line(capsys)
        assert f"{flag}: must be in [0, 1), got {float(bad)}" in line, line
    assert not (tmp_path / "out").exists()

