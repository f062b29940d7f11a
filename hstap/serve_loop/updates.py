"""What `hstap serve-loop` (hstap/serve_loop/stage.py) does between answers, and what it reports at the end.

- `Updater.on_answer`: after every answered request, the store's size is sampled (its peak is reported); every
  --update-every answers, the trainer's newest checkpoint (RUN/checkpoints/step_*), when newer than the one served,
  is exported for vLLM (OUT/exports/vNNNN) and taken up by the server (`hstap_load_drafter` through vLLM's
  /collective_rpc: hstap/serve_loop/worker.py); each update is a line of OUT/updates.jsonl (answers served at that moment,
  trainer step, seconds, the server's check that its fc computes with the new weights). A failed update is recorded
  and serving goes on with the drafter it has. Each answer is tagged with the drafter version serving when it ended.
- `summarize`: requests sent / answered / lost / duplicated, outputs against --reference (lossless), vLLM's acceptance
  (per-request counters summed; checked against the server's aggregate /metrics counters over the run), updates,
  disk (store peak and its bound, exports, run), throughput; OUT/acceptance.png; a table and one summary line.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from hstap.common import one_line
from hstap.serve_loop.config import ServeLoopConfig


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


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



class Updater:
    """See the module docstring."""

    def __init__(self, cfg: ServeLoopConfig, url: str, out: Path, dtype: str, trainer):
        self.cfg, self.url, self.out, self.dtype, self.trainer = cfg, url, out, dtype, trainer
        self.version, self.step = 0, -1  # v0000: the start drafter
        self.updates: list[dict] = []
        self.peak_bytes, self.peak_shards = 0, 0
        (out / "updates.jsonl").write_text("")

    def status(self) -> str:
        from hstap.serve_loop.requests import store_usage

        b, n = store_usage(self.out / "store")
        if self.cfg.mode != "loop":
            return f"drafter fixed ({self.cfg.mode})" if self.cfg.mode == "fixed" else "target only"
        alive = self.trainer is None or self.trainer.poll() is None
        return (f"drafter v{self.version}" + (f" (step {self.step})" if self.step >= 0 else " (start)")
                + f" | store {n} shards {b / 1e6:.1f} MB | trainer step {trainer_step(self.out / 'run')}"
                + ("" if alive else f" EXITED {self.trainer.returncode} (train.log)"))

    def on_answer(self, rec: dict, done: int) -> None:
        from hstap.serve_loop.requests import store_usage

        rec["drafter"] = self.version
        b, n = store_usage(self.out / "store")
        self.peak_bytes, self.peak_shards = max(self.peak_bytes, b), max(self.peak_shards, n)
        if self.cfg.mode == "loop" and done % self.cfg.update_every == 0:
            self.update(done)

    def update(self, done: int) -> None:
        from hstap.serve_loop.requests import post
        ck = newest_checkpoint(self.out / "run")
        if ck is None or ck[0] <= self.step:
            return
        step, src = ck
        dst = self.out / "exports" / f"v{self.version + 1:04d}"
        t0 = time.perf_counter()
        rec = {"served": done, "step": step, "version": self.version + 1, "dir": str(dst)}
        try:
            export_vllm(self.cfg.target, self.cfg.k, src, dst, self.dtype)
            t1 = time.perf_counter()
            res = post(self.url + "/collective_rpc", {"method": "hstap_load_drafter", "args": [str(dst.resolve())]})
            rec.update(export_s=t1 - t0, load_s=time.perf_counter() - t1, server=(res.get("results") or [None])[0])
            prev = self.out / "exports" / f"v{self.version:04d}"
            self.version, self.step = self.version + 1, step
            if prev.name != "v0000":
                shutil.rmtree(prev, ignore_errors=True)  # keep the start drafter and the one served
        except Exception as e:  # noqa: BLE001 - serving goes on with the drafter it has
            rec["error"] = one_line(e)
            shutil.rmtree(dst, ignore_errors=True)
            print(f"serve-loop: drafter update to step {step} failed: {rec['error']}", file=sys.stderr, flush=True)
        self.updates.append(rec)
        with open(self.out / "updates.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def _windows(ok: list[dict], size: int) -> list[dict]:
    """vLLM's acceptance over consecutive windows of `size` answers (finishing order): the plot's points."""
    from hstap.serve_loop.requests import acceptance

    out = []
    for a in range(0, len(ok), size):
        w = ok[a:a + size]
        acc, tau = acceptance(w)
        out.append({"served": w[-1]["served"], "acceptance": acc, "tau": tau, "drafter": w[-1].get("drafter", 0)})
    return out


def _lossless(records: list[dict], ref: dict | None) -> dict | None:
    if ref is None:
        return None
    ok = [r for r in records if "tokens" in r and r["i"] in ref]
    equal = sum(r["tokens"] == ref[r["i"]] for r in ok)
    return {"compared": len(ok), "equal": equal, "differ": [r["i"] for r in ok if r["tokens"] != ref[r["i"]]][:20],
            "lossless": equal == len(ok) and len(ok) > 0}


def _store_block(cfg: ServeLoopConfig, out: Path, up: Updater) -> dict:
    from hstap.store.format import committed_ids_of, load_manifest, store_bytes_per_token

    store = out / "store"
    if not (store / "manifest.json").is_file():
        return {"peak_bytes": up.peak_bytes, "samples_committed": 0}
    m = load_manifest(store)
    per_tok = store_bytes_per_token(len(m["layers"]), int(m["target"]["hidden_size"]), m["dtype"])
    longest = cfg.max_model_len
    return {"peak_bytes": up.peak_bytes, "peak_shard_files": up.peak_shards,
            "bound_bytes": cfg.keep_shards * (cfg.shard_tokens + longest) * per_tok,
            "bytes_at_end": _du(store), "samples_committed": len(committed_ids_of(store)),
            "layers": m["layers"], "dtype": m["dtype"]}


def summarize(cfg: ServeLoopConfig, out: Path, prompts: list, records: list[dict], wall: float, up: Updater,
              before: dict, after: dict, ref: dict | None, started_s: float) -> dict:
    from hstap.serve_loop.requests import acceptance

    ok = [r for r in records if "tokens" in r]
    idx = [r["i"] for r in records]
    ids = [r["id"] for r in ok]
    acc, tau = acceptance(ok)
    diff = {k: after[k] - before.get(k, 0) for k in after if not isinstance(after[k], list)}
    per_req = {k: sum(r.get(k, 0) for r in ok) for k in ("num_draft_tokens", "num_accepted_draft_tokens")}
    gen = sum(len(r["tokens"]) for r in ok)
    s = {"mode": cfg.mode, "drafter": cfg.drafter, "k": cfg.k, "requests": len(prompts), "answered": len(ok),
         "lost": len(prompts) - len(ok), "duplicates": len(idx) - len(set(idx)) + len(ids) - len(set(ids)),
         "wall_s": wall, "server_start_s": started_s, "generated_tokens": gen, "tokens_per_s": gen / wall,
         "requests_per_s": len(ok) / wall, "acceptance": acc, "tau": tau,
         "windows": _windows(ok, cfg.update_every),
         "server_counters": diff, "per_request_sums": per_req,
         "counters_agree": None if cfg.mode == "target" else (
             per_req["num_draft_tokens"] == diff.get("vllm:spec_decode_num_draft_tokens")
             and per_req["num_accepted_draft_tokens"] == diff.get("vllm:spec_decode_num_accepted_tokens")),
         "updates": up.updates, "updates_taken": sum("error" not in u for u in up.updates),
         "lossless": _lossless(records, ref), "store": _store_block(cfg, out, up),
         "disk_bytes": {"exports": _du(out / "exports"), "run": _du(out / "run"), "store": _du(out / "store")}}
    if cfg.mode != "target":
        from hstap.plots import serve_loop_plot

        serve_loop_plot({cfg.mode: s}, out / "acceptance.png")
    w = s["windows"]
    print(f"hstap serve-loop ({cfg.mode}): {s['answered']}/{s['requests']} answered, {s['lost']} lost, "
          f"{s['duplicates']} duplicated, {s['tokens_per_s']:.1f} generated tok/s"
          + (f"; vLLM acceptance {acc:.3f} (tau {tau:.2f}), first {w[0]['acceptance']:.3f} -> last "
             f"{w[-1]['acceptance']:.3f} per {cfg.update_every} answers" if w and cfg.mode != "target" else "")
          + (f"; {s['updates_taken']} drafter updates" if cfg.mode == "loop" else "")
          + (f"; store peak {s['store']['peak_bytes'] / 1e6:.1f} MB (bound "
             f"{s['store'].get('bound_bytes', 0) / 1e6:.1f} MB)" if cfg.mode == "loop" else "")
          + (f"; outputs equal the reference on {s['lossless']['equal']}/{s['lossless']['compared']}"
             if s["lossless"] else ""), flush=True)
    return s
