"""`hstap train`: train an EAGLE-3 drafter with training-time test on stored hidden states or on a live target.

    hstap train --store STORE --target MODEL_DIR --out RUN --steps 2000
    torchrun --nproc-per-node 8 -m hstap.cli train --store STORE --target MODEL_DIR --out RUN --epochs 2 [--fsdp]
    hstap train --online --data PREPARED --target MODEL_DIR --out RUN --steps 2000      # no disk: target in-process
    hstap train --store STORE --target MODEL_DIR --out RUN --aux-layers final --ttt 1   # EAGLE-1-style baseline
    hstap train --store STORE --target MODEL_DIR --out RUN --resume                     # after a crash / kill -9
    hstap train --store STORE --target MODEL_DIR --out RUN --vocab-map PREPARED --eval-frac 0 \
        --follow --consume --keep-shards 4                                            # while capture writes STORE

Objective (`hstap.train.ttt`): step k of --ttt at position t feeds x[t+1+k] and the step k-1 output, and predicts x[t+2+k]
against the target's distribution at t+1+k over the draft vocabulary (the frozen target lm_head, read from the target
directory's safetensors, applied to the stored `final` state). Counted: loss_mask[t+2+k] == 1, t+2+k < length, target
argmax in the draft vocabulary. loss = sum_k 0.6^k mean_k(0.5 soft CE + 0.5 CE against the target argmax) (--ttt-decay;
--loss: soft CE alone, TV, reverse KL, HASS's top-10, mixes, LK). --draft-layers N > 1 stacks N-1 plain Llama layers.

Exact global mean. An optimizer step covers world x --grad-accum micro-batches. Every micro-batch's target distribution
is computed first; the counted positions N_k are summed over micro-batches and all-reduced; each micro-batch then
backpropagates world * sum_k 0.6^k sum(L_k) / N_k (DDP/FSDP average gradients over ranks; the factor undoes that). So 2
ranks x 1 micro-batch and 1 rank x 2 micro-batches give the same loss and gradients up to float summation order. Cost:
the target distributions ((rows, Vd) in the compute dtype) of --grad-accum micro-batches are held at once.

Init: embedding copied from the target and frozen; lm_head = the target lm_head's rows of the draft vocabulary (the
drafter starts out predicting what the target head would say on its state: faster early convergence; --no-init-lm-head
for random); the rest PyTorch's default init under --seed. AdamW (0.9, 0.95), eps 1e-8; linear warmup over
--warmup-ratio, then cosine to --min-lr-ratio * lr (default 0.1; SpecForge/EAGLE: 0); clipping at --grad-clip. CUDA:
fp32 master weights, bf16 autocast, bf16 target head, flex_attention with the exact TTT block mask. CPU: fp32, SDPA with
the exact mask. The run log names the TTT attention kernel and why (`hstap.train.ttt.ttt_attention`: from the device and the
head width, never the batches); if compiling flex_attention fails for a batch, that rank says so in one line and goes
on with the exact SDPA path.

Metrics (RUN/metrics.jsonl, a JSON object per line; TensorBoard in RUN/tb when installed). Train lines: step, epoch,
loss, loss_k, acc (acc_k = counted positions whose draft argmax is the target argmax / counted positions), lr,
grad_norm, tokens, tok_s (real tokens/s, all ranks), mfu (`hstap.train.ttt.ttt_flops` / time / (--peak-tflops * world)),
peak_mem_gb (CUDA). Eval lines ("eval": true), on the eval split: eval_loss, eval_acc, acc_cond, sim_chain_tau, sim_tau.
tau means one thing everywhere (training, `hstap eval`, the demo): tokens per target forward, the bonus token
included (SGLang's accept length); 1.0 = no draft ever accepted. sim_chain_tau[k-1] = the tau of greedy chain decoding
with k drafts replayed round by round on the eval answers (`hstap.train.ttt.replay_chain`: rounds start after a rejection,
so on the target's own outputs it predicts the measured tau); sim_tau = sim_chain_tau[K-1], the chain of K = --ttt
drafts. acc_cond_k = P(step k right | steps 0..k-1 right) over the positions t where loss_mask[t+2+k] == 1 and
t+2+k < length for every step k (a target argmax outside the draft vocabulary is a miss: the drafter cannot propose
it). RUN/best follows the highest sim_tau. RUN/curves.png plots loss, accuracy and sim_tau from metrics.jsonl (rank 0,
after every evaluation and at the end).

Checkpoints: RUN/checkpoints/step_{step:08d}/ = drafter.safetensors + drafter.json (hstap.artifacts.drafter_dir.save_drafter:
without the target's frozen embedding, which drafter.json records and loading takes from the target),
optimizer.safetensors (AdamW state of the trainable parameters as `state.{param_idx}.{exp_avg,exp_avg_sq,step}`;
names in trainer_state.json),
rng.safetensors (rank 0's torch CPU/CUDA RNG; rng_rank{r}.safetensors for the others, their python/numpy state in the
metadata) and trainer_state.json (step, data position, schedule, best_sim_tau and its tau_definition, rank 0's
python/numpy RNG). Built in a hidden temp dir,
renamed into place; the newest --keep are kept. --resume restores weights, optimizer, schedule, data position (epoch +
batches consumed) and RNG: a run killed with kill -9 and resumed logs the uninterrupted run's losses (bitwise on CPU
fp32, tests/train/test_train.py). All ranks must see RUN (shared filesystem).

Following a growing store (--follow): train on each shard as soon as it is committed (by any writer rank), wait when
caught up, end at --steps or once every writer closed the store and every sample was used --epochs times; with
--consume --keep-shards N, delete each shard once its last use is trained and checkpointed, the store's writers keeping
to N shard files. The order (canonical, not the order of arrival: a resumed run reproduces an uninterrupted one,
bitwise on CPU fp32), slots and epochs, replay, consumption, exactly-once resume and the per-step sample-id log
RUN/follow.jsonl are specified in `hstap.train.follow`'s docstring; the store side (writer ranks and the end of writing,
consumer.json, the writers' back-pressure) in hstap/store/format.py. Without --steps the learning rate is constant.

Layout: `hstap.train.config` holds the stage's config (`TrainConfig` and its sections: `hyper`, `inputs`, `drafter`,
`devices`, `stream`, each handed to what reads it); this module its entry and the loop; `hstap.train.inputs` resolves what a run needs (run directory and resume point, target head,
vocab map, store and its checks: sizes, pre-flight, checksums; layers) once, into a frozen plan
(`hstap.train.plan.TrainPlan`, RUN/plan.json beside the config as parsed in RUN/config.json), before anything is
written (a refused run, or a --resume whose checkpoint does not fit, leaves RUN as it was);
`hstap.train.data` the sources, layers, split and batches; `hstap.train.trainer` the drafter's init, wrapping,
optimizer, schedule, step and evaluation; `hstap.train.checkpoint` the checkpoint files.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hstap import dist as D
from hstap.batching import TrainBatches
from hstap.common import HstapError, atomic_write_json, write_run_config
from hstap.device import auto_dtype
from hstap.train import checkpoint
from hstap.train.config import TrainConfig
from hstap.train.data import Feed, TrainData
from hstap.train.follow import FollowBatches
from hstap.train.side import SideCollate
from hstap.train.inputs import resolve
from hstap.train.plan import TrainPlan
from hstap.train.log import CURVES, MetricsLog, Throughput, draw_curves, print_summary, train_line
from hstap.train.trainer import Schedule, Trainer, init_drafter
from hstap.train.ttt import ttt_attention

STATE_FORMAT = "hstap-trainer-state"
TAU_DEFINITION = 2  # trainer_state.json: sim_tau = tokens per target forward, bonus token included (1: without it)


def train(cfg: TrainConfig) -> dict:
    """Train a drafter (see the module docstring); returns the summary figures (also printed)."""
    rank, world, _, dev = D.init_dist(cfg.devices.device)
    try:
        return _run(cfg, rank, world, dev)
    finally:
        D.destroy()


@dataclass
class TrainState:
    """What the loop carries from step to step; a checkpoint records step, best and tokens_seen."""

    step: int = 0
    """Optimizer steps done."""
    best: float = -1.0
    """Highest eval sim_tau so far (tokens per target forward; -1: none yet)."""
    tokens_seen: int = 0
    """Real tokens trained on, all ranks, as of the last metrics line."""
    last: dict = field(default_factory=dict)
    """The latest train metrics line."""
    ev_last: dict = field(default_factory=dict)
    """The latest eval metrics line."""
    logged: int = -1
    """The step of the latest metrics line written."""
    saved: int = -1
    """The step of the latest checkpoint written."""
    raw: tuple | None = None
    """(step, epoch, stats, lr, grad norm) of the latest step, on the device until a metrics line reads them."""


@dataclass
class _Run:
    """The built pieces of one run on this rank."""

    cfg: TrainConfig
    run: Path
    rank: int
    world: int
    dev: torch.device
    data: TrainData
    feed: Feed
    trainer: Trainer
    batches: TrainBatches | FollowBatches
    """Offline: epochs over the training split; --follow: the follow stream."""
    schedule: Schedule
    run_config: dict
    """trainer_state.json's "config": {"world_size": world, **the TrainConfig's flags, as parsed}."""
    plan: TrainPlan
    """What the run resolved (`hstap.train.inputs.resolve`): ce chunk, vocab map, layers, resume point."""


def _run(cfg: TrainConfig, rank: int, world: int, dev: torch.device) -> dict:
    r, st = _build(cfg, rank, world, dev)
    t0, tokens0 = time.perf_counter(), st.tokens_seen  # this process's share (a resume restores tokens_seen)
    _loop(r, st)
    if cfg.follow:
        r.batches.finish()  # a normal end: the store's writers no longer wait for this trainer
    c = checkpoint.complete(r.run)
    summary = {"run": str(r.run), "steps": st.step, "loss": st.last.get("loss"), "acc": st.last.get("acc"),
               "tok_s": st.last.get("tok_s"), "mfu": st.last.get("mfu"), "sim_tau": st.ev_last.get("sim_tau"),
               "best_sim_tau": st.best if st.best >= 0 else None, "peak_mem_gb": st.last.get("peak_mem_gb"),
               "checkpoint": str(c[-1]) if c else None, "tokens": st.tokens_seen,
               "tokens_this_run": st.tokens_seen - tokens0, "seconds": time.perf_counter() - t0, "ttt": cfg.hyper.ttt,
               "eval_samples": len(r.data.eval_rows),
               "curves": str(r.run / CURVES) if rank == 0 and (r.run / CURVES).is_file() else None}
    if rank == 0:
        print_summary(summary)
    return summary


def _open_run(cfg: TrainConfig, plan: TrainPlan, run: Path, rank: int) -> None:
    """RUN ready to write, once the inputs are validated (a run that fails on bad input leaves no RUN/config.json):
    created, a crashed save undone, config.json (the config as parsed) and plan.json (what the run resolved)
    written."""
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        checkpoint.recover(run)
        write_run_config(run, "train", cfg)
        atomic_write_json(run / "plan.json", plan.record())
    D.barrier()


def _build(cfg: TrainConfig, rank: int, world: int, dev: torch.device) -> tuple[_Run, TrainState]:
    """Data, drafter, trainer and batch stream of this rank from the resolved inputs (`hstap.train.inputs.resolve`),
    restored from RUN's newest checkpoint with --resume."""
    run, cuda = Path(cfg.out), dev.type == "cuda"
    bf16 = auto_dtype(cfg.devices.dtype, dev) == "bf16"
    if bf16 and not cuda:
        raise HstapError("train: --dtype bf16 needs CUDA (CPU training is fp32)")
    inp = resolve(cfg, rank, world, dev, bf16)
    release = inp.release  # the store's claim undone if the run is refused before RUN is written
    try:
        plan, data, state, run_config = inp.plan, inp.data, inp.state, inp.run_config
        ckpt = plan.resume
        drafter = init_drafter(inp.hf_cfg, plan.vocab, list(plan.layers), inp.embed, inp.head, seed=cfg.seed,
                               draft_layers=cfg.drafter.draft_layers, init_lm_head=cfg.drafter.init_lm_head)
        attn, why = ttt_attention(cfg.devices.attn, dev.type, drafter.config.head_dim)
        feed = Feed(data, inp.head, dev, torch.bfloat16 if bf16 else torch.float32, plan.ce_chunk, cfg.hyper.ttt,
                    pad_to=16 if cuda else 1)  # CUDA: T in steps of 16 bounds the TTT masks and compiled shapes
        del inp  # the target's embedding and head: the drafter and the feed hold what they need
        # A resume loads the weights before wrapping and the optimizer and RNG after, and the batch stream checks
        # its position; all before RUN is written: a checkpoint that does not fit leaves the run and store as they were.
        if ckpt:
            checkpoint.load_weights(ckpt, drafter)
        elif cfg.drafter.init_from:
            checkpoint.load_init(Path(cfg.drafter.init_from), drafter)
        drafter.to(dev)
        trainer = Trainer(cfg.hyper, cfg.devices, drafter, world, dev, attn, bf16, plan.ce_chunk)
        # best_sim_tau of a run saved before tau included the bonus token (no "tau_definition") is not comparable
        best = state.get("best_sim_tau", -1.0) if state.get("tau_definition") == TAU_DEFINITION else -1.0
        st = TrainState(step=state.get("step", 0), best=best, tokens_seen=state.get("tokens_seen", 0))
        if ckpt:
            trainer.load_rest(ckpt, state, rank)
        batches, total, outline = _batches(cfg, data, run, rank, world, dev, state if ckpt else None)
        _open_run(cfg, plan, run, rank)
    except BaseException:
        release()
        raise
    if rank == 0 and (ckpt or cfg.follow):  # follow: also a restart before the first checkpoint starts clean
        checkpoint.truncate_metrics(run / "metrics.jsonl", st.step)
        if cfg.follow:
            checkpoint.truncate_metrics(run / "follow.jsonl", st.step)
    if cfg.follow:
        batches.start()
    D.print0(f"hstap train: {outline}, world {world}{' fsdp' if trainer.fsdp else ''}, "
             f"{dev.type} {'bf16' if bf16 else 'fp32'}{' compiled' if cfg.devices.compile and cuda else ''}, "
             f"attn {attn}, ttt {cfg.hyper.ttt}, draft vocab {plan.vocab.size}, ce chunk {plan.ce_chunk}, "
             f"aux layers {list(plan.layers) or 'final'}"
             + (f", resumed from {ckpt.name}" if ckpt else ""))
    D.print0(f"hstap train: TTT attention {attn}: {why}")
    hp = cfg.hyper
    schedule = Schedule(hp.lr, hp.warmup_ratio, hp.min_lr_ratio, total)
    return _Run(cfg, run, rank, world, dev, data, feed, trainer, batches, schedule, run_config, plan), st


def _batches(cfg: TrainConfig, data, run: Path, rank: int, world: int, dev: torch.device, state: dict | None):
    """(this rank's batch stream, its total steps, the outline line's figures): the follow stream of --follow (its
    position restored from `state`, a resume's, and checked), else the store's shuffled epochs."""
    cuda, hp, sp = dev.type == "cuda", cfg.hyper, cfg.stream
    workers = cfg.devices.workers if cfg.devices.workers >= 0 else (4 if cuda else 0)
    state = state or None
    if cfg.follow:
        batches = FollowBatches(sp, hp, cfg.inputs.store, cfg.consume, cfg.seed, run, rank, world, dev, state, cuda,
                                workers)
        outline = (f"following {cfg.inputs.store} ({batches.ranks} writer rank(s)), {hp.epochs or 1} epoch(s), "
                   f"{f'{hp.steps} steps' if hp.steps else 'until writing ends'}")
        if sp.holdout_frac:
            outline += f", {sp.holdout_frac} of the ids held back"
        if sp.anchor_store:
            outline += f", {sp.anchor_fraction} of each slot from {sp.anchor_store}"
        return batches, hp.steps, outline
    state = state or {}
    batches = TrainBatches(data.train_rows, data.train_lengths, hp.batch_tokens, cfg.seed, rank, world,
                           state.get("epoch", 0), state.get("batches_done", 0), cuda, workers,
                           SideCollate(hp.side_branches, hp.side_context))
    per_epoch = math.ceil(len(batches.sampler) / hp.grad_accum)
    total = hp.steps or (hp.epochs or 1) * per_epoch
    return batches, total, (f"{len(data.train_rows)} train / {len(data.eval_rows)} eval samples, {per_epoch} "
                            f"steps/epoch, {total} steps")


def _loop(r: _Run, st: TrainState) -> None:
    """Optimizer steps until the schedule's total (--follow: or the stream's end): metrics lines, evaluations and
    checkpoints on the way."""
    cfg, hp, cuda, total, tr = r.cfg, r.cfg.hyper, r.dev.type == "cuda", r.schedule.total, r.trainer
    fol = r.batches if cfg.follow else None  # waits for shards; its stream may end before any total
    eval_every = hp.eval_every or hp.save_every
    log = MetricsLog(r.run, r.rank, cfg.tensorboard)
    from tqdm import tqdm
    bar = tqdm(total=total, initial=st.step, disable=r.rank != 0, desc="train", dynamic_ncols=True, file=sys.stderr)
    it = iter(r.batches)
    meter = Throughput(tr.drafter.config, hp.ttt, tr.model.attn != "causal", cfg.devices.peak_tflops * 1e12 * r.world)
    if cuda:
        torch.cuda.reset_peak_memory_stats(r.dev)
    tr.wrapped.train()
    pos = None
    while total is None or st.step < total:
        if fol is not None and not fol.wait(lambda: _save(r, st, pos, False)):
            if st.raw is not None:  # the stream ended: the end's metrics line, evaluation and checkpoint, if not done
                _after_step(r, st, log, meter, bar, pos, eval_every, last=True)
            break
        micro = [r.feed(next(it)) for _ in range(hp.grad_accum)]  # targets of the whole step first: exact N_k
        pos = (r.batches.epoch, r.batches.done) if fol is None else None
        lr = r.schedule.lr_at(st.step)
        stats, gn = tr.step(micro, lr)
        meter.add(micro)
        del micro
        st.step += 1
        if fol is not None:
            fol.step_done(st.step)
        epoch = fol.epochs_done() if fol is not None else pos[0] + pos[1] / len(r.batches.sampler)
        st.raw = (st.step, epoch, stats, lr, gn)  # read (a host sync) only when a metrics line is due
        bar.update(1)
        if st.step % hp.log_every == 0 or st.step == total:
            _read_line(st, hp.ttt_decay)
            bar.set_postfix(loss=f"{st.last['loss']:.3f}", acc0=f"{st.last['acc'][0]:.3f}",
                            **(fol.progress() if fol is not None else {}), refresh=False)
        _after_step(r, st, log, meter, bar, pos, eval_every, last=st.step == total)
    bar.close()
    log.close()
    if r.rank == 0:
        draw_curves(r.run)


def _after_step(r: _Run, st: TrainState, log: MetricsLog, meter: Throughput, bar, pos: tuple[int, int] | None,
                eval_every: int, last: bool) -> None:
    """The metrics line, evaluation and checkpoint of step st.step where due (all three when `last`), each once."""
    hp, tr = r.cfg.hyper, r.trainer
    if (st.step % hp.log_every == 0 or last) and st.logged != st.step:
        _read_line(st, hp.ttt_decay)
        tokens, tok_s, mfu = meter.window(r.dev)
        st.tokens_seen += tokens
        st.last |= {"tokens": st.tokens_seen, "tok_s": tok_s, "mfu": mfu}
        if r.dev.type == "cuda":
            st.last["peak_mem_gb"] = torch.cuda.max_memory_allocated(r.dev) / 1e9
        log(st.last)
        meter.reset()
        st.logged = st.step
    if r.data.eval_batches and (st.step % eval_every == 0 or last) and st.ev_last.get("step") != st.step:
        st.ev_last = tr.evaluate(r.feed, r.data, st.step)
        log(st.ev_last)
        if r.rank == 0:
            bar.write(f"step {st.step}: sim tau {st.ev_last['sim_tau']:.3f} (tokens per target forward, chain of "
                      f"{hp.ttt} drafts replayed on the eval split), eval loss {st.ev_last['eval_loss']:.3f}, "
                      f"acc_cond " + " ".join(f"{a:.2f}" for a in st.ev_last["acc_cond"]))
    is_best = bool(st.ev_last) and st.ev_last["step"] == st.step and st.ev_last["sim_tau"] > st.best
    st.best = st.ev_last["sim_tau"] if is_best else st.best
    if (st.step % hp.save_every == 0 or last or is_best) and (st.saved != st.step or is_best):
        _save(r, st, pos, is_best)
    if r.rank == 0 and st.ev_last.get("step") == st.step and not last:  # the end draws it once, after the loop
        draw_curves(r.run)


def _read_line(st: TrainState, decay: float) -> None:
    """st.last = the train metrics line of the latest step (st.raw), once per step."""
    if st.raw is not None and st.last.get("step") != st.raw[0]:
        step, epoch, stats, lr, gn = st.raw
        st.last = train_line(step, epoch, stats, decay, lr, gn)


def _save(r: _Run, st: TrainState, pos: tuple[int, int] | None, is_best: bool) -> None:
    """Checkpoint after st.step steps; pos = (epoch, batches done) of the data after them (--follow: the stream's
    position, which then consumes the shards whose last use the checkpoint covers)."""
    if r.cfg.follow:
        where = r.batches.state()
    else:
        ep, dn = pos if pos[1] < len(r.batches.sampler) else (pos[0] + 1, 0)
        where = {"epoch": ep, "batches_done": dn}
    tstate = {"format": STATE_FORMAT, "version": 1, "step": st.step, **where,
              "total_steps": r.schedule.total, "best_sim_tau": st.best, "tau_definition": TAU_DEFINITION,
              "tokens_seen": st.tokens_seen, "scheduler": r.schedule.state(st.step), "param_names": r.trainer.names,
              "config": r.run_config}
    tr = r.trainer
    checkpoint.save(r.run, st.step, tr.drafter, tr.params, tr.opt, tstate, r.data.meta, r.cfg.hyper.keep, r.rank,
                    tr.fsdp, is_best)
    st.saved = st.step
    if r.cfg.follow:
        r.batches.committed(st.step)
