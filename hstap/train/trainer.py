"""The drafter under training on this rank: its init, the TTT model wrapped for the ranks (DDP or FSDP2), AdamW with
its warmup-cosine schedule, one optimizer step over a step's micro-batches and the evaluation pass.

The objective, the exact global mean over ranks and micro-batches, and the metrics are described in `hstap.train.stage`'s
module docstring.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from hstap import dist as D
from hstap.batching import collate
from hstap.layers import fc_slots
from hstap.models.drafter import DrafterConfig, Eagle3Drafter
from hstap.train import checkpoint
from hstap.train.config import Devices, HyperParams
from hstap.train.data import Feed, TrainData
from hstap.artifacts.vocab_map import VocabMap
from hstap.train.ttt import TTTModel, replay_chain


@dataclass(frozen=True)
class Schedule:
    """Linear warmup over warmup_ratio of `total` steps, then cosine from lr down to min_lr_ratio * lr at `total`.

    A resumed run with a larger total lays the cosine out over the new total. total None (a --follow run without
    --steps: the total is not known): lr throughout."""

    lr: float
    warmup_ratio: float
    min_lr_ratio: float
    total: int | None

    def lr_at(self, step: int) -> float:
        """The learning rate of the optimizer step that follows `step` completed steps."""
        if self.total is None:
            return self.lr
        warm = math.ceil(self.warmup_ratio * self.total) if self.warmup_ratio > 0 else 0
        if step < warm:
            return self.lr * (step + 1) / warm
        prog = (step - warm) / max(1, self.total - warm)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))

    def state(self, step: int) -> dict:
        """The schedule as trainer_state.json records it after `step` steps."""
        return {"kind": "warmup-cosine", "lr": self.lr, "warmup_ratio": self.warmup_ratio,
                "min_lr_ratio": self.min_lr_ratio, "next_lr": self.lr_at(step)}


def init_drafter(hf_cfg, vocab: VocabMap, layers: list[int], embed: torch.Tensor, head: torch.Tensor, *, seed: int,
                 draft_layers: int, init_lm_head: bool = True) -> Eagle3Drafter:
    """The same init on every rank (same seed): embedding copied from the target (frozen); lm_head from the target
    head's rows of the draft vocabulary (--init-lm-head), the rest PyTorch's default init under --seed. `layers`: the
    aux layers (canonical ids); `draft_layers`: decoder layers (--draft-layers)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    dcfg = DrafterConfig.from_target_config(hf_cfg, draft_vocab_size=vocab.size, num_aux=fc_slots(layers),
                                            aux_layers=list(layers), num_layers=draft_layers)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_vocab_map(vocab.d2t, vocab.t2d)
    drafter.init_from_target(embed, head if init_lm_head else None)
    return drafter


class Trainer:
    """The TTT model of a drafter (already on `dev`) wrapped for this rank, and its optimizer."""

    def __init__(self, hyper: HyperParams, devices: Devices, drafter: Eagle3Drafter, world: int, dev: torch.device,
                 attn: str, bf16: bool, ce_chunk: int):
        """hyper: the objective and the optimizer's settings; devices: --compile, --fsdp; ce_chunk: rows per chunk of
        the fused lm_head + cross-entropy (the plan's: --ce-chunk resolved)."""
        cuda = dev.type == "cuda"
        self.drafter, self.world, self.dev, self.bf16 = drafter, world, dev, bf16
        self.ttt, self.decay, self.grad_clip = hyper.ttt, hyper.ttt_decay, hyper.grad_clip
        self.model = TTTModel(drafter, ttt=hyper.ttt, decay=hyper.ttt_decay, attn=attn, ce_chunk=ce_chunk,
                              compile=devices.compile and cuda, loss=hyper.loss, loss_mix=hyper.loss_mix,
                              lk_decay=hyper.lk_decay)
        self.fsdp = devices.fsdp and world > 1
        if self.fsdp:
            D.apply_fsdp(self.model, bf16=bf16)
        self.wrapped = D.wrap_ddp(self.model, dev) if world > 1 and not self.fsdp else self.model
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=hyper.lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=hyper.weight_decay, fused=True if cuda and not self.fsdp else None)
        self._told_fallback = False

    def _tell_fallback(self) -> None:
        """One run-log line, the first time this rank's TTT attention fell back from flex to SDPA."""
        if self.model.attn_fallback and not self._told_fallback:
            self._told_fallback = True
            print(f"hstap train: rank {D.get_rank()}: TTT attention sdpa from now on (exact mask): "
                  f"{self.model.attn_fallback}", flush=True)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16)

    def step(self, micro: list[tuple], lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step at `lr` over this rank's micro-batches (`Feed` outputs, all prepared first: the counted
        positions N_k of the whole global batch are known before any backward) -> (stats (K, 3) = [sum CE_k,
        correct_k, counted_k] summed over ranks, the gradient norm before clipping)."""
        denom = D.all_reduce_sum(torch.tensor([sum(c) for c in zip(*(m[3] for m in micro))], device=self.dev))  # (K,)
        for g in self.opt.param_groups:
            g["lr"] = lr
        stats = torch.zeros(self.ttt, 3, dtype=torch.float64, device=self.dev)  # (K, 3)
        for j, (ids, feats, tb, _, _) in enumerate(micro):
            with D.grad_sync(self.wrapped, j == len(micro) - 1):
                with self.autocast():
                    loss, s = self.wrapped(ids, feats, tb, denom.float(), float(self.world))
                loss.backward()
            stats += s
        self._tell_fallback()
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return D.all_reduce_sum(stats), gn

    def evaluate(self, feed: Feed, data: TrainData, step: int) -> dict:
        """The eval split through the TTT model (evaluate=True) -> the eval metrics line of `step`."""
        K, dev = self.ttt, self.dev
        self.wrapped.eval()
        stats = torch.zeros(K, 3, dtype=torch.float64, device=dev)  # (K, 3)
        sim = torch.zeros(K + 1, dtype=torch.float64, device=dev)  # (K+1,)
        replays = []  # (runs on the device, loss_mask, lengths): replayed after the loop, so no sync per batch
        with torch.no_grad():
            for idx, real in data.eval_batches:  # every rank runs the same number; padding repeats are not counted
                b = collate([data.eval_rows[i] for i in idx])
                ids, feats, tb, _, _ = feed(b)
                with self.autocast():
                    s, m, runs = self.wrapped(ids, feats, tb, evaluate=True)
                if real:
                    stats, sim = stats + s, sim + m
                    replays.append((runs, b["loss_mask"], b["lengths"]))
        self.wrapped.train()
        self._tell_fallback()
        chain = torch.zeros(2, K, dtype=torch.float64)  # replayed chain decoding: tokens, rounds per k
        for runs, lm, lengths in replays:
            chain += torch.tensor(np.stack(replay_chain(runs, lm, lengths, K)))
        D.all_reduce_sum(stats)
        D.all_reduce_sum(sim)
        chain = D.all_reduce_sum(chain.to(dev))
        n, w = stats[:, 2].clamp_min(1), self.decay ** torch.arange(K, device=dev)
        chain_tau = [float(chain[0, k] / chain[1, k]) if chain[1, k] > 0 else 0.0 for k in range(K)]
        # sim_tau is tau as `hstap eval` measures it (tokens per target forward, the bonus token included): the
        # replayed chain of K = --ttt drafts; 0.0 when the eval split had no round to replay
        return {"step": step, "eval": True, "eval_loss": float((stats[:, 0] / n * w).sum()),
                "eval_acc": (stats[:, 1] / n).tolist(),
                "acc_cond": [float(sim[k + 1] / sim[k]) if sim[k] > 0 else 0.0 for k in range(K)],
                "sim_tau": chain_tau[-1], "eval_positions": int(sim[0]), "sim_chain_tau": chain_tau}

    def load_rest(self, ckpt, state: dict, rank: int) -> None:
        """A resume's optimizer state and this rank's RNG (the weights were loaded before wrapping)."""
        checkpoint.load_rest(ckpt, state, rank, self.params, self.opt)
