"""The figures hstap writes as PNG: the eval's per-position acceptance (REPORT/acceptance.png), a training run's
curves (RUN/curves.png, from RUN/metrics.jsonl) and the serve loop's acceptance against requests served
(OUT/acceptance.png of `hstap serve-loop`, one line per run), and several serve-loop runs across a traffic shift
(benchmarks/bench_serve_shift.py).

matplotlib through its Agg canvas directly (no pyplot, no display, no global backend switch: safe inside a notebook
or a server). Files are written atomically.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from hstap.common import atomic_write_bytes


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def _save(fig, path: str | Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def acceptance_plot(results: dict, mode: str, path: str | Path):
    """Per-position acceptance of each drafting method (`hstap.speculative.evaluate.aggregate` results by method name): the
    fraction of verify rounds whose accepted draft reached position (chain) or depth (tree) i. Returns the figure."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure(6, 3.6)
    drawn = 0
    for name, r in results.items():
        acc = r.get("per_position_acceptance")
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {r['tau']:.2f})")
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no drafting method was evaluated\n(target-only decoding accepts nothing)",
                ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position in the chain" if mode == "chain" else "draft tree depth")
    ax.set_ylabel("fraction of rounds accepted")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance per " + ("draft position" if mode == "chain" else "tree depth")
                 + " (tau = tokens per target forward)", fontsize=10)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    _save(fig, path)
    return fig


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train lines, eval lines) of a metrics.jsonl; a torn last line (a killed run) is skipped."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            (evals if rec.get("eval") else train).append(rec)
    return train, evals


def training_curves(metrics: str | Path, path: str | Path):
    """Loss, accuracy of TTT step 0 and simulated tau over the steps of a training run, from its metrics.jsonl.
    Returns the figure."""
    from matplotlib.ticker import MaxNLocator

    train, evals = read_metrics(metrics)
    fig, (a_loss, a_acc, a_tau) = _figure(13, 3.4, 3)
    if train:
        a_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
        a_acc.plot([r["step"] for r in train], [r["acc"][0] for r in train], label="train")
    if evals:
        steps = [r["step"] for r in evals]
        a_loss.plot(steps, [r["eval_loss"] for r in evals], marker="o", label="eval split")
        a_acc.plot(steps, [r["eval_acc"][0] for r in evals], marker="o", label="eval split")
        a_tau.plot(steps, [r["sim_tau"] for r in evals], marker="o", color="C2")
        a_tau.axhline(1.0, color="grey", linestyle=":", linewidth=1)  # 1.0: no draft accepted
    a_loss.set_title("loss (sum over TTT steps, weighted)", fontsize=10)
    a_acc.set_title("accuracy of the first draft (TTT step 0)", fontsize=10)
    a_acc.set_ylim(0, 1)
    a_tau.set_title("simulated tau (tokens per target forward)", fontsize=10)
    if not evals:
        a_tau.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=a_tau.transAxes)
    for ax in (a_loss, a_acc, a_tau):
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in (a_loss, a_acc):
        if train or evals:
            ax.legend()
    _save(fig, path)
    return fig


def _acceptance_axes(fig, ax, xlabel: str, top: float, title: str, legend: bool, path: str | Path):
    """The serve-loop figures' axes: acceptance from 0 (low acceptance stays readable), grid, legend; saved."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("draft tokens accepted / proposed")
    ax.set_ylim(0, min(1.02, max(0.25, 1.25 * top)))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    _save(fig, path)
    return fig


def serve_loop_plot(runs: dict[str, dict], path: str | Path):
    """vLLM's acceptance (accepted / proposed draft tokens) over windows of answered requests, against requests served,
    one line per `hstap serve-loop` summary in `runs` (name -> summary.json); a loop's drafter updates are the ticks
    at the bottom. Returns the figure."""
    fig, ax = _figure(7, 3.8)
    for n, (name, s) in enumerate(runs.items()):
        w = s.get("windows") or []
        ax.plot([p["served"] for p in w], [p["acceptance"] for p in w], marker="o", markersize=3, color=f"C{n}",
                label=f"{name} (overall {s.get('acceptance', 0):.3f}, tau {s.get('tau', 1):.2f})")
        ups = [u["served"] for u in s.get("updates") or [] if "load_s" in u and "error" not in u]
        if ups:
            ax.plot(ups, [0.01 + 0.02 * n] * len(ups), linestyle="none", marker="|", markersize=10, color=f"C{n}")
    top = max((p["acceptance"] for s in runs.values() for p in s.get("windows") or []), default=0.0)
    return _acceptance_axes(fig, ax, "requests served", top,
                            "vLLM's acceptance while serving (ticks: drafter updates taken up)", bool(runs), path)


def serve_shift_plot(curves: dict[str, list[dict]], shift: int, path: str | Path):
    """vLLM's acceptance per window of requests, in the order they were sent, one line per run (name -> [{"upto",
    "acceptance"}]), with the traffic shift (the first request of the second domain) as a vertical line. Returns the
    figure."""
    fig, ax = _figure(7, 3.8)
    for n, (name, w) in enumerate(curves.items()):
        ax.plot([p["upto"] for p in w], [p["acceptance"] for p in w], marker="o", markersize=3, color=f"C{n}",
                label=name)
    ax.axvline(shift, color="0.4", linestyle="--", linewidth=1)
    ax.text(shift, 0.02, " traffic shifts", fontsize=8, color="0.3")
    top = max((p["acceptance"] for w in curves.values() for p in w), default=0.0)
    return _acceptance_axes(fig, ax, "requests sent", top,
                            "vLLM's acceptance per window of requests, across a traffic shift", bool(curves), path)
