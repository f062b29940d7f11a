"""What `hstap serve-loop` (hstap/serve_loop/stage.py) does between answers: drafter updates, gated and checked.

`Updater.on_answer` runs after every answered request (serving goes on meanwhile: the requests in flight are the
client pool's). It tags the answer with the drafter version serving when it ended and samples the store's size (its
peak is reported). Then:

- Every --update-every answers, when the trainer has a checkpoint newer than the last one considered
  (RUN/checkpoints/step_*), the candidate is copied (OUT/drafters/vNNNN, hstap format: the trainer deletes old
  checkpoints) and scored against the served drafter on the held-back samples (hstap/serve_loop/gate.py). Only a
  better one is exported for vLLM (OUT/exports/vNNNN) and loaded into the server (`hstap_load_drafter` through vLLM's
  /collective_rpc: hstap/serve_loop/worker.py). --holdout-frac 0 turns the gate off: every newer checkpoint is loaded.
- After a load, once --check-answers answers that started after it have ended, `gate.reload_check` compares their
  acceptance (vLLM's counters) with the answers' just before the load; a failed check loads the previous drafter back
  (a rollback). No update is considered while a check is pending.
- Each decision is a line of OUT/updates.jsonl: answers served then, trainer step, the gate's scores of candidate and
  served drafter on the same samples, load and export seconds, the worker's weight check, the reload check, a rollback.
  A failed export or load is recorded and serving goes on with the drafter it has. Only the start drafter, the served
  one and the one before it (the rollback's) are kept on disk.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from hstap.common import HstapError, one_line
from hstap.serve_loop.config import ServeLoopConfig

BEFORE = 32
"""Answers before a load that the reload check compares with (at most; those that ran wholly on the drafter before)."""


def newest_checkpoint(run: Path) -> tuple[int, Path] | None:
    """(step, dir) of a run's newest complete checkpoint (renamed into place whole by the trainer), or None."""
    best = None
    for d in (run / "checkpoints").glob("step_*") if (run / "checkpoints").is_dir() else []:
        if (d / "drafter.safetensors").is_file() and (d / "drafter.json").is_file():
            step = int(d.name.split("_")[1])
            best = max(best or (step, d), (step, d))
    return best


def trainer_step(run: Path) -> int:
    """The trainer's latest logged step (RUN/metrics.jsonl), 0 before its first."""
    p = run / "metrics.jsonl"
    if not p.is_file():
        return 0
    step = 0
    for line in p.read_text().splitlines()[-5:]:
        try:
            step = max(step, int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            continue
    return step


def export_vllm(target: str, k: int, src: Path, dst: Path, dtype: str) -> None:
    """`hstap export --to vllm` of an hstap drafter directory for `target`, drafting `k` tokens, quietly (its line goes
    nowhere)."""
    import contextlib
    import io

    from hstap.export.config import ExportConfig
    from hstap.export.stage import export

    with contextlib.redirect_stdout(io.StringIO()):
        export(ExportConfig(run=str(src), to="vllm", out=str(dst), dtype=dtype, target=target,
                            speculative_tokens=k, overwrite=True))


def started(rec: dict) -> float:
    """When a request was sent, on the stream's clock (seconds since it began)."""
    return rec["t_s"] - rec.get("latency_s", 0.0)


class Updater:
    """See the module docstring. `drafter0`: the start drafter (hstap format), served as v0000."""

    def __init__(self, cfg: ServeLoopConfig, url: str, out: Path, dtype: str, trainer, drafter0: Path | None,
                 clock=None):
        from hstap.serve_loop.gate import HeldBack

        self.cfg, self.url, self.out, self.dtype, self.trainer = cfg, url, out, dtype, trainer
        self.clock = clock or (lambda: 0.0)  # the stream's clock (seconds since its start): loads are dated by it
        self.version, self.step, self.considered = 0, -1, -1  # v0000: the start drafter
        self.hstap_dirs = {0: drafter0}  # version -> its hstap-format drafter (the gate scores it)
        self.history: list[tuple[int, int, float]] = [(0, -1, 0.0)]  # (version, step, loaded at) of every load
        self.pending: dict | None = None  # the update whose reload check is waiting for answers
        self.answers: list[dict] = []
        self.updates: list[dict] = []
        self.peak_bytes, self.peak_shards = 0, 0
        self.held = HeldBack(out / "store", cfg.stream.holdout_frac, cfg.gate_samples)
        self._head = None
        (out / "updates.jsonl").write_text("")

    def status(self) -> str:
        from hstap.serve_loop.requests import store_usage

        b, n = store_usage(self.out / "store")
        if self.cfg.mode != "loop":
            return f"drafter fixed ({self.cfg.mode})" if self.cfg.mode == "fixed" else "target only"
        alive = self.trainer is None or self.trainer.poll() is None
        return (f"drafter v{self.version}" + (f" (step {self.step})" if self.step >= 0 else " (start)")
                + f" | store {n} shards {b / 1e6:.1f} MB | trainer step {trainer_step(self.out / 'run')}"
                + f" | held back {len(self.held.samples)}"
                + ("" if alive else f" EXITED {self.trainer.returncode} (train.log)"))

    def on_answer(self, rec: dict, done: int) -> None:
        from hstap.serve_loop.requests import store_usage

        rec["drafter"] = self.version
        b, n = store_usage(self.out / "store")
        self.peak_bytes, self.peak_shards = max(self.peak_bytes, b), max(self.peak_shards, n)
        if self.cfg.mode != "loop":
            return
        if "tokens" in rec:
            self.answers.append(rec)
        self.check_running(tap=done % self.cfg.update_every == 0)
        self.held.refresh()  # every answer: a shard the trainer consumes soon must be read before it goes
        if self.pending is not None:
            self._check(done)
        elif done % self.cfg.update_every == 0:
            self.update(done)

    def check_running(self, tap: bool = True) -> None:
        """--mode loop: a trainer that exited on an error, or a tap whose writer thread stopped (`tap`: checked too),
        fails the run in one line naming its log: serving on would report a loop that learns nothing as a success."""
        from hstap.capture.served import stopped_writer
        from hstap.capture.vllm.protocol import EVENTS_DIR

        if self.cfg.mode != "loop":
            return
        rc = self.trainer.poll() if self.trainer is not None else None
        if rc not in (None, 0):
            log = self.out / "train.log"
            last = [x for x in (log.read_text(errors="replace") if log.is_file() else "").splitlines() if x.strip()]
            raise HstapError(f"{log}: the trainer exited with status {rc} after {len(self.answers)} answers"
                             + (f": {last[-1].strip()[:300]}" if last else ""))
        why = stopped_writer(self.out / "store", EVENTS_DIR) if tap else None
        if why is not None:
            raise HstapError(f"{self.out / 'server.log'}: the tap beside vLLM stopped writing the store ({why[:300]}): "
                             f"the trainer gets no traffic after {len(self.answers)} answers")

    def _log(self, rec: dict) -> None:
        self.updates.append(rec)
        with open(self.out / "updates.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _target_head(self):
        if self._head is None:
            from hstap.artifacts.model_dir import target_head

            e, h = target_head(self.cfg.target)
            self._head = (e.float(), h.float())
        return self._head

    def _gate(self, cand: Path) -> dict:
        """The gate's scores of `cand` and the served drafter on the same held-back samples, and its decision."""
        from hstap.serve_loop.gate import score_drafter

        if self.cfg.stream.holdout_frac <= 0:
            return {"decision": "load", "why": "no gate (--holdout-frac 0)"}
        samples = list(self.held.samples)
        if len(samples) < self.cfg.gate_min_samples:
            return {"decision": "wait", "why": f"{len(samples)} held-back samples (< --gate-min-samples "
                                               f"{self.cfg.gate_min_samples})"}
        import torch

        layers = json.loads((self.out / "store" / "manifest.json").read_text())["layers"]
        embed, head = self._target_head()
        with torch.no_grad():
            new = score_drafter(cand, samples, layers, embed, head, self.cfg.k)
            old = score_drafter(self.hstap_dirs[self.version], samples, layers, embed, head, self.cfg.k)
        better = new["sim_tau"] > old["sim_tau"]
        return {"decision": "load" if better else "refuse", "candidate_sim_tau": new["sim_tau"],
                "served_sim_tau": old["sim_tau"], "samples": new["samples"], "positions": new["positions"],
                "held_ids": [x["id"] for x in samples]}

    def update(self, done: int) -> None:
        ck = newest_checkpoint(self.out / "run")
        if ck is None or ck[0] <= self.considered:
            return
        step, src = ck
        v = self.version + 1
        mine = self.out / "drafters" / f"v{v:04d}"
        rec = {"served": done, "step": step, "version": v, "from_version": self.version}
        t0 = time.perf_counter()
        try:
            shutil.rmtree(mine, ignore_errors=True)
            shutil.copytree(src, mine)  # the trainer deletes its older checkpoints: the gate and a rollback need it
            self.considered = step
            gate = self._gate(mine)
            rec.update(gate=gate, gate_s=time.perf_counter() - t0)
            if gate["decision"] == "wait":
                self.considered = step - 1  # not judged: the same checkpoint is considered again
                shutil.rmtree(mine, ignore_errors=True)
                return  # nothing logged: the next --update-every tries again
            if gate["decision"] != "load":
                shutil.rmtree(mine, ignore_errors=True)
                self._log(rec)
                return
            rec.update(self.load(v, mine, step))
        except Exception as e:  # noqa: BLE001 - serving goes on with the drafter it has
            rec["error"] = one_line(e)
            shutil.rmtree(mine, ignore_errors=True)
            shutil.rmtree(self.out / "exports" / f"v{v:04d}", ignore_errors=True)
            print(f"serve-loop: drafter update to step {step} failed: {rec['error']}", file=sys.stderr, flush=True)
        self._log(rec)

    def load(self, v: int, hstap_dir: Path, step: int) -> dict:
        """Export `hstap_dir` as version v and load it into the server; it serves from here on, and its reload check
        is pending."""
        from hstap.serve_loop.requests import post

        dst = self.out / "exports" / f"v{v:04d}"
        t0 = time.perf_counter()
        export_vllm(self.cfg.target, self.cfg.k, hstap_dir, dst, self.dtype)
        t1 = time.perf_counter()
        res = post(self.url + "/collective_rpc", {"method": "hstap_load_drafter", "args": [str(dst.resolve())]})
        self.version, self.step, self.hstap_dirs[v] = v, step, hstap_dir
        self.history.append((v, step, self.clock()))
        self.pending = {"version": v}
        self._prune()
        return {"export_s": t1 - t0, "load_s": time.perf_counter() - t1, "loaded_at_s": self.clock(),
                "server": (res.get("results") or [None])[0]}

    def _prune(self) -> None:
        """Keep the start drafter, the served one and the one before it; delete the rest (exports and copies)."""
        keep = {0, self.version, self.history[-2][0] if len(self.history) > 1 else 0}
        for v in [v for v in self.hstap_dirs if v not in keep]:
            if v:
                shutil.rmtree(self.hstap_dirs.pop(v), ignore_errors=True)
                shutil.rmtree(self.out / "exports" / f"v{v:04d}", ignore_errors=True)

    def _check(self, done: int) -> None:
        """The pending load's reload check, once --check-answers answers that started after it ended; a rollback when
        it fails (module docstring)."""
        from hstap.serve_loop.gate import reload_check

        at = self.history[-1][2]
        after = [r for r in self.answers if started(r) >= at]
        if len(after) < self.cfg.check_answers:
            return
        before = [r for r in self.answers if r["t_s"] <= at][-BEFORE:]
        check = reload_check(before, after, self.cfg.rollback_ratio)
        rec = {"served": done, "check_of_version": self.version, "check": check}
        if not check["ok"]:
            prev = self.history[-2][0]
            try:
                rec["rollback"] = {"to_version": prev, **self._load_back(prev)}
            except Exception as e:  # noqa: BLE001 - serving goes on; the next update tries again
                rec["rollback_error"] = one_line(e)
            print(f"serve-loop: drafter v{rec['check_of_version']} failed its check (acceptance "
                  f"{check['acceptance']:.3f} after, {check['before']:.3f} before): back to v{prev}",
                  file=sys.stderr, flush=True)
        self.pending = None
        self._log(rec)

    def _load_back(self, v: int) -> dict:
        """Load version v (kept on disk) back into the server (a rollback)."""
        from hstap.serve_loop.requests import post

        dst = self.out / "exports" / f"v{v:04d}"
        t0 = time.perf_counter()
        res = post(self.url + "/collective_rpc", {"method": "hstap_load_drafter", "args": [str(dst.resolve())]})
        step = next(s for ver, s, _ in self.history if ver == v)
        self.version, self.step = v, step
        self.history.append((v, step, self.clock()))
        return {"load_s": time.perf_counter() - t0, "server": (res.get("results") or [None])[0]}
