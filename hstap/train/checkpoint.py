"""Training checkpoints: RUN/checkpoints/step_{step:08d}/ written atomically, RUN/best, rotation, resume.

The layout (drafter, optimizer.safetensors, rng*.safetensors, trainer_state.json) is described in `hstap.train.stage`'s
module docstring. Every rank calls `save`; rank 0 writes all but the other ranks' RNG. No pickle: safetensors + JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from hstap import dist as D
from hstap.common import HstapError, atomic_write_bytes, atomic_write_json, publish_dir
from hstap.models.drafter import Eagle3Drafter
from hstap.artifacts.vocab_map import VocabMap

RESUME_KEYS = ("world_size", "grad_accum", "batch_tokens", "seed", "ttt", "eval_frac", "lr", "warmup_ratio",
               "min_lr_ratio", "ttt_decay", "loss", "loss_mix", "lk_decay")
"""Run settings a resume must repeat: they decide the data order, the global batch, the model's shape, the learning
rate schedule and the objective (train's defaults of the schedule and the objective have changed: a run started under
earlier defaults resumes only with its own values)."""

BEFORE_KEY = {"ttt_decay": 0.8, "loss": "ce", "loss_mix": 0.5, "lk_decay": 3.0}
"""What a checkpoint written before a RESUME_KEYS setting existed was trained with."""


def complete(run: Path) -> list[Path]:
    """RUN's complete checkpoint directories (those with trainer_state.json), oldest first."""
    d = run / "checkpoints"
    return sorted(c for c in d.glob("step_*") if (c / "trainer_state.json").is_file()) if d.is_dir() else []


def save(run: Path, step: int, drafter: Eagle3Drafter, params: list, opt, state: dict, extra: dict, keep: int,
         rank: int, fsdp: bool, best: bool) -> None:
    """Write RUN/checkpoints/step_{step:08d}/ atomically (every rank calls this; rank 0 writes all but peers' RNG)."""
    sd = D.full_state_dict(drafter) if fsdp else None  # collectives under FSDP: every rank, same order
    flat = {f"state.{i}.{k}": D.full_tensor(v).detach().to("cpu").contiguous()
            for i, p in enumerate(params) for k, v in opt.state.get(p, {}).items()}
    final = run / "checkpoints" / f"step_{step:08d}"
    tmp = run / "checkpoints" / f".tmp_step_{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    D.barrier()
    rt, rjs = D.rng_state()
    if rank > 0:
        save_file(rt, str(tmp / f"rng_rank{rank}.safetensors"), metadata={"json": json.dumps(rjs)})
    D.barrier()
    if rank == 0:
        if fsdp:
            drafter = Eagle3Drafter(drafter.config)
            drafter.load_state_dict(sd, strict=False)
        from hstap.artifacts.drafter_dir import save_drafter
        save_drafter(tmp, drafter, extra)
        save_file(flat, str(tmp / "optimizer.safetensors"))
        save_file(rt, str(tmp / "rng.safetensors"))
        atomic_write_json(tmp / "trainer_state.json", {**state, "rng": rjs})
        publish_dir(tmp, final, "remove")  # the commit point: a step_* directory is complete or absent
        for old in complete(run)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        if best:
            _replace_best(final, run)
    D.barrier()


def _replace_best(src: Path, run: Path) -> None:
    """RUN/best := a copy of src (no optimizer/RNG), by renames: best is missing only between two renames, and
    `recover` puts .best.old back if a crash lands there."""
    tmp = run / ".best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("optimizer.safetensors", "rng*.safetensors"))
    publish_dir(tmp, run / "best", "aside", aside=run / ".best.old")


def recover(run: Path) -> None:
    """Undo what a crash during `save` left: RUN/best put back from .best.old, temp dirs removed."""
    if not (run / "best").exists() and (run / ".best.old").exists():
        os.rename(run / ".best.old", run / "best")
    shutil.rmtree(run / ".best.tmp", ignore_errors=True)
    for t in (run / "checkpoints").glob(".tmp_step_*") if (run / "checkpoints").is_dir() else []:
        shutil.rmtree(t, ignore_errors=True)


def read_state(ckpt: Path, config: dict) -> dict:
    """trainer_state.json of ckpt, once its RESUME_KEYS are checked against this run's.

    config: this run's trainer_state "config" ({"world_size": W, **the TrainConfig fields, as parsed})."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    for k in RESUME_KEYS:
        was = state["config"].get(k, BEFORE_KEY.get(k)) if k in BEFORE_KEY else state["config"][k]
        if was != config[k]:
            flag = "the number of ranks" if k == "world_size" else "--" + k.replace("_", "-")
            raise HstapError(f"{ckpt}/trainer_state.json: {k} was {was}; resume with the same value ({flag})")
    return state


def check_vocab_map(ckpt: Path, vocab: VocabMap) -> None:
    """The draft vocabulary map a resume resolved must be the one ckpt was trained with: its lm_head rows are those
    ids. Compared by `vocab_map_sha256`, before anything of the run is written."""
    from safetensors import safe_open

    from hstap.artifacts.vocab_map import vocab_map_sha256

    f = ckpt / "drafter.safetensors"
    with safe_open(str(f), framework="pt") as h:
        old_d2t, old_t2d = h.get_tensor("d2t"), h.get_tensor("t2d")
    old, new = vocab_map_sha256(old_d2t, old_t2d), vocab.sha256()
    if old == new:
        return
    try:
        meta = json.loads((ckpt / "drafter.json").read_text())
        was = meta.get("vocab_map_source") or (meta.get("store") or {}).get("path")
    except (OSError, ValueError, AttributeError):
        was = None
    raise HstapError(f"{f}: d2t/t2d: the run was trained on a draft vocabulary map of {old_d2t.numel()} ids (sha256 "
                     f"{old[:12]}{f', from {was}' if was else ''}), this resume resolves another one of {vocab.size} "
                     f"ids (sha256 {new[:12]}, from {vocab.source}); resume with the run's own --store, --vocab-map and "
                     f"--draft-vocab")


def load_weights(ckpt: Path, drafter: Eagle3Drafter) -> None:
    """ckpt's weights into the unwrapped drafter, which already holds this run's vocab map (it must be the one the
    checkpoint was trained with) and the target's embedding (a checkpoint keeps it out: it must be the one it was
    trained with)."""
    from hstap.artifacts.drafter_dir import EMBEDDING, check_embedding, kept_out

    check_vocab_map(ckpt, VocabMap(drafter.d2t, drafter.t2d, "this run"))
    weights = load_file(str(ckpt / "drafter.safetensors"))
    rec = kept_out(json.loads((ckpt / "drafter.json").read_text()))
    if rec is not None and EMBEDDING not in weights:  # the target's, which the drafter holds already (its init)
        check_embedding(ckpt, rec, drafter.embed_tokens.weight)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if [k for k in missing if not k.startswith("rotary.") and not (rec is not None and k == EMBEDDING)] or unexpected:
        raise HstapError(f"{ckpt}/drafter.safetensors: does not fit this drafter ({missing} / {unexpected})")


def load_init(path: Path, drafter: Eagle3Drafter) -> None:
    """--init-from: the weights of the hstap drafter directory `path`, whose config must equal this run's drafter's."""
    try:
        theirs = json.loads((path / "drafter.json").read_text()).get("config") or {}
    except (OSError, ValueError) as e:
        raise HstapError(f"{path / 'drafter.json'}: --init-from: cannot read: {e}") from None
    mine = json.loads(json.dumps(drafter.config.to_dict()))
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if diff:
        raise HstapError(f"{path / 'drafter.json'}: --init-from: its drafter differs from this run's in {diff} "
                         f"({', '.join(f'{k}={theirs.get(k)!r}, here {mine.get(k)!r}' for k in diff[:3])})")
    load_weights(path, drafter)


def load_rest(ckpt: Path, state: dict, rank: int, params: list, opt) -> None:
    """Optimizer (resharded like the parameters under FSDP) and this rank's RNG."""
    flat = load_file(str(ckpt / "optimizer.safetensors"))
    st = {i: {k.split(".")[2]: (v if k.endswith(".step") else D.like(v, p)) for k, v in flat.items()
              if k.startswith(f"state.{i}.")} for i, p in enumerate(params)}
    opt.load_state_dict({"state": {i: s for i, s in st.items() if s}, "param_groups": opt.state_dict()["param_groups"]})
    name = "rng.safetensors" if rank == 0 else f"rng_rank{rank}.safetensors"
    from safetensors import safe_open
    with safe_open(str(ckpt / name), framework="pt") as h:
        js = state["rng"] if rank == 0 else json.loads(h.metadata()["json"])
    D.set_rng_state(load_file(str(ckpt / name)), js)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics lines written after the checkpoint we resume from (and a torn last line)."""
    if path.is_file():
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                pass
        atomic_write_bytes(path, "".join(x + "\n" for x in keep).encode())
