"""The training run's metrics: the train line of a step, the throughput window (real tokens/s and MFU from the
model's FLOP count), the metrics.jsonl / TensorBoard log and the closing console table, written by rank 0 only."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from hstap import dist as D
from hstap.console import num, table
from hstap.models.drafter import DrafterConfig
from hstap.plots import training_curves
from hstap.train.ttt import ttt_flops

CURVES = "curves.png"  # RUN/curves.png: loss, accuracy and sim tau over the steps


def train_line(step: int, epoch: float, stats: torch.Tensor, decay: float, lr: float, gn: torch.Tensor) -> dict:
    """The train metrics line of a step from its stats (K, 3) = [sum CE_k, correct_k, counted_k] over all ranks."""
    n = stats[:, 2].clamp_min(1)
    loss_k = (stats[:, 0] / n).tolist()
    return {"step": step, "epoch": epoch, "loss": float(sum(decay ** k * x for k, x in enumerate(loss_k))),
            "loss_k": loss_k, "acc": (stats[:, 1] / n).tolist(), "lr": lr, "grad_norm": float(D.full_tensor(gn))}


class Throughput:
    """Real tokens and model FLOPs (`hstap.train.ttt.ttt_flops`) of this rank since the last metrics line."""

    def __init__(self, dcfg: DrafterConfig, ttt: int, exact_attn: bool, peak_flops: float):
        """peak_flops: the peak FLOP/s of all ranks together (the MFU denominator)."""
        self.dcfg, self.ttt, self.exact_attn, self.peak_flops = dcfg, ttt, exact_attn, peak_flops
        self.reset()

    def reset(self) -> None:
        self.t, self.win = time.perf_counter(), torch.zeros(2, dtype=torch.float64)  # tokens, FLOPs

    def add(self, micro: list[tuple]) -> None:
        """Count a step's micro-batches (`Feed` outputs)."""
        for _, _, tb, counted, lengths in micro:
            self.win += torch.tensor([float(lengths.sum()), ttt_flops(self.dcfg, lengths, counted,
                                                                      float(tb["s"].numel()), self.ttt,
                                                                      self.exact_attn)], dtype=torch.float64)

    def window(self, dev: torch.device) -> tuple[int, float, float]:
        """-> (tokens, tokens/s, MFU) of the window, all ranks (a collective)."""
        el, agg = max(time.perf_counter() - self.t, 1e-9), D.all_reduce_sum(self.win.to(dev)).cpu()
        return int(agg[0]), float(agg[0]) / el, float(agg[1]) / el / self.peak_flops


class MetricsLog:
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


def print_summary(s: dict) -> None:
    """The console table at the end of a run (rank 0): steps, tokens/s, final loss, sim tau, outputs."""
    n = s["tokens_this_run"]
    rows = [["trained", f"{s['steps']} steps, {num(s['tokens'])} tokens"
             + (f"; {num(n)} of them in this run's {s['seconds']:.1f} s" if n != s["tokens"] else
                f" in {s['seconds']:.1f} s")
             + (f" ({num(n / s['seconds'])} tokens/s)" if s["seconds"] > 0 and n > 0 else "")]]
    if s["loss"] is not None:
        rows.append(["final loss", f"{s['loss']:.3f} (first-draft accuracy {100 * s['acc'][0]:.1f}%)"])
    if s["best_sim_tau"] is not None:
        last = f", last {s['sim_tau']:.3f}" if s["sim_tau"] is not None else ""  # none when a resume ran no step
        rows.append(["sim tau", f"best {s['best_sim_tau']:.3f}{last} tokens per target forward "
                                f"(chain of {s['ttt']} drafts replayed on {s['eval_samples']} eval samples)"])
    if s.get("checkpoint"):
        rows.append(["checkpoint", checkpoint_sizes(Path(s["checkpoint"]), Path(s["run"]) / "best")])
    out = [f"{s['run']}/best", f"{s['run']}/metrics.jsonl"] + ([s["curves"]] if s["curves"] else [])
    rows.append(["outputs", ", ".join(out)])
    print("hstap train: done\n" + table(None, rows), flush=True)


def checkpoint_sizes(ckpt: Path, best: Path) -> str:
    """What a checkpoint holds, in MB: the drafter, the optimizer state, the RNG; and best/ (the drafter alone). The
    target's frozen embedding is in neither (hstap/artifacts/drafter_dir.py)."""
    def mb(files) -> float:
        return sum(f.stat().st_size for f in files if f.is_file()) / 1e6

    parts = [("drafter", mb(ckpt.glob("drafter.*"))), ("optimizer state", mb(ckpt.glob("optimizer.safetensors"))),
             ("RNG and trainer state", mb(ckpt.glob("rng*")) + mb(ckpt.glob("trainer_state.json")))]
    text = (f"{ckpt.name}: {mb(ckpt.iterdir()):,.1f} MB (" + ", ".join(f"{k} {v:,.1f} MB" for k, v in parts) + ")"
            + (f"; best/ {mb(best.iterdir()):,.1f} MB" if best.is_dir() else ""))
    return text + "; without the target's frozen embedding (it comes back from the target at load)"


def draw_curves(run: Path) -> None:
    """RUN/curves.png from RUN/metrics.jsonl, after the step's checkpoint; a plot that fails costs one line, never the
    run."""
    try:
        training_curves(run / "metrics.jsonl", run / CURVES)
    except Exception as e:  # noqa: BLE001 - a plot is a convenience: the metrics it draws are in metrics.jsonl
        print(f"hstap train: note: {run / CURVES} not drawn ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
