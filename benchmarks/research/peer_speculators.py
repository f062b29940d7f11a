"""The peer trainer on hstap's data: speculators 0.9.0's EAGLE-3 trainer on an hstap store, at `hstap train`'s budget,
selected on a validation split, converted for `hstap eval` and checked against speculators' own model.

    python benchmarks/research/peer_speculators.py --store STORE --target TARGET --out OUT --epochs 2     # CUDA, bf16
    python benchmarks/research/peer_speculators.py --tiny    # CPU: a tiny random target and store built here (~1-2 min)

On a GPU machine without speculators and without a package index, install it from wheels: on a machine with network
access, in the repository root (`.whl/` is git-ignored), download what speculators' train path imports beyond hstap's
own requirements (19 wheels, 6.9 MB, for Python 3.12; found by importing this script's code paths):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        speculators==0.9.0 hs-connectors==0.9.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 openai==3.57.0 \
        httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 pydantic==2.14.4 \
        pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing-extensions==4.16.0 loguru==0.7.3

then copy .whl/ to the GPU machine with the checkout and install the wheels offline before running: python3 -m pip
install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export
PYTHONPATH=/tmp/site:$PWD

Data: speculators' trainer reads `BaseDataset` samples ({hidden_states (T, K*H), input_ids, verifier_last_hidden_states
(T, H), loss_mask}), which `StoreSamples` hands it straight from the store (memory-mapped shards, no copy: the store's
aux states flattened, its `final` state as the verifier's last state). The store's `final` is the output of the target's
final norm, while speculators stores the state before it and applies the verifier's norm itself: that norm is replaced
by the identity (`build_model`), so both trainers learn the same target distribution, lm_head(final). Same vocabulary
map (the store's d2t/t2d: speculators' d2t[i] = target id - i and boolean t2d, as hstap's), same aux layers (the
store's, in vLLM's convention for speculators), same samples: speculators' packing sampler and collate over hstap's training
split, the split `hstap train` makes (`hstap.train.data.is_eval`: a hash of the sample id, --val-frac = train's
--eval-frac 0.05). Budget: --epochs over that split, as the `hstap train --epochs` run beside it (each config's steps,
tokens and tokens/step are reported; speculators packs without padding, so its steps differ at equal tokens).

Configurations (`configs`; --configs picks):
  default        speculators' defaults as its CLI resolves them: Muon (lr 1e-3) + AdamW, linear schedule (1% warmup),
                 TTT 3, KL loss, equal step weights, 8192 tokens per step, its layout (norm_before_fc, norm_output,
                 norm_before_residual; sliding window 2048, which changes nothing on samples of <= 2048 tokens).
  hstap          train's defaults as far as speculators expresses them (`hstap.train.config.HyperParams` read at run
                 time): AdamW lr 3e-3, weight decay 0, warmup 5% then cosine ending at 10% of lr (cycles chosen so),
                 TTT 5, step weight 0.6^k, 0.5 KL + 0.5 hard CE (= train's ce+hard up to the target's entropy, which has
                 no gradient), train's --batch-tokens per step, hstap's layout (all three switches off, full attention).
                 Not expressible: AdamW betas (speculators: 0.9/0.999, hstap 0.9/0.95), clipping (1.0 / 0.5), the
                 lm_head (speculators freezes it at the target's rows, hstap trains it from there).
  hstap-layout   the hstap recipe with speculators' layout (the two differ in recipe or in layout, not both).

Validation and selection: after every epoch, the in-memory model drafts the validation split with speculators' own
forward (teacher-forced TTT, the chain's steps) and `hstap.train.ttt.replay_chain` replays greedy chain decoding on it,
with hstap's definitions (a draft counts when it equals the target's argmax over the full vocabulary; an argmax outside
the draft vocabulary is a miss): `val_chain_tau[k-1]`, tau of a chain of k drafts, the figure `hstap train` picks
RUN/best by. Per config the best epoch's checkpoint; the chosen config has the highest chain-`--val-k` tau. Never the
eval prompts.

Conversion and parity: each config's best checkpoint (speculators' `save_pretrained` dir, bf16) is read by hstap
(`hstap.export.engines.load_exported`, as `hstap eval --drafter CKPT` reads it) and written as an hstap drafter dir
(OUT/<config>/drafter: `hstap eval --drafter` and `hstap export` take it). Parity: speculators' Eagle3DraftModel loaded
from that checkpoint and hstap's drafter compute every TTT step's logits on validation samples (fp32, teacher-forced,
hstap's side through its exact TTT mask at speculators' positions); reported: the largest logit difference and the
share of equal argmaxes.

Tokens/s: real tokens trained (after speculators' shift, one per sample fewer) over the time of the training epochs
alone (compilation included); `tokens_per_s_steady`: the median of speculators' own timing of its logged steps (every
50th) after the first two. Ends with ONE JSON line: per config the validation figures per epoch, speculators' own validation metrics, the
best epoch, steps, tokens, tokens/s, parity, the drafter dir; the chosen config and its drafter dir.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import shutil
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from speculators.train.data import BaseDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: hstap

from hstap.store.reader import open_store  # noqa: E402

LOSS_TERMS = {"ce": "kl_div", "hard": "ce"}  # hstap train --loss term -> speculators' loss with the same gradient


class StoreSamples(BaseDataset):
    """Samples `indices` of an hstap store as speculators' trainer reads them (picklable: spawn workers reopen the
    store's memory maps)."""

    def __init__(self, store_path: str, indices: list[int], max_len: int, dtype: torch.dtype):
        self.store = open_store(store_path)
        self.indices = list(indices)
        self.lengths = [self.store.lengths[i] for i in self.indices]
        super().__init__(max_len, dtype)

    def _compute_approx_lengths(self) -> list[int]:
        return list(self.lengths)

    def __len__(self) -> int:
        return len(self.indices)

    def _get_raw_data(self, index: int) -> dict:
        s = self.store[self.indices[index]]
        return {"hidden_states": s["aux"].flatten(1),  # (T, K*H)
                "input_ids": s["input_ids"], "verifier_last_hidden_states": s["final"],  # (T,), (T, H)
                "loss_mask": s["loss_mask"]}


# ---------------------------------------------------------------------------------------------------------------------
# configurations


def hstap_recipe(batch_tokens: int | None) -> dict:
    """`hstap train`'s defaults in speculators' terms (module docstring)."""
    from hstap.train.config import HyperParams

    d = {f.name: f.default for f in dataclasses.fields(HyperParams)}
    terms = d["loss"].split("+")
    if any(t not in LOSS_TERMS for t in terms):
        raise SystemExit(f"peer_speculators: train's default loss {d['loss']!r} has no speculators equivalent")
    weights = [1.0] if len(terms) == 1 else [1 - d["loss_mix"], d["loss_mix"]]
    # transformers' cosine schedule ends at 0.5 (1 + cos(2 pi cycles)) of lr: cycles chosen so that this is min_lr_ratio
    cycles = math.acos(2 * d["min_lr_ratio"] - 1) / (2 * math.pi)
    return {"optimizer": "adamw", "lr": d["lr"], "weight_decay": d["weight_decay"], "scheduler_type": "cosine",
            "scheduler_warmup_ratio": d["warmup_ratio"], "scheduler_num_cosine_cycles": cycles,
            "ttt_steps": d["ttt"], "ttt_step_loss_decay": d["ttt_decay"],
            "loss_fn": json.dumps({LOSS_TERMS[t]: w for t, w in zip(terms, weights)}),
            "total_seq_len": batch_tokens or d["batch_tokens"]}


HSTAP_LAYOUT = {"norm_before_fc": False, "norm_before_residual": False, "norm_output": False,
                "full_attention_indices": [0]}


def configs(batch_tokens: int | None) -> dict[str, dict]:
    """name -> speculators TrainConfig fields over its defaults."""
    rec = hstap_recipe(batch_tokens)
    return {"default": {}, "hstap": {**rec, **HSTAP_LAYOUT}, "hstap-layout": rec}


def fresh_compile_state() -> None:
    """speculators compiles Eagle3DraftModel.forward once for the class (CUDA): every configuration's training,
    validation and replay calls add graphs to that one code object, and past dynamo's recompile limit (8) the forward
    would run eagerly (unfused flex_attention: the (T, K*T) scores of a whole packed batch). Each configuration starts
    from an empty cache, with room for its own graphs."""
    dynamo = torch._dynamo
    dynamo.reset()
    name = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo.config, name, max(getattr(dynamo.config, name), 64))


def speculators_config(overrides: dict, a, save_path: Path, aux_vllm: list[int], cuda: bool):
    from speculators.train.config import TrainConfig

    flat = {"verifier_name_or_path": str(Path(a.target).resolve()), "data_path": str(a.store), "epochs": a.epochs,
            "save_path": str(save_path), "target_layer_ids": aux_vllm, "num_workers": a.workers, "log_freq": 50,
            "hidden_states_dtype": "bfloat16" if cuda else "float32", "no_resume_from_checkpoint": True,
            "on_missing": "raise"}
    if not cuda:  # eager flex_attention has no backward on the CPU, the fused loss is a Triton kernel
        flat.update(draft_attn_impl="sdpa", loss_implementation="eager")
    elif getattr(a, "loss_implementation", "fused") != "fused":
        # the H200 image's torch 2.11: dynamo fails to trace the fused KL kernel's backward (RESULTS.md, "Against
        # peers": "ListVariable ... is already tracked for mutation"); eager materialises the logits (more memory)
        flat.update(loss_implementation=a.loss_implementation)
    return TrainConfig.from_flat({**flat, **overrides})


# ---------------------------------------------------------------------------------------------------------------------
# model, data, trainer


def build_model(args, d2t: torch.Tensor, t2d: torch.Tensor):
    """speculators' own draft construction (its train CLI's build_draft_model), the verifier norm made the identity."""
    from speculators.model import SpeculatorModel
    from speculators.train.cli import build_draft_model, set_seed

    set_seed(args.seed)
    model = build_draft_model(args, SpeculatorModel.registry["eagle3"], t2d.bool(), d2t.long(), int(d2t.numel()))
    model.verifier_norm = torch.nn.Identity()  # the store's final state is already the final norm's output
    return model


def loader(ds: StoreSamples, total_seq_len: int, hidden: int, num_aux: int, workers: int, seed: int):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=ds.approx_lengths,
                                                 num_replicas=1, rank=0, seed=seed)
    return torch.utils.data.DataLoader(
        ds, batch_sampler=sampler, num_workers=workers, prefetch_factor=4 if workers else None,
        pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
        multiprocessing_context="spawn" if workers else None,
        collate_fn=CollateFn(total_seq_len, hidden, num_target_layers=num_aux, dtype=ds.hidden_states_dtype,
                             preprocess=shift_batch))


def epoch_tokens(dl, lengths: list[int], total_seq_len: int, epoch: int) -> tuple[int, int]:
    """(steps, real tokens) of one epoch of `dl`: packed batches, one token per sample fewer after the shift."""
    dl.batch_sampler.set_epoch(epoch)
    batches = list(dl.batch_sampler)
    return len(batches), sum(min(total_seq_len, sum(lengths[i] - 1 for i in b)) for b in batches)


def trainer_config(args, train_call: dict, val_call: dict):
    from speculators.train.trainer import TrainerConfig

    names = ("lr", "optimizer", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
             "muon_adjust_lr_fn", "scheduler_type", "scheduler_warmup_steps", "scheduler_warmup_ratio",
             "scheduler_total_steps", "scheduler_num_cosine_cycles", "checkpoint_freq", "save_best", "log_freq",
             "fsdp_shard", "gradient_checkpointing", "max_steps", "save_path")
    return TrainerConfig(num_epochs=args.epochs, resume_from_checkpoint=False, train_call_kwargs=train_call,
                         val_call_kwargs=val_call, hidden_states_dtype=getattr(torch, args.hidden_states_dtype),
                         **{n: getattr(args, n) for n in names})


def make_trainer(model, tcfg, train_dl, val_dl, device: torch.device, after_val):
    """speculators' Trainer, on `device` (it moves model and batches to its local rank, a GPU index), calling
    `after_val(trainer, epoch, its validation metrics)` after each epoch's validation; times the training epochs."""
    from speculators.train.trainer import Trainer

    class PeerTrainer(Trainer):
        def setup_trainer(self):
            self.local_rank, self.device_type, self.train_s = device, device.type, 0.0
            super().setup_trainer()

        def train_epoch(self, epoch, **kw):
            t0 = time.perf_counter()
            super().train_epoch(epoch, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.train_s += time.perf_counter() - t0

        def val_epoch(self, epoch):
            metrics = super().val_epoch(epoch)
            after_val(self, epoch, metrics)
            return metrics

    return PeerTrainer(model, tcfg, train_dl, val_dl)


class MetricsTap(logging.Handler):
    """The training lines speculators' Trainer logs every --log-freq steps ({"train": metrics, "profile": {step_ms,
    tokens_per_s, ...}}: its own timing of a step, device-synchronized), kept while installed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[dict] = []
        self.log = logging.getLogger("speculators.metrics")

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.lines.append(record.msg)

    def __enter__(self):
        self.level, self.propagate = self.log.level, self.log.propagate
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        self.log.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.log.removeHandler(self)
        self.log.setLevel(self.level)
        self.log.propagate = self.propagate

    def steady_tokens_per_s(self) -> float | None:
        """Median tokens/s of the logged steps after the first two (compilation and warm-up); None below 3 lines."""
        rates = sorted(x["profile"]["tokens_per_s"] for x in self.lines[2:] if x.get("profile"))
        return rates[len(rates) // 2] if rates else None


# ---------------------------------------------------------------------------------------------------------------------
# validation: greedy chain decoding replayed with hstap's definitions


def batch_to(b: dict, device, keys=("hidden_states", "input_ids", "document_ids", "position_ids")) -> dict:
    return {k: b[k].to(device, non_blocking=True) for k in keys}


@torch.no_grad()
def replay_validation(model, val_dl, head: torch.Tensor, hot: torch.Tensor, t2d: torch.Tensor, K: int,
                      device: torch.device, autocast_dtype: torch.dtype) -> dict:
    """val_chain_tau[k-1] (k = 1..K) of speculators' model on `val_dl` (speculators' shifted, packed batches).

    Shifted row r of a document is drafter position t = r - start: step k there drafts x[t+2+k], the target's argmax
    at s = t+1+k (shifted row r+k) over the full vocabulary, counted when loss_mask[t+2+k] (shifted row r+1+k) is 1
    inside the document (`hstap.train.ttt.step_rows`); runs[t] = leading correct steps, replayed per answer span."""
    import numpy as np

    from hstap.train.ttt import replay_chain

    was = model.training
    model.eval()
    tokens, rounds = np.zeros(K, dtype=np.int64), np.zeros(K, dtype=np.int64)
    for b in val_dl:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=device.type == "cuda"):
            drafts = model(**batch_to(b, device), ttt_steps=K)  # K x (1, L) draft-vocab ids
        final = b["verifier_last_hidden_states"][0].to(device)  # (L, H)
        full = torch.cat([(final[a:a + 4096].to(head.dtype) @ head.t()).argmax(-1) for a in range(0, len(final), 4096)])
        tgt = torch.searchsorted(hot, full)  # (L,) draft index of the full-vocabulary argmax
        ok_t = t2d[full] & (tgt < len(hot))  # (L,) the argmax lies in the draft vocabulary
        tgt = tgt.clamp_max(len(hot) - 1)
        doc, lm = b["document_ids"][0].to(device), b["loss_mask"][0].to(device).bool()  # (L,), (L,)
        L = doc.numel()
        runs = torch.zeros(L, dtype=torch.long, device=device)
        alive = torch.ones(L, dtype=torch.bool, device=device)
        for k in range(K):
            same = torch.zeros(L, dtype=torch.bool, device=device)  # rows r+k and r+1+k of r's document
            if L > k + 1:
                same[:L - 1 - k] = (doc[:L - 1 - k] >= 0) & (doc[1 + k:] == doc[:L - 1 - k])
            ok = torch.zeros(L, dtype=torch.bool, device=device)
            n = L - 1 - k
            if n > 0:
                ok[:n] = same[:n] & lm[1 + k:] & ok_t[k:L - 1] & (drafts[k][0, :n] == tgt[k:L - 1])
            alive &= ok
            runs += alive.long()
        d_np, lm_np, runs_np = doc.cpu().numpy(), lm.cpu().numpy(), runs.cpu().numpy()
        for d in np.unique(d_np[d_np >= 0]):
            rows = np.flatnonzero(d_np == d)  # contiguous: the document's shifted rows
            n = len(rows) + 1  # its length before the shift (a truncated one: up to the cut)
            mask = np.concatenate([[0], lm_np[rows]])[None]  # (1, n): loss_mask[0] is never an answer
            r = np.concatenate([runs_np[rows], [0]])[None]  # (1, n)
            tk, rd = replay_chain(torch.from_numpy(r), torch.from_numpy(mask), torch.tensor([n]), K)
            tokens, rounds = tokens + tk, rounds + rd
    model.train(was)
    return {"val_chain_tau": [float(t / r) if r else 0.0 for t, r in zip(tokens, rounds)],
            "val_rounds": int(rounds[-1])}


# ---------------------------------------------------------------------------------------------------------------------
# conversion and parity


def convert(ckpt: Path, out: Path, store, embed: torch.Tensor, extra: dict):
    """hstap's reading of a speculators checkpoint (what `hstap eval --drafter CKPT` loads), saved as an hstap drafter
    dir with the store's provenance (so `hstap export` validates it)."""
    from hstap.artifacts.drafter_dir import save_drafter
    from hstap.export.engines import load_exported

    drafter, _ = load_exported(ckpt, embed_weight=embed)
    if list(drafter.config.aux_layers) != list(store.layers):
        raise SystemExit(f"peer_speculators: {ckpt}: aux layers {drafter.config.aux_layers} != the store's "
                         f"{store.layers}")
    save_drafter(out, drafter, extra={"store": {**store.header, "layers": list(store.layers),
                                                "captured_layers": list(store.layers), "path": str(store.path)},
                                      "peer": extra})
    return drafter


@torch.no_grad()
def parity(ckpt: Path, drafter, ds: StoreSamples, n: int, max_tokens: int, K: int, device: torch.device) -> dict:
    """Largest |logit difference| and share of equal argmaxes between speculators' Eagle3DraftModel (from `ckpt`) and
    hstap's drafter over K teacher-forced TTT steps on the first n samples of `ds` (cut to max_tokens), fp32."""
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from hstap.models.drafter import new_drafter_cache
    from hstap.train.ttt import ttt_mask

    spec = SpeculatorModel.registry["eagle3"].from_pretrained(str(ckpt)).to(device, torch.float32).eval()
    spec.verifier_norm = torch.nn.Identity()
    d = drafter.to(device, torch.float32).eval()
    worst, same, total = 0.0, 0, 0
    for i in range(min(n, len(ds))):
        s = ds[i]
        T = min(len(s["input_ids"]), max_tokens) - 1
        s = {k: (v[:T + 1] if k not in ("lengths",) else torch.tensor([T + 1])) for k, v in s.items()}
        padded = -(-T // 128) * 128  # whole 128-blocks for flex_attention's BlockMask, as speculators' batches
        b = CollateFn(padded, d.config.hidden_size, d.config.num_aux, torch.float32, preprocess=shift_batch)([s])
        got = []
        hook = spec.lm_head.register_forward_hook(lambda m, inp, out: got.append(out.float()))
        try:
            with torch.compiler.set_stance("force_eager"):
                spec(**batch_to(b, device), ttt_steps=K)
        finally:
            hook.remove()
        x = s["input_ids"][None].to(device)  # (1, T+1)
        hidden, cache = d.project(s["hidden_states"][None, :T].to(device)), new_drafter_cache(d)  # (1, T, H)
        for k in range(K):
            ids = F.pad(x[:, 1 + k:], (0, k))  # (1, T): x[t+1+k], 0 past the end (speculators' teacher forcing)
            pos = (torch.arange(T, device=device) + 1 + k)[None]  # speculators' positions start at 1
            hidden = d(ids, hidden, pos, cache, ttt_mask(T, k, device))  # (1, T, H)
            ours = d.compute_logits(hidden).float()  # (1, T, Vd)
            theirs = got[k][:, :T]  # (1, T, Vd): the rows past T are collate's padding
            worst = max(worst, float((ours - theirs).abs().max()))
            same += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
            total += T
    return {"max_abs_logit_diff": worst, "argmax_equal": same / max(total, 1), "samples": min(n, len(ds)),
            "positions": total}


# ---------------------------------------------------------------------------------------------------------------------
# one configuration, the run, --tiny


def run_config(name: str, overrides: dict, a, ctx: dict) -> dict:
    """Train config `name`, validate after every epoch, convert and check its best checkpoint -> its JSON record."""
    from speculators.model import SpeculatorModel

    out, cuda = Path(a.out) / name, ctx["device"].type == "cuda"
    if out.exists():
        shutil.rmtree(out)
    fresh_compile_state()
    tcfg = speculators_config(overrides, a, out / "checkpoints", ctx["aux_vllm"], cuda)
    args = argparse.Namespace(**tcfg.flatten())
    tcfg.save(str(out / "checkpoints"))  # run.yaml + train_command.txt: speculators' own record of the run
    model = build_model(args, ctx["d2t"], ctx["t2d"])
    train_call, val_call = SpeculatorModel.registry["eagle3"].get_trainer_kwargs(**vars(args))
    dtype = getattr(torch, args.hidden_states_dtype)
    H, K = model.config.transformer_layer_config.hidden_size, len(ctx["store"].layers)
    tr = StoreSamples(a.store, ctx["train"], args.total_seq_len, dtype)
    va = StoreSamples(a.store, ctx["val"], args.total_seq_len, dtype)
    train_dl = loader(tr, args.total_seq_len, H, K, a.workers, args.seed)
    val_dl = loader(va, args.total_seq_len, H, K, a.workers, 0)
    steps_tokens = [epoch_tokens(train_dl, tr.lengths, args.total_seq_len, e) for e in range(a.epochs)]
    epochs = []

    def after_val(trainer, epoch, spec_metrics):
        t0 = time.perf_counter()
        rec = replay_validation(trainer.model, trainer.val_loader, ctx["head"], ctx["hot"], ctx["t2d_dev"], a.val_k,
                                ctx["device"], dtype)
        keep = {k: round(v, 4) for k, v in (spec_metrics or {}).items() if k.startswith(("loss_epoch", "cond_acc"))}
        epochs.append({"epoch": epoch, **rec, "speculators_val": keep, "val_s": round(time.perf_counter() - t0, 1)})
        print(f"peer_speculators: {name} epoch {epoch}: val chain tau {[round(x, 3) for x in rec['val_chain_tau']]} "
              f"({rec['val_rounds']} rounds)", file=sys.stderr, flush=True)

    tc = trainer_config(args, train_call, val_call)
    trainer = make_trainer(model, tc, train_dl, val_dl, ctx["device"], after_val)
    with warnings.catch_warnings(), contextlib.ExitStack() as stack, MetricsTap() as tap:
        if not cuda:  # a GPU trainer on the CPU: its autocast warnings, and its step timer's device synchronize
            warnings.simplefilter("ignore")
            stack.enter_context(mock.patch("torch.accelerator.synchronize", lambda *_, **__: None))
        trainer.run_training()
    train_s, steady = trainer.train_s, tap.steady_tokens_per_s()
    last_loss = tap.lines[-1]["train"].get("loss") if tap.lines else None
    del trainer, model, train_dl, val_dl
    best = max(epochs, key=lambda e: e["val_chain_tau"][-1])
    ckpt = out / "checkpoints" / str(best["epoch"])
    tokens = sum(t for _, t in steps_tokens)
    peer = {"trainer": "speculators 0.9.0", "config": name, "checkpoint": str(ckpt), "epoch": best["epoch"],
            "overrides": overrides}
    drafter = convert(ckpt, out / "drafter", ctx["store"], ctx["embed"], peer)
    par = parity(ckpt, drafter, va, a.parity_samples, a.parity_tokens, args.ttt_steps, ctx["device"])
    print(f"peer_speculators: {name}: best epoch {best['epoch']} (val chain-{a.val_k} tau "
          f"{best['val_chain_tau'][-1]:.3f}), {tokens / train_s:,.0f} tokens/s; parity: max |dlogit| "
          f"{par['max_abs_logit_diff']:.2e}, argmax equal {par['argmax_equal']:.4f}", file=sys.stderr, flush=True)
    return {"overrides": overrides, "ttt_steps": args.ttt_steps, "tokens_per_step": args.total_seq_len,
            "epochs": epochs, "best_epoch": best["epoch"], "val_chain_tau": best["val_chain_tau"],
            "steps": sum(n for n, _ in steps_tokens), "tokens": tokens, "train_s": round(train_s, 1),
            "tokens_per_s": round(tokens / train_s, 1), "tokens_per_s_steady": steady and round(steady, 1),
            "last_logged_train_loss": last_loss, "checkpoint": str(ckpt), "drafter": str(out / "drafter"),
            "parity": par}


def context(a) -> dict:
    """What every configuration shares: the store, its split, vocab map and aux layers, the target's head, the
    device."""
    from hstap.artifacts.vocab_map import load_store_vocab_map
    from hstap.layers import to_vllm
    from hstap.artifacts.model_dir import target_head
    from hstap.train.data import is_eval

    store = open_store(a.store)
    vm = load_store_vocab_map(a.store, store.header)
    if vm is None:
        raise SystemExit(f"peer_speculators: {a.store}: the store records no vocabulary map (capture a prepared set)")
    d2t, t2d = (torch.as_tensor(x) for x in vm[:2])
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    embed, head = target_head(a.target)
    hot = torch.arange(d2t.numel()) + d2t.long()  # (Vd,) target ids of the draft vocabulary, increasing
    val = [i for i, s in enumerate(store.ids) if is_eval(s, a.val_frac)]
    train = [i for i, s in enumerate(store.ids) if not is_eval(s, a.val_frac)]
    if a.val_samples:
        val = val[:a.val_samples]
    return {"store": store, "d2t": d2t.long(), "t2d": t2d.bool(), "aux_vllm": to_vllm(store.layers), "device": device,
            "embed": embed, "head": head.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32),
            "hot": hot.to(device), "t2d_dev": t2d.bool().to(device), "train": train, "val": val}


def tiny_assets(root: Path) -> tuple[str, str]:
    """--tiny: a random SmolLM2-like target (tied embeddings, 3 query heads per kv head), stdlib-documentation chats,
    prepared (a 96-token draft vocabulary) and captured (fp32, layers 1,3,4) by hstap's own stages -> (target,
    store)."""
    import io

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import prepare
    from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts, stdlib_conversations

    shutil.rmtree(root, ignore_errors=True)  # a re-run builds them afresh (prepare never overwrites)
    tok = build_tokenizer(sample_texts(), vocab_size=400, out_dir=root / "tok")
    model = build_random_target(root / "target", tok, num_layers=6, hidden_size=48, num_heads=3, num_kv_heads=1,
                                intermediate_size=96, seed=1, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)  # a peaked target: something for the drafter to learn
    model.save_pretrained(str(root / "target"))
    convs = stdlib_conversations()[:48]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(PrepareConfig(tokenizer=str(root / "target"), data=[str(root / "chats.jsonl")],
                              out=str(root / "prepared"), draft_vocab=96, max_len=256))
        capture(CaptureConfig(target=str(root / "target"), data=str(root / "prepared"), out=str(root / "store"),
                              layers="1,3,4", dtype="fp32", device="cpu", batch_tokens=4096))
    return str(root / "target"), str(root / "store")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", help="the hstap store (with its vocab map) that `hstap train` trains on")
    ap.add_argument("--target", help="the target model directory the store was captured from")
    ap.add_argument("--out", help="output directory: OUT/<config>/{checkpoints,drafter}, OUT/summary.json")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs over the training split: the hstap run's --epochs (default 1; --tiny: 2)")
    ap.add_argument("--configs", default="default,hstap", help=f"comma list of {', '.join(configs(None))}")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="tokens per step of the hstap recipe (default: train's --batch-tokens default)")
    ap.add_argument("--val-frac", type=float, default=0.05, help="validation split (= hstap train's --eval-frac)")
    ap.add_argument("--val-samples", type=int, default=0, help="validate on the first N of the split only (0 = all)")
    ap.add_argument("--val-k", type=int, default=5, help="chain length of the selection figure (eval's default k)")
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers (spawned; 0 = in the main process)")
    ap.add_argument("--loss-implementation", default="fused", choices=["fused", "eager"],
                    help="CUDA: speculators' loss kernels (fused Triton; eager where the fused one fails to compile)")
    ap.add_argument("--parity-samples", type=int, default=4)
    ap.add_argument("--parity-tokens", type=int, default=256, help="parity samples cut to this many tokens")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny random target and store built here")
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.tiny:
        import tempfile

        a.out = a.out or tempfile.mkdtemp(prefix="peer-speculators-")
        a.target, a.store = tiny_assets(Path(a.out) / "assets")
        a.workers, a.epochs, a.val_frac, a.val_k = 0, a.epochs or 2, 0.25, 3
        a.batch_tokens = a.batch_tokens or 1024
    elif not (a.store and a.target and a.out):
        ap.error("--store, --target and --out are required (or --tiny)")
    a.epochs = a.epochs or 1
    table = configs(a.batch_tokens)
    if a.tiny:  # speculators' own 8192 tokens per step would take the tiny store in one step
        table = {k: {"total_seq_len": 1024, **v} for k, v in table.items()}
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"--configs: unknown {unknown} (known: {', '.join(table)})")
    ctx = context(a)
    print(f"peer_speculators: {len(ctx['train'])} train / {len(ctx['val'])} validation samples, aux layers "
          f"{ctx['store'].layers} (vLLM ids {ctx['aux_vllm']}), draft vocab {ctx['d2t'].numel()}, {ctx['device']}",
          file=sys.stderr, flush=True)
    res = {n: run_config(n, table[n], a, ctx) for n in names}
    chosen = max(res, key=lambda n: res[n]["val_chain_tau"][-1])
    summary = {"bench": "peer_speculators", "store": a.store, "target": a.target, "epochs": a.epochs,
               "val_samples": len(ctx["val"]), "val_k": a.val_k, "configs": res, "chosen": chosen,
               "chosen_drafter": res[chosen]["drafter"], "device": torch.cuda.get_device_name()
               if ctx["device"].type == "cuda" else "cpu", "total_s": round(time.time() - t0, 1)}
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
