"""The PNG figures: the eval's per-position acceptance (chain and tree labels, integer ticks) and a run's curves."""

import json

from hstap.plots import acceptance_plot, read_metrics, training_curves

PNG = b"\x89PNG\r\n\x1a\n"
RESULTS = {"target": {"tau": 1.0}, "ngram": {"tau": 1.2, "per_position_acceptance": [0.2, 0.05, 0.0]},
           "eagle": {"tau": 1.9, "per_position_acceptance": [0.6, 0.3, 0.1]}}


def test_acceptance_plot_chain_and_tree(tmp_path):
    for mode, label in (("chain", "draft position in the chain"), ("tree", "draft tree depth")):
        fig = acceptance_plot(RESULTS, mode, tmp_path / f"{mode}.png")
        assert (tmp_path / f"{mode}.png").read_bytes()[:8] == PNG
        ax = fig.axes[0]
        assert ax.get_xlabel() == label and len(ax.lines) == 2  # the target-only method has nothing to plot
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
        assert ticks and all(float(t).is_integer() for t in ticks)  # positions are whole numbers
    fig = acceptance_plot({"target": {"tau": 1.0}}, "chain", tmp_path / "none.png")  # still written, with a note
    assert (tmp_path / "none.png").read_bytes()[:8] == PNG and "no drafting method" in fig.axes[0].texts[0].get_text()


def test_training_curves_from_metrics(tmp_path):
    lines = [{"step": s, "loss": 10.0 / s, "acc": [0.1 * s, 0.0]} for s in range(1, 6)]
    lines += [{"step": 5, "eval": True, "eval_loss": 2.5, "eval_acc": [0.4, 0.1], "sim_tau": 1.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 6, "lo')
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert len(train) == 5 and len(evals) == 1  # the torn last line of a killed run is skipped
    fig = training_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    loss, acc, tau = fig.axes
    assert list(loss.lines[0].get_xdata()) == [1, 2, 3, 4, 5] and list(tau.lines[0].get_ydata()) == [1.6]
    assert "tau" in tau.get_title() and loss.get_xlabel() == "optimizer step"


def test_serve_loop_plot_one_line_per_run_and_update_ticks(tmp_path):
    from hstap.plots import serve_loop_plot

    win = [{"served": 8 * i, "acceptance": 0.1 * i} for i in range(1, 5)]
    ups = [{"served": 8, "load_s": 0.1}, {"served": 12, "gate": {"decision": "refuse"}}, {"served": 16, "load_s": 0.1},
           {"served": 20, "check": {"ok": True}}, {"served": 24, "error": "x"}]  # ticks: the loads alone
    runs = {"loop": {"windows": win, "acceptance": 0.2, "tau": 1.5, "updates": ups},
            "fixed": {"windows": win[:2], "acceptance": 0.15, "tau": 1.4}}
    fig = serve_loop_plot(runs, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG
    lines = fig.axes[0].lines
    assert len(lines) == 3 and list(lines[1].get_xdata()) == [8, 16]  # two runs + the loop's taken updates
