"""`hstap train`: train an EAGLE-3 drafter with training-time test on stored hidden states or on a live target.

    hstap train --store STORE --target MODEL_DIR --out RUN --steps 2000
    torchrun --nproc-per-node 8 -m hstap.cli train --store STORE --target MODEL_DIR --out RUN --epochs 2 [--fsdp]
    hstap train --online --data PREPARED --target MODEL_DIR --out RUN --steps 2000      # no disk: target in-process
    hstap train --store STORE --target MODEL_DIR --out RUN --aux-layers final --ttt 1   # EAGLE-1-style baseline
    hstap train --store STORE --target MODEL_DIR --out RUN --resume                     # after a crash / kill -9

Objective (`hstap.drafter`): step k of --ttt at position t feeds x[t+1+k] and the step k-1 output, and predicts x[t+2+k]
against the target's distribution at t+1+k over the draft vocabulary (the frozen target lm_head, read from the target
directory's safetensors, applied to the stored `final` state). Counted: loss_mask[t+2+k] == 1, t+2+k < length, target
argmax in the draft vocabulary. loss = sum_k 0.8^k mean_k(soft CE).

Exact global mean. An optimizer step covers world x --grad-accum micro-batches. Every micro-batch's target distribution
is computed first; the counted positions N_k are summed over micro-batches and all-reduced; each micro-batch then
backpropagates world * sum_k 0.8^k sum(CE_k) / N_k (DDP/FSDP average gradients over ranks; the factor undoes that). So 2
ranks x 1 micro-batch and 1 rank x 2 micro-batches give the same loss and gradients up to float summation order. Cost:
the target distributions ((rows, Vd) in the compute dtype) of --grad-accum micro-batches are held at once.

Init: embedding copied from the target and frozen; lm_head = the target lm_head's rows of the draft vocabulary (the
drafter starts out predicting what the target head would say on its state: faster early convergence; --no-init-lm-head
for random); the rest PyTorch's default init under --seed. AdamW (0.9, 0.95), eps 1e-8; linear warmup over
--warmup-ratio, then cosine to --min-lr-ratio * lr (default 0, as SpecForge/EAGLE); clipping at --grad-clip. CUDA:
fp32 master weights, bf16 autocast, bf16 target head, flex_attention with the exact TTT block mask. CPU: fp32, SDPA with
the exact mask.

Metrics (RUN/metrics.jsonl, a JSON object per line; TensorBoard in RUN/tb when installed). Train lines: step, epoch,
loss, loss_k, acc (acc_k = counted positions whose draft argmax is the target argmax / counted positions), lr,
grad_norm, tokens, tok_s (real tokens/s, all ranks), mfu (`hstap.drafter.ttt_flops` / time / (--peak-tflops * world)),
peak_mem_gb (CUDA). Eval lines ("eval": true), on the eval split: eval_loss, eval_acc, acc_cond, sim_tau. A position
t is simulated when loss_mask[t+2+k] == 1 and t+2+k < length for every step k (a target argmax outside the draft
vocabulary is a miss there: the drafter cannot propose it); acc_cond_k = P(step k right | steps 0..k-1 right) over
those positions; sim_tau = sum_k prod_{i<=k} acc_cond_i, the expected accepted draft tokens of a greedy K-token chain
under teacher forcing (SGLang's acceptance length adds 1 for the bonus token); sim_chain_tau[k-1] = the tau of greedy
chain decoding with k drafts replayed round by round on the eval answers (`hstap.drafter.replay_chain`; rounds start
after a rejection, so on the target's own outputs it predicts the measured tau, which the mean over positions
overestimates). RUN/best follows the highest sim_tau.

Checkpoints: RUN/checkpoints/step_{step:08d}/ = drafter.safetensors + drafter.json (hstap.export.save_drafter),
optimizer.safetensors (AdamW state as `state.{param_idx}.{exp_avg,exp_avg_sq,step}`; names in trainer_state.json),
rng.safetensors (rank 0's torch CPU/CUDA RNG; rng_rank{r}.safetensors for the others, their python/numpy state in the
metadata) and trainer_state.json (step, data position, schedule, rank 0's python/numpy RNG). Built in a hidden temp dir,
renamed into place; the newest --keep are kept. --resume restores weights, optimizer, schedule, data position (epoch +
batches consumed) and RNG: a run killed with kill -9 and resumed logs the uninterrupted run's losses (bitwise on CPU
fp32, tests/test_train.py). All ranks must see RUN (shared filesystem).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hstap import checkpoint
from hstap import dist as D
from hstap.batching import Rows, TrainBatches, collate, eval_batches
from hstap.common import HstapError, sha256_bytes, write_run_config
from hstap.drafter import DrafterConfig, Eagle3Drafter, TTTModel, replay_chain, step_rows, target_distribution, \
    ttt_flops
from hstap.model_dir import load_config, target_head

STATE_FORMAT = "hstap-trainer-state"


@dataclass
class TrainConfig:
    out: str
    """Run directory (config.json, metrics.jsonl, checkpoints/, best/)."""
    target: str
    """Target model directory (HF format): its config shapes the drafter; its embedding and lm_head are read from it."""
    store: str | None = None
    """Hidden-state store (hstap capture output) to train on (offline mode)."""
    data: str | None = None
    """Prepared set (hstap prepare output): the samples in --online mode; otherwise only the source of the vocab map."""
    online: bool = False
    """Run the target in-process on --data batches (no store, no disk) and train on its states."""
    vocab_map: str | None = None
    """vocab_map.safetensors (or a prepared dir) with d2t/t2d; default: --data's, else derived from the store."""
    draft_vocab: int = 32000
    """Draft vocabulary size when the map is derived from the store (top loss-masked tokens; clamped to V)."""
    aux_layers: str = ""
    """fc inputs: '' = the store's layers (online: [1, N//2-1, N-4]); 'final' = final state only (EAGLE-1-style); or a
    comma list of canonical ids (offline: a subset of the store's layers)."""
    steps: int | None = None
    """Optimizer steps to train (default: --epochs)."""
    epochs: int | None = None
    """Epochs over the training split (default 1 when --steps is not given)."""
    ttt: int = 7
    """Training-time-test steps K (1 = no TTT)."""
    ttt_decay: float = 0.8
    """Weight of TTT step k is ttt_decay**k."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor as a fraction of --lr."""
    warmup_ratio: float = 0.015
    """Linear warmup over this fraction of the steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Clip the global gradient norm to this (0 = off)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    batch_tokens: int = 16384
    """Micro-batch size: B * max_len <= batch_tokens (a longer sample goes alone)."""
    eval_store: str | None = None
    """Separate store for evaluation (offline); default: an --eval-frac split of the training samples."""
    eval_frac: float = 0.05
    """Fraction of samples held out for evaluation, chosen by a hash of the sample id (0 = no eval split)."""
    eval_every: int = 0
    """Evaluate every N steps (0 = at every checkpoint); always at the end."""
    save_every: int = 1000
    """Write a checkpoint every N steps; always at the end."""
    keep: int = 3
    """Checkpoints kept in RUN/checkpoints (the newest)."""
    log_every: int = 10
    """Write a metrics line every N steps."""
    resume: bool = False
    """Continue from RUN's newest complete checkpoint (weights, optimizer, schedule, data position, RNG); a larger
    --steps extends the run (the cosine schedule is then laid out over the new total)."""
    skip_verify: bool = False
    """Skip the pre-flight check that the store matches the target (hstap.verify.quick_check)."""
    device: str = field(default="auto", metadata={"choices": ["auto", "cpu", "cuda"]})
    """Device; under torchrun each rank takes GPU LOCAL_RANK."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "bf16", "fp32"]})
    """Compute dtype: bf16 = autocast with fp32 master weights (auto on CUDA); fp32 (auto on CPU)."""
    attn: str = field(default="auto", metadata={"choices": ["auto", "flex", "sdpa", "causal"]})
    """TTT attention: flex (auto on CUDA) and sdpa (auto on CPU) are exact; causal approximates (no TTT diagonal)."""
    compile: bool = False
    """torch.compile the midlayer's dense parts and the cross-entropy (CUDA; flex_attention is compiled anyway)."""
    fsdp: bool = False
    """Shard with FSDP2 (fully_shard) instead of DDP when running under torchrun."""
    workers: int = -1
    """DataLoader worker processes (-1 = 4 on CUDA, 0 on CPU)."""
    ce_chunk: int = 4096
    """Rows per chunk of the target head and of the fused lm_head + cross-entropy (memory vs. kernel size)."""
    init_lm_head: bool = True
    """Initialise the drafter lm_head from the target lm_head's rows of the draft vocabulary."""
    seed: int = 0
    """Seed of the drafter init and of the data order (the eval split is a hash of the sample ids)."""
    peak_tflops: float = 790.0
    """Peak bf16 TFLOP/s of one device for the MFU estimate (H200: 790)."""
    tensorboard: bool = True
    """Also log to RUN/tb when tensorboard is installed."""

    def __post_init__(self):
        w = "train"
        if self.online and not self.data:
            raise HstapError(f"{w}: --online needs --data PREPARED")
        if not self.online and not self.store:
            raise HstapError(f"{w}: --store: required (or --online --data PREPARED)")
        if self.online and self.eval_store:
            raise HstapError(f"{w}: --eval-store: offline only (online mode evaluates on an --eval-frac split)")
        if self.steps is not None and self.epochs is not None:
            raise HstapError(f"{w}: give --steps or --epochs, not both")
        for name in ("ttt", "grad_accum", "batch_tokens", "save_every", "keep", "log_every", "draft_vocab", "ce_chunk"):
            if getattr(self, name) < 1:
                raise HstapError(f"{w}: --{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "epochs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise HstapError(f"{w}: --{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.eval_frac < 1.0:
            raise HstapError(f"{w}: --eval-frac: must be in [0, 1), got {self.eval_frac}")
        if not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise HstapError(f"{w}: --warmup-ratio must be in [0, 1) and --min-lr-ratio in [0, 1]")
        if self.lr <= 0 or self.grad_clip < 0 or self.eval_every < 0:
            raise HstapError(f"{w}: --lr must be > 0, --grad-clip and --eval-every >= 0")
        for name in ("out", "target", "store", "data", "vocab_map", "eval_store"):
            if getattr(self, name):
                setattr(self, name, os.path.abspath(getattr(self, name)))


# --- data ----------------------------------------------------------------------------------------------------------
def _is_eval(sample_id: str, frac: float) -> bool:
    return frac > 0 and int(sha256_bytes(sample_id)[:8], 16) / 2 ** 32 < frac


def _store_freq(store, V: int) -> np.ndarray:
    """Counts of loss-masked tokens over every shard (reads only input_ids and loss_mask, never the hidden states)."""
    from safetensors import safe_open
    freq = np.zeros(V, dtype=np.int64)
    for e in store.manifest["shards"]:
        with safe_open(str(store.path / e["file"]), framework="pt") as h:
            ids, lm = h.get_tensor("input_ids").long(), h.get_tensor("loss_mask").bool()
        if ids.numel() and int(ids.max()) >= V:
            raise HstapError(f"{store.path / e['file']}: token id {int(ids.max())} >= the target's vocab size {V}")
        freq += np.bincount(ids[lm].numpy(), minlength=V)
    return freq


def _vocab_map(cfg: TrainConfig, store, V: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    from hstap.data import build_vocab_map, load_vocab_map
    src = cfg.vocab_map or cfg.data
    if src:
        d2t, t2d = load_vocab_map(src)
    else:
        d2t, t2d = (torch.from_numpy(a) for a in build_vocab_map(_store_freq(store, V), min(cfg.draft_vocab, V)))
        src = f"{cfg.store} (loss-masked token counts)"
    if t2d.numel() != V:
        raise HstapError(f"{src}: vocab map covers {t2d.numel()} ids, the target has {V}")
    return d2t.long(), t2d.bool(), str(src)


def _layers(cfg: TrainConfig, available: list[int] | None, num_layers: int) -> tuple[list[int], list[int] | None]:
    """(drafter aux_layers ([] = final state), indices into the store's aux (None = use `final`))."""
    from hstap.layers import default_aux_layers, parse_layers
    spec = cfg.aux_layers.strip()
    if spec == "final":
        return [], None
    if available is None:  # online
        return (default_aux_layers(num_layers) if not spec else parse_layers(spec, num_layers)), []
    if not spec:
        return list(available), list(range(len(available)))
    want = parse_layers(spec, num_layers)
    missing = [i for i in want if i not in available]
    if missing:
        raise HstapError(f"train: --aux-layers: {missing} not captured in the store (it has {available})")
    return want, [available.index(i) for i in want]


# --- metrics -------------------------------------------------------------------------------------------------------
class _Log:
    """metrics.jsonl (rank 0) and TensorBoard when installed."""

    def __init__(self, run: Path, rank: int, tensorboard: bool):
        self.f = open(run / "metrics.jsonl", "a") if rank == 0 else None
        self.tb = None
        if rank == 0 and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run / "tb"))
            except ImportError:
                pass

    def __call__(self, obj: dict) -> None:
        if self.f is not None:
            self.f.write(json.dumps(obj) + "\n")
            self.f.flush()
        if self.tb is not None:
            tag = "eval/" if obj.get("eval") else "train/"
            for k, v in obj.items():
                for i, x in (enumerate(v) if isinstance(v, list) else [(None, v)]):
                    if isinstance(x, (int, float)) and not isinstance(x, bool) and k != "step":
                        self.tb.add_scalar(tag + k + ("" if i is None else f"_{i}"), x, obj["step"])

    def close(self):
        for h in (self.f, self.tb):
            if h is not None:
                h.close()


# --- the loop ------------------------------------------------------------------------------------------------------
def _lr(cfg: TrainConfig, step: int, total: int) -> float:
    warm = math.ceil(cfg.warmup_ratio * total) if cfg.warmup_ratio > 0 else 0
    if step < warm:
        return cfg.lr * (step + 1) / warm
    prog = (step - warm) / max(1, total - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def train(cfg: TrainConfig) -> dict:
    """Train a drafter (see the module docstring); returns the summary figures (also printed)."""
    rank, world, _, dev = D.init_dist(cfg.device)
    try:
        return _run(cfg, rank, world, dev)
    finally:
        D.destroy()


def _preflight(cfg: TrainConfig, rank: int, dev: torch.device) -> None:
    """hstap.verify.quick_check on rank 0 (when verify exists); its failure stops every rank."""
    err = None
    if rank == 0 and not cfg.skip_verify:
        try:
            import hstap.verify as verify
        except ImportError:
            verify = None
        if verify is not None and hasattr(verify, "quick_check"):
            try:
                verify.quick_check(cfg.store, cfg.target, samples=2, device=dev.type)
            except HstapError as e:
                err = e
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if not D.agree(err is None):
        raise err or HstapError(f"{cfg.store}: rank 0's pre-flight check failed (see its output)")


def _run(cfg: TrainConfig, rank: int, world: int, dev: torch.device) -> dict:
    run, cuda = Path(cfg.out), dev.type == "cuda"
    bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and cuda)
    if bf16 and not cuda:
        raise HstapError("train: --dtype bf16 needs CUDA (CPU training is fp32)")
    attn = cfg.attn if cfg.attn != "auto" else ("flex" if cuda else "sdpa")
    if checkpoint.complete(run) and not cfg.resume:
        raise HstapError(f"{run}: has checkpoints already; pass --resume to continue or choose another --out")
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        checkpoint.recover(run)
        write_run_config(run, "train", cfg)
    D.barrier()

    # Sources: a store (offline), or a prepared set + the live target (online, same Target.capture as hstap capture).
    hf_cfg = load_config(cfg.target)
    V = int(hf_cfg.vocab_size)
    target = store = None
    if cfg.online:
        from hstap.data import load_prepared
        from hstap.model_dir import load_target, target_fingerprint
        src = load_prepared(cfg.data)
        ids_all, lengths_all = list(src["id"]), [len(x) for x in src["input_ids"]]
        target, _ = load_target(cfg.target, device=dev, dtype="bf16" if bf16 else "fp32")
        layers, sel = _layers(cfg, None, int(hf_cfg.num_hidden_layers))
        prov = {"target": target_fingerprint(cfg.target), "layers": layers, "engine": {"name": "hf-online"}}
    else:
        from hstap.store import open_store
        src = store = open_store(cfg.store)
        ids_all, lengths_all = list(store.ids), list(store.lengths)
        if store.hidden_size != int(hf_cfg.hidden_size):
            raise HstapError(f"{cfg.store}: hidden_size {store.hidden_size} != the target's {hf_cfg.hidden_size}")
        layers, sel = _layers(cfg, store.layers, int(hf_cfg.num_hidden_layers))
        prov = {**store.header, "layers": layers, "captured_layers": store.layers, "path": str(store.path)}
        _preflight(cfg, rank, dev)
    d2t, t2d, vocab_src = _vocab_map(cfg, store, V)

    # Drafter: the same init on every rank (same seed); embedding frozen; lm_head from the target's hot rows.
    embed, head = target_head(cfg.target)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    dcfg = DrafterConfig.from_target_config(hf_cfg, draft_vocab_size=int(d2t.numel()), num_aux=max(1, len(layers)),
                                            aux_layers=layers)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_vocab_map(d2t, t2d)
    drafter.init_from_target(embed, head if cfg.init_lm_head else None)
    from hstap.export import vocab_map_sha256
    extra = {"store": prov, "vocab_map_sha256": vocab_map_sha256(d2t, t2d), "vocab_map_source": vocab_src}
    cd = torch.bfloat16 if bf16 else torch.float32
    head_w, hot, t2d_dev = head.to(dev, cd), (torch.arange(d2t.numel()) + d2t).to(dev), t2d.to(dev)  # (V, H), (Vd,)
    del embed, head

    # Splits: by a hash of the sample id (stable across stores, ranks and resumes), or a separate eval store.
    if cfg.eval_store:
        from hstap.store import open_store
        esrc = open_store(cfg.eval_store)
        if esrc.layers != store.layers or esrc.hidden_size != store.hidden_size:
            raise HstapError(f"{cfg.eval_store}: layers/hidden_size differ from {cfg.store}")
        tr, ev, e_len = list(range(len(ids_all))), list(range(len(esrc))), list(esrc.lengths)
    else:
        esrc = src
        tr = [i for i, s in enumerate(ids_all) if not _is_eval(s, cfg.eval_frac)]
        ev = [i for i, s in enumerate(ids_all) if _is_eval(s, cfg.eval_frac)]
        e_len = [lengths_all[i] for i in ev]
    eval_rows, eval_b = Rows(esrc, ev, prepared=cfg.online), eval_batches(e_len, cfg.batch_tokens, rank, world)

    # Model, wrapping, optimizer; a resume loads the weights before wrapping and the rest after.
    ckpt = checkpoint.complete(run)[-1] if cfg.resume and checkpoint.complete(run) else None
    state = checkpoint.load(ckpt, cfg, world, drafter) if ckpt else {}
    drafter.to(dev)
    if cfg.compile and cuda:
        from torch import _dynamo
        _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)  # shapes vary per TTT step / batch
    model = TTTModel(drafter, ttt=cfg.ttt, decay=cfg.ttt_decay, attn=attn, ce_chunk=cfg.ce_chunk,
                     compile=cfg.compile and cuda)
    fsdp = cfg.fsdp and world > 1
    if fsdp:
        D.apply_fsdp(model, bf16=bf16)
    wrapped = D.wrap_ddp(model, dev) if world > 1 and not fsdp else model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay,
                            fused=True if cuda and not fsdp else None)
    step, best, tokens_seen = state.get("step", 0), state.get("best_sim_tau", -1.0), state.get("tokens_seen", 0)
    if ckpt:
        checkpoint.load_rest(ckpt, state, rank, params, opt)
        if rank == 0:
            checkpoint.truncate_metrics(run / "metrics.jsonl", step)
    batches = TrainBatches(Rows(src, tr, prepared=cfg.online), [lengths_all[i] for i in tr], cfg.batch_tokens,
                           cfg.seed, rank, world, state.get("epoch", 0), state.get("batches_done", 0), cuda,
                           cfg.workers if cfg.workers >= 0 else (4 if cuda else 0))
    per_epoch = math.ceil(len(batches.sampler) / cfg.grad_accum)
    total = cfg.steps or (cfg.epochs or 1) * per_epoch
    eval_every = cfg.eval_every or cfg.save_every
    D.print0(f"hstap train: {len(tr)} train / {len(ev)} eval samples, {per_epoch} steps/epoch, {total} steps, "
             f"world {world}{' fsdp' if fsdp else ''}, {dev.type} {'bf16' if bf16 else 'fp32'}, attn {attn}, "
             f"ttt {cfg.ttt}, draft vocab {d2t.numel()}, aux layers {layers or 'final'}"
             + (f", resumed from {ckpt.name}" if ckpt else ""))

    def prepare(b: dict) -> tuple:
        """A CPU batch -> device tensors, fc inputs, target distributions and counted positions per TTT step."""
        ids = b["input_ids"].to(dev, non_blocking=True)  # (B, T)
        lm, lengths = b["loss_mask"].to(dev, non_blocking=True), b["lengths"].to(dev, non_blocking=True)
        if target is not None:
            aux, final, _ = target.capture(ids, layers)  # (B, T, K, H), (B, T, H); right padding needs no mask
        else:
            aux, final = b["aux"].to(dev, non_blocking=True), b["final"].to(dev, non_blocking=True)
            aux = aux if sel is None or sel == list(range(aux.shape[2])) else aux[:, :, sel]
        tb = target_distribution(final, lm, lengths, head_w, hot, t2d_dev, cfg.ce_chunk, cd)
        counted = [float(step_rows(tb, ids.shape[1], k)[0].numel()) for k in range(cfg.ttt)]
        return ids, (final.unsqueeze(2) if sel is None else aux), tb, counted, b["lengths"]

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)

    def evaluate() -> dict:
        wrapped.eval()
        stats = torch.zeros(cfg.ttt, 3, dtype=torch.float64, device=dev)
        sim = torch.zeros(cfg.ttt + 1, dtype=torch.float64, device=dev)
        replays = []  # (runs on the device, loss_mask, lengths): replayed after the loop, so no sync per batch
        with torch.no_grad():
            for idx, real in eval_b:  # every rank runs the same number of batches; padding repeats are not counted
                b = collate([eval_rows[i] for i in idx])
                ids, feats, tb, _, _ = prepare(b)
                with autocast():
                    s, m, runs = wrapped(ids, feats, tb, evaluate=True)
                if real:
                    stats, sim = stats + s, sim + m
                    replays.append((runs, b["loss_mask"], b["lengths"]))
        wrapped.train()
        chain = torch.zeros(2, cfg.ttt, dtype=torch.float64)  # replayed chain decoding: tokens, rounds per k
        for runs, lm, lengths in replays:
            chain += torch.tensor(np.stack(replay_chain(runs, lm, lengths, cfg.ttt)))
        D.all_reduce_sum(stats)
        D.all_reduce_sum(sim)
        chain = D.all_reduce_sum(chain.to(dev))
        n, w = stats[:, 2].clamp_min(1), cfg.ttt_decay ** torch.arange(cfg.ttt, device=dev)
        return {"step": step, "eval": True, "eval_loss": float((stats[:, 0] / n * w).sum()),
                "eval_acc": (stats[:, 1] / n).tolist(),
                "acc_cond": [float(sim[k + 1] / sim[k]) if sim[k] > 0 else 0.0 for k in range(cfg.ttt)],
                "sim_tau": float((sim[1:] / sim[0]).sum()) if sim[0] > 0 else 0.0, "eval_positions": int(sim[0]),
                "sim_chain_tau": [float(chain[0, k] / chain[1, k]) if chain[1, k] > 0 else 0.0
                                  for k in range(cfg.ttt)]}

    log = _Log(run, rank, cfg.tensorboard)
    from tqdm import tqdm
    bar = tqdm(total=total, initial=step, disable=rank != 0, desc="train", dynamic_ncols=True, file=sys.stderr)
    it, last, ev_last = iter(batches), {}, {}
    win_t, win = time.perf_counter(), torch.zeros(2, dtype=torch.float64)  # tokens, FLOPs since the last log line
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    wrapped.train()
    while step < total:
        micro = [prepare(next(it)) for _ in range(cfg.grad_accum)]  # targets of the whole step first: exact N_k
        pos = (batches.epoch, batches.done)
        denom = D.all_reduce_sum(torch.tensor([sum(c) for c in zip(*(m[3] for m in micro))], device=dev))  # (K,)
        lr = _lr(cfg, step, total)
        for g in opt.param_groups:
            g["lr"] = lr
        stats = torch.zeros(cfg.ttt, 3, dtype=torch.float64, device=dev)
        for j, (ids, feats, tb, counted, lengths) in enumerate(micro):
            with D.grad_sync(wrapped, j == len(micro) - 1):
                with autocast():
                    loss, s = wrapped(ids, feats, tb, denom.float(), float(world))
                loss.backward()
            stats += s
            win += torch.tensor([float(lengths.sum()), ttt_flops(dcfg, lengths, counted, float(tb["s"].numel()),
                                                                 cfg.ttt, attn != "causal")], dtype=torch.float64)
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        del micro
        step += 1
        D.all_reduce_sum(stats)
        n = stats[:, 2].clamp_min(1)
        loss_k = (stats[:, 0] / n).tolist()
        last = {"step": step, "epoch": pos[0] + pos[1] / len(batches.sampler),
                "loss": float(sum(cfg.ttt_decay ** k * x for k, x in enumerate(loss_k))), "loss_k": loss_k,
                "acc": (stats[:, 1] / n).tolist(), "lr": lr, "grad_norm": float(D.full_tensor(gn))}
        bar.update(1)
        bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{last['acc'][0]:.3f}", refresh=False)
        if step % cfg.log_every == 0 or step == total:
            el, agg = max(time.perf_counter() - win_t, 1e-9), D.all_reduce_sum(win.to(dev)).cpu()
            tokens_seen += int(agg[0])
            last |= {"tokens": tokens_seen, "tok_s": float(agg[0]) / el,
                     "mfu": float(agg[1]) / el / (cfg.peak_tflops * 1e12 * world)}
            if cuda:
                last["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
            log(last)
            win_t, win = time.perf_counter(), torch.zeros(2, dtype=torch.float64)
        if eval_b and (step % eval_every == 0 or step == total):
            ev_last = evaluate()
            log(ev_last)
            if rank == 0:
                bar.write(f"step {step}: sim_tau {ev_last['sim_tau']:.3f}  acc_cond "
                          f"{[round(a, 3) for a in ev_last['acc_cond']]}")
        is_best = bool(ev_last) and ev_last["step"] == step and ev_last["sim_tau"] > best
        best = ev_last["sim_tau"] if is_best else best
        if step % cfg.save_every == 0 or step == total or is_best:
            ep, dn = pos if pos[1] < len(batches.sampler) else (pos[0] + 1, 0)
            tstate = {"format": STATE_FORMAT, "version": 1, "step": step, "epoch": ep, "batches_done": dn,
                      "total_steps": total, "best_sim_tau": best, "tokens_seen": tokens_seen,
                      "scheduler": {"kind": "warmup-cosine", "lr": cfg.lr, "warmup_ratio": cfg.warmup_ratio,
                                    "min_lr_ratio": cfg.min_lr_ratio, "next_lr": _lr(cfg, step, total)},
                      "param_names": names, "config": {"world_size": world, **vars(cfg)}}
            checkpoint.save(run, step, drafter, params, opt, tstate, extra, cfg.keep, rank, fsdp, is_best)
    bar.close()
    log.close()
    summary = {"run": str(run), "steps": step, "loss": last.get("loss"), "acc": last.get("acc"),
               "tok_s": last.get("tok_s"), "mfu": last.get("mfu"), "sim_tau": ev_last.get("sim_tau"),
               "best_sim_tau": best if best >= 0 else None, "peak_mem_gb": last.get("peak_mem_gb"),
               "checkpoint": str(checkpoint.complete(run)[-1]) if checkpoint.complete(run) else None}
    D.print0(json.dumps(summary))
    return summary


if __name__ == "__main__":  # `python -m hstap.train ...` (also under torchrun) works before cli.py registers `train`
    from hstap.cli import make_config
    try:
        train(make_config("train", TrainConfig, sys.argv[1:], "train an EAGLE-3 drafter"))
    except HstapError as e:
        print(f"hstap: error: {e}", file=sys.stderr)
        sys.exit(2)
