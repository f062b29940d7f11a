"""Training end to end on a real store captured from a tiny random target: learning, kill -9 + resume (bitwise), 2-rank
DDP and FSDP2 over gloo against one process, online (live target) against offline (store) training, and a resume with
more steps extending the LR schedule."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest
import torch
from helpers.train import Child, metrics, ranks
from safetensors.torch import load_file

from hstap.common import HstapError
from hstap.config import from_flags
from hstap.train.config import HyperParams, TrainConfig
from hstap.train.stage import train
from hstap.train.trainer import Schedule

pytestmark = pytest.mark.procs


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the child processes run single-threaded too: same kernels, same float results
    yield
    torch.set_num_threads(n)


# device cpu: these tests pin CPU fp32 behaviour (bitwise resume, gloo ranks equal to one process) on any machine; a
# GPU box would otherwise pick cuda + bf16 + compiled flex attention. tests/test_cuda.py covers the GPU paths.
def _argv(a, out, **kw) -> list[str]:
    opts = {"store": a["store"], "target": a["target"], "out": out, "batch_tokens": 600, "ttt": 3, "log_every": 1,
            "skip_verify": True, "device": "cpu", **kw}
    argv = []
    for k, v in opts.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return argv


def _cfg(a, out, **kw) -> TrainConfig:
    base = {"store": str(a["store"]), "target": str(a["target"]), "out": str(out), "batch_tokens": 600, "ttt": 3,
            "log_every": 1, "skip_verify": True, "device": "cpu"}
    return from_flags(TrainConfig, **(base | kw))


def test_offline_training_learns_and_checkpoints(assets, tmp_path, capsys):
    run = tmp_path / "run"
    out = train(_cfg(assets, run, steps=24, lr=3e-3, save_every=8, keep=2, eval_frac=0.2, draft_vocab=96,
                     skip_verify=False))
    printed = capsys.readouterr().out
    assert "hstap train: done" in printed and "sim tau" in printed
    assert not [x for x in printed.splitlines() if x.lstrip().startswith("{")]  # a table, never a raw dict
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the loss / acceptance curves
    rows, evals = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 25))
    for r in rows:
        assert len(r["acc"]) == 3 and len(r["loss_k"]) == 3 and r["tok_s"] > 0 and 0 < r["mfu"] < 1
        assert r["loss"] == pytest.approx(sum(HyperParams.ttt_decay ** k * x for k, x in enumerate(r["loss_k"])))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    assert sum(rows[-1]["acc"]) > sum(rows[0]["acc"])
    # sim_tau is tau as hstap eval measures it (tokens per target forward, bonus included): the chain of --ttt drafts
    assert [e["step"] for e in evals] == [8, 16, 24] and all(1 <= e["sim_tau"] <= 4 for e in evals)
    assert all(e["sim_tau"] == e["sim_chain_tau"][-1] for e in evals)
    assert evals[-1]["sim_tau"] > 0 and out["best_sim_tau"] == max(e["sim_tau"] for e in evals)
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_00000016", "step_00000024"]  # --keep 2, no temp dirs left
    opt = load_file(str(run / "checkpoints" / "step_00000024" / "optimizer.safetensors"))
    assert {k.split(".", 2)[2] for k in opt} == {"exp_avg", "exp_avg_sq", "step"}
    assert float(opt["state.0.step"]) == 24.0
    conf = json.loads((run / "config.json").read_text())["config"]  # as asked: --ce-chunk 0 (auto)
    plan = json.loads((run / "plan.json").read_text())  # what ran: the value it resolved to
    vocab = json.loads((assets["target"] / "config.json").read_text())["vocab_size"]
    assert conf["devices"]["ce_chunk"] == 0 and plan["ce_chunk"] == (16384 if vocab <= 16384 else 4096)
    assert "ce chunk 16384" in printed

    # The checkpoint is an hstap drafter; the vocab map derived from the store's counts is the prepared set's.
    from hstap.artifacts.vocab_map import load_vocab_map
    from hstap.artifacts.drafter_dir import load_drafter
    best, meta = load_drafter(run)
    assert meta["store"]["layers"] == [1, 3, 4] and best.config.aux_layers == [1, 3, 4]
    d2t, t2d = load_vocab_map(assets["prepared"])
    assert torch.equal(best.d2t, d2t) and torch.equal(best.t2d, t2d)
    assert best.embed_tokens.weight.requires_grad is False

    with pytest.raises(HstapError, match="--resume"):  # never silently overwrite a run
        train(_cfg(assets, run, steps=2))


@pytest.mark.slow
def test_kill_9_then_resume_reproduces_the_loss_trajectory(assets, tmp_path):
    common = dict(steps=16, save_every=4, eval_frac=0.2, lr=2e-3)
    ref = Child(_argv(assets, tmp_path / "ref", **common), tmp_path / "ref.log")
    victim = Child(_argv(assets, tmp_path / "run", **common), tmp_path / "run.log")
    first = tmp_path / "run" / "checkpoints" / "step_00000004"
    t0 = time.time()
    while not first.exists() and victim.proc.is_alive() and time.time() - t0 < 120:
        time.sleep(0.005)
    victim.kill()
    assert victim.wait() == -9, f"the run ended before it could be killed:\n{victim.output()[-2000:]}"
    done = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert done and done[-1] < "step_00000016", done
    resumed = Child(_argv(assets, tmp_path / "run", **common, resume=True), tmp_path / "resume.log")
    assert resumed.wait() == 0, resumed.output()[-3000:]
    assert ref.wait() == 0, ref.output()[-3000:]
    assert "resumed from step_" in resumed.output()
    assert "hstap train: TTT attention sdpa: CPU: SDPA with the exact TTT mask" in resumed.output()
    (a, ea), (b, eb) = metrics(tmp_path / "ref"), metrics(tmp_path / "run")
    assert [r["step"] for r in b] == list(range(1, 17))
    assert [(r["loss"], r["loss_k"], r["acc"], r["grad_norm"]) for r in b] == \
           [(r["loss"], r["loss_k"], r["acc"], r["grad_norm"]) for r in a]  # bitwise: floats compared with ==
    assert [(e["step"], e["sim_tau"]) for e in eb] == [(e["step"], e["sim_tau"]) for e in ea]
    wa = load_file(str(tmp_path / "ref" / "checkpoints" / "step_00000016" / "drafter.safetensors"))
    wb = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000016" / "drafter.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_gloo_ranks_ddp_and_fsdp_equal_one_process(assets, tmp_path, one_thread):
    common = dict(steps=3, ttt=2, eval_frac=0.0, save_every=3, lr=3e-3)
    ddp = ranks(_argv(assets, tmp_path / "ddp", **common), tmp_path / "ddp_logs")
    fsdp = ranks(_argv(assets, tmp_path / "fsdp", **common, fsdp=True), tmp_path / "fsdp_logs")
    # One process, two micro-batches per step = the global batch of two ranks with one each.
    train(_cfg(assets, tmp_path / "one", grad_accum=2, **common))
    for c in ddp + fsdp:
        assert c.wait() == 0, c.output()[-3000:]
    one, _ = metrics(tmp_path / "one")
    assert len(one) == 3
    w1 = load_file(str(tmp_path / "one" / "checkpoints" / "step_00000003" / "drafter.safetensors"))
    for name in ("ddp", "fsdp"):
        rows, _ = metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert rows[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-6)  # before any update: same numbers
        for r, o in zip(rows, one):
            assert r["loss"] == pytest.approx(o["loss"], rel=1e-5), name
            assert r["acc"] == pytest.approx(o["acc"], abs=1e-9), name
            assert r["grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-4), name
        w = load_file(str(tmp_path / name / "checkpoints" / "step_00000003" / "drafter.safetensors"))
        assert set(w) == set(w1)
        for k in w1:
            torch.testing.assert_close(w[k], w1[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
        assert "world 2" in ddp[0].output() and ("fsdp" in fsdp[0].output())


@pytest.mark.parametrize("extra", [{"aux_layers": "1,3,4"}, {"aux_layers": "final", "ttt": 1}],
                         ids=["eagle3", "final-only"])
def test_online_first_step_equals_offline(assets, tmp_path, extra):
    """The live target (same capture code path) and the fp32 store give the same states, hence the same loss."""
    vmap = str(assets["prepared"] / "vocab_map.safetensors")
    common = dict(steps=1, batch_tokens=8192, eval_frac=0.0, vocab_map=vmap, **extra)  # one batch holds every sample
    off = train(_cfg(assets, tmp_path / "off", **common))
    on = train(_cfg(assets, tmp_path / "on", store=None, online=True, data=str(assets["prepared"]), **common))
    (a, _), (b, _) = metrics(tmp_path / "off"), metrics(tmp_path / "on")
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], rel=1e-5)
    assert b[0]["acc"] == a[0]["acc"] and b[0]["tokens"] == a[0]["tokens"]
    w = load_file(str(tmp_path / "on" / "checkpoints" / "step_00000001" / "drafter.safetensors"))
    assert w["fc.weight"].shape == ((64, 64) if extra["aux_layers"] == "final" else (64, 3 * 64))
    assert w["lm_head.weight"].shape == (96, 64)
    assert off["loss"] == a[0]["loss"] and on["loss"] == b[0]["loss"]


def test_bad_layer_selection_is_one_clear_error(assets, tmp_path):
    with pytest.raises(HstapError, match=r"--aux-layers: \[2\] not captured"):
        train(_cfg(assets, tmp_path / "x", steps=1, aux_layers="1,2"))


def test_resuming_a_finished_run_and_a_run_saved_under_the_old_tau(assets, tmp_path, capsys):
    """--resume of a run that has all its steps: no step, the closing table (best sim tau, no last one), this run's
    tokens 0. A checkpoint saved before sim_tau included the bonus token (no tau_definition) does not keep its
    best_sim_tau: the resumed run's first evaluation is compared with nothing older."""
    common = dict(save_every=2, eval_frac=0.2, lr=2e-3)
    first = train(_cfg(assets, tmp_path / "run", steps=2, **common))
    capsys.readouterr()
    again = train(_cfg(assets, tmp_path / "run", steps=2, resume=True, **common))
    out = capsys.readouterr().out
    assert again["steps"] == 2 and again["sim_tau"] is None and again["best_sim_tau"] == first["best_sim_tau"]
    tau_line = next(ln for ln in out.splitlines() if ln.lstrip().startswith("sim tau"))
    assert again["tokens_this_run"] == 0 and "best" in tau_line and "last" not in tau_line, out
    state_file = tmp_path / "run" / "checkpoints" / "step_00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["tau_definition"] == 2
    del state["tau_definition"]
    state["best_sim_tau"] = 99.0  # the old definition's value, in another unit
    state_file.write_text(json.dumps(state))
    resumed = train(_cfg(assets, tmp_path / "run", steps=4, resume=True, **common))
    assert resumed["best_sim_tau"] == resumed["sim_tau"] < 99.0


def test_resume_with_more_steps_extends_the_schedule(assets, tmp_path):
    """--resume with a larger --steps lays the cosine over the new total from the checkpoint's step on."""
    common = dict(save_every=4, eval_frac=0.0, lr=2e-3, warmup_ratio=0.2, min_lr_ratio=0.1)
    train(_cfg(assets, tmp_path / "run", steps=4, **common))
    train(_cfg(assets, tmp_path / "run", steps=8, resume=True, **common))
    rows, _ = metrics(tmp_path / "run")
    short, long = (Schedule(2e-3, 0.2, 0.1, n) for n in (4, 8))
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["lr"] for r in rows] == [short.lr_at(i) for i in range(4)] + [long.lr_at(i) for i in range(4, 8)]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert state["total_steps"] == 8 and state["scheduler"] == long.state(8)


def test_a_flex_compile_failure_is_one_log_line_and_the_run_trains_as_sdpa(assets, tmp_path, monkeypatch, capsys):
    """--attn flex whose compile fails (as a shape inductor has no kernel for did on CUDA): one run-log line, then the
    run goes on with the exact SDPA path and logs the losses of an --attn sdpa run bitwise. The failure is injected at
    the compiled region's place: eager flex on CPU has no backward, and no CUDA compile runs here."""
    from torch._inductor.select_algorithm import NoValidChoicesError

    import hstap.models.drafter as dr
    from hstap.models.compiled import guard_flex_compile

    def no_kernel(q, k, v, **kw):
        raise NoValidChoicesError("No choices to select, please consider adding ATEN into max_autotune_gemm_backends")

    common = dict(steps=3, save_every=3, eval_frac=0.2, lr=2e-3)
    train(_cfg(assets, tmp_path / "sdpa", attn="sdpa", **common))
    capsys.readouterr()
    monkeypatch.setattr(dr, "_flex", lambda cuda: guard_flex_compile(no_kernel))
    train(_cfg(assets, tmp_path / "flex", attn="flex", **common))
    out = capsys.readouterr().out
    told = [ln for ln in out.splitlines() if "TTT attention sdpa from now on" in ln]
    assert len(told) == 1 and "NoValidChoicesError: No choices to select" in told[0], out
    assert "hstap train: TTT attention flex: --attn flex on CPU" in out
    (a, ea), (b, eb) = metrics(tmp_path / "sdpa"), metrics(tmp_path / "flex")
    assert [(r["loss"], r["acc"], r["grad_norm"]) for r in b] == [(r["loss"], r["acc"], r["grad_norm"]) for r in a]
    assert [e["sim_tau"] for e in eb] == [e["sim_tau"] for e in ea] and len(eb) == 1


def test_deeper_drafter_with_another_objective_trains_and_exports(assets, tmp_path):
    """--draft-layers 2 --loss ce+tv through the CLI: metrics only at log steps (the logged figures are that step's),
    a checkpoint with two decoder layers that evaluates and exports to vLLM; a bad --loss is one clear line."""
    from hstap.cli import COMMANDS, make_config
    from hstap.artifacts.drafter_dir import load_drafter
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export

    run = tmp_path / "run"
    cfg = make_config("train", TrainConfig, _argv(assets, run, steps=6, lr=3e-3, log_every=3, eval_frac=0.2,
                                                  draft_layers=2, loss="ce+tv", loss_mix=0.3, data=assets["prepared"]))
    assert "train" in COMMANDS and cfg.drafter.draft_layers == 2 and cfg.hyper.loss == "ce+tv"
    out = train(cfg)
    rows, evals = metrics(run)
    assert [r["step"] for r in rows] == [3, 6] and evals and evals[-1]["sim_tau"] >= 0
    assert rows[-1]["loss"] == pytest.approx(sum(HyperParams.ttt_decay ** k * x for k, x in enumerate(rows[-1]["loss_k"])))
    d, _ = load_drafter(run)
    assert d.config.num_layers == 2 and out["steps"] == 6
    export(ExportConfig(run=str(run), to="vllm", out=str(tmp_path / "vl"), target=str(assets["target"])))
    conf = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert conf["transformer_layer_config"]["num_hidden_layers"] == 2
    with pytest.raises(HstapError, match=r"train: --loss: expected one of"):
        _cfg(assets, tmp_path / "x", steps=1, loss="ce+kl")


def test_a_run_failing_on_bad_input_leaves_no_config(assets, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(HstapError, match="vocab map not found"):
        train(_cfg(assets, run, steps=1, vocab_map=str(tmp_path / "nope.safetensors")))
    assert not run.exists()  # nothing half-written: no RUN/, no RUN/config.json
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(HstapError, match="not captured"):
        train(_cfg(assets, run, steps=1, aux_layers="1,2"))
    assert [p.name for p in run.iterdir()] == ["notes.txt"]  # a directory that was there keeps exactly its files


def test_a_follow_run_with_a_bad_vocab_map_fails_before_claiming_the_store(assets, tmp_path):
    """--follow --consume claims the store (consumer.json) and then waits for writers: a bad --vocab-map must fail
    first, or capture's writers would keep to the window of a trainer that is gone."""
    store, run = tmp_path / "live", tmp_path / "run"
    with pytest.raises(HstapError, match="vocab map not found"):
        train(_cfg(assets, run, steps=1, store=str(store), follow=True, consume=True, keep_shards=2, eval_frac=0.0,
                   vocab_map=str(tmp_path / "nope.safetensors")))
    assert not store.exists() and not run.exists()


def test_the_prepared_draft_vocab_carries_through_capture_to_train(assets, tmp_path):
    """prepare --draft-vocab 96 -> capture copies the map into the store (its sha256 in the header) -> `train --store`
    alone uses it; an explicit --vocab-map wins; a store without a map keeps the old fallback (the store's counts)."""
    import shutil

    from hstap.common import sha256_bytes
    from hstap.artifacts.vocab_map import build_vocab_map
    from hstap.artifacts.drafter_dir import load_drafter
    from hstap.store.reader import open_store

    st = assets["store"]
    rec = open_store(st).header["vocab_map"]
    copied = (st / "vocab_map.safetensors").read_bytes()
    assert copied == (assets["prepared"] / "vocab_map.safetensors").read_bytes()
    assert rec == {"file": "vocab_map.safetensors", "sha256": sha256_bytes(copied), "size": 96}

    def drafter_vocab(out, **kw):
        train(_cfg(assets, tmp_path / out, steps=1, eval_frac=0.0, **kw))  # draft_vocab unset: the map's size
        d, meta = load_drafter(tmp_path / out)
        return d.config.draft_vocab_size, meta["vocab_map_sha256"]

    assert drafter_vocab("from-store")[0] == 96
    import numpy as np
    from safetensors.numpy import save_file
    d2t, t2d = build_vocab_map(np.arange(400)[::-1].astype(np.int64), 50)
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "vm.safetensors"))
    assert drafter_vocab("explicit", vocab_map=str(tmp_path / "vm.safetensors"))[0] == 50
    old = tmp_path / "old-store"  # a store captured before maps were copied: derived from its counts, as before
    shutil.copytree(st, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["vocab_map"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    (old / "vocab_map.safetensors").unlink()
    assert drafter_vocab("old", store=str(old))[0] == 400
    tampered = tmp_path / "tampered"
    shutil.copytree(st, tampered)
    (tampered / "vocab_map.safetensors").write_bytes((tmp_path / "vm.safetensors").read_bytes())
    with pytest.raises(HstapError, match="sha256 differs"):
        drafter_vocab("t", store=str(tampered))


def test_an_explicit_draft_vocab_is_never_ignored(assets, tmp_path):
    """--draft-vocab N unlike the store's (prepared) map of 96: the top N of the store's counts, recorded in
    plan.json; unlike an explicit --vocab-map: one error, before the run exists; unset: the map's own size."""
    from hstap.artifacts.vocab_map import build_vocab_map, load_vocab_map
    from hstap.artifacts.drafter_dir import load_drafter
    from hstap.store.reader import open_store

    def run(out, **kw):
        train(_cfg(assets, tmp_path / out, steps=1, eval_frac=0.0, **kw))
        d, _ = load_drafter(tmp_path / out)
        return d, json.loads((tmp_path / out / "plan.json").read_text())

    d, plan = run("unset")
    assert d.config.draft_vocab_size == 96 and plan["draft_vocab"] == 96  # the resolved size is recorded
    assert json.loads((tmp_path / "unset" / "config.json").read_text())["config"]["inputs"]["draft_vocab"] == 0  # as asked
    d, plan = run("fifty", draft_vocab=50)
    st = open_store(assets["store"])
    V = d.t2d.numel()
    want_d2t, _ = build_vocab_map(st.token_counts(V), 50)  # the store's own loss-masked counts decide
    assert d.config.draft_vocab_size == 50 and plan["draft_vocab"] == 50
    assert torch.equal(d.d2t.cpu(), torch.from_numpy(want_d2t))
    prepared_d2t, _ = load_vocab_map(str(assets["prepared"]))
    assert prepared_d2t.numel() == 96  # the prepared map was there, and was not used
    d, _ = run("data-map", draft_vocab=50, data=str(assets["prepared"]))  # --data's map of 96 ids: likewise
    assert torch.equal(d.d2t.cpu(), torch.from_numpy(want_d2t))
    with pytest.raises(HstapError, match="--draft-vocab 60: the vocab map of .* has 96 draft ids"):
        run("conflict", draft_vocab=60, vocab_map=str(assets["prepared"]))
    assert not (tmp_path / "conflict").exists()
    with pytest.raises(HstapError, match="--draft-vocab 60: the vocab map of .* has 96 draft ids"):  # no store to count
        run("online", draft_vocab=60, store=None, online=True, data=str(assets["prepared"]), aux_layers="1,3,4")
    assert not (tmp_path / "online").exists()
    conf = (tmp_path / "fifty" / "config.json").read_bytes()
    with pytest.raises(HstapError, match=r"drafter.safetensors: d2t/t2d: the run was trained on a draft vocabulary map "
                                         r"of 50 ids .*, this resume resolves another one of 96 ids .*; resume with "
                                         r"the run's own --store, --vocab-map and --draft-vocab"):
        train(_cfg(assets, tmp_path / "fifty", steps=2, eval_frac=0.0, resume=True))  # resumed without its flag
    assert (tmp_path / "fifty" / "config.json").read_bytes() == conf  # the refused resume rewrote nothing


# ---------------------------------------------------------------------------------------------------------------------
# bad inputs: one error line naming the file / field / flag, exit 2, nothing written or rewritten


def _damage(store, how: str):
    f = store / json.loads((store / "manifest.json").read_text())["shards"][0]["file"]
    b = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(bytes(b[: len(b) // 2]))
    else:
        b[len(b) * 2 // 3] ^= 0x01  # one bit of one state: training on it would go unnoticed
        f.write_bytes(bytes(b))
    return f


def _other_vocab_store(assets, dst):
    """The store's samples under another draft vocabulary map of the same size (96 ids), as a store captured from
    another prepared set would carry: its manifest records the map's sha256."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    from hstap.common import sha256_bytes
    from hstap.artifacts.vocab_map import build_vocab_map

    shutil.copytree(assets["store"], dst)
    d2t, t2d = build_vocab_map(np.arange(400)[::-1].astype(np.int64), 96)
    save_file({"d2t": d2t, "t2d": t2d}, str(dst / "vocab_map.safetensors"))
    m = json.loads((dst / "manifest.json").read_text())
    m["vocab_map"]["sha256"] = sha256_bytes((dst / "vocab_map.safetensors").read_bytes())
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("case", ["truncated shard", "flipped byte", "empty store", "missing target",
                                  "resume with another store", "empty training split", "data of another tokenizer"])
def test_bad_inputs_are_one_line_and_write_nothing(case, assets, tmp_path, capsys):
    """Train refuses, in one line and before RUN is written: a truncated shard or one flipped byte (the store's
    checksums are checked before the first step, so a damaged shard is neither a mid-run SafetensorError nor trained
    on); an empty store (it holds no sample, said as such); a --target that does not exist (named as a missing path,
    not sent to the hub); a --resume whose store carries another draft vocabulary map of the same size (both maps
    named with where each came from, the run left as it was); an empty training split (no config.json left behind);
    --online data prepared with another tokenizer."""
    import shutil

    from helpers.refusals import refused

    store, run, opts = tmp_path / "store", tmp_path / "run", {}
    if case in ("truncated shard", "flipped byte"):
        shutil.copytree(assets["store"], store)
        f = _damage(store, "truncate" if case == "truncated shard" else "flip")
        expect = [str(f), "truncated or replaced" if case == "truncated shard" else "sha256 differs"]
    elif case == "empty store":
        store.mkdir()
        m = json.loads((assets["store"] / "manifest.json").read_text())
        (store / "manifest.json").write_text(json.dumps({**m, "shards": []}))
        expect = [f"{store}: the store holds no sample"]
    elif case == "missing target":
        store, opts["target"] = assets["store"], tmp_path / "nope"
        expect = [f"{tmp_path / 'nope'}: --target: does not exist"]
    elif case == "resume with another store":
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train(_cfg(assets, run, steps=1, eval_frac=0.0, tensorboard=False))
        _other_vocab_store(assets, store)
        opts = {"resume": True, "steps": 2, "eval_frac": 0.0}
        expect = ["step_00000001/drafter.safetensors: d2t/t2d: the run was trained on a draft vocabulary map of 96 ids",
                  f"from {assets['store']}", "this resume resolves another one of 96 ids", f"from {store}"]
    elif case == "empty training split":
        store, opts["eval_frac"] = assets["store"], 0.9999999
        expect = ["train: the training split is empty: 28 sample(s)", "--eval-frac 0.9999999"]
    else:  # --online's samples (or a vocab map's source) prepared with another tokenizer
        from hstap.data.prepare_config import PrepareConfig
        from hstap.data.prepare import prepare
        from hstap.demo.toy import build_tokenizer, sample_texts

        build_tokenizer(sample_texts()[::-1], vocab_size=300, out_dir=tmp_path / "tok")
        with contextlib.redirect_stdout(io.StringIO()):
            prepare(PrepareConfig(tokenizer=str(tmp_path / "tok"), data=[str(assets["target"].parent / "chats.jsonl")],
                                  out=str(tmp_path / "prepared"), draft_vocab=96))
        store, opts = assets["store"], {"online": True, "data": tmp_path / "prepared", "aux_layers": "1,3,4"}
        expect = [f"{tmp_path / 'prepared'}/meta.json:1: tokenizer_sha256", str(assets["target"])]
    refused(["train", *_argv(assets, run, **{"steps": 1, "store": store} | opts)], capsys, *expect,
            untouched=[run, store])
