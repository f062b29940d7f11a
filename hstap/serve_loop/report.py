"""What `hstap serve-loop` (hstap/serve_loop/stage.py) reports at the end: `summarize` counts requests sent / answered /
lost / duplicated, compares outputs with --reference (lossless), sums vLLM's acceptance (per-request counters, checked
against the server's aggregate /metrics counters over the run) per window of answers, lists the updates (taken,
refused by the gate, rolled back), the disk (store peak and its bound, exports, run), throughput and the time from an
answer to a served drafter that learned from it (`learned_after`); it writes OUT/acceptance.png and prints one line.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from hstap.serve_loop.config import ServeLoopConfig
from hstap.serve_loop.updates import Updater


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


REQUEST_ID = re.compile(r"(cmpl-[0-9A-Za-z]+)")
"""The OpenAI request id inside a tapped sample's id (tap-SESSION-<vLLM request id>, which extends it)."""


def learned_after(out: Path, ok: list[dict], history: list[tuple[int, int, float]]) -> dict:
    """Seconds from a request's answer to the first load of a drafter whose trainer had trained on it (its first step
    in RUN/follow.jsonl <= the loaded checkpoint's step), over the tapped requests that reached one; rollbacks and
    the start drafter do not count."""
    first: dict[str, int] = {}
    p = out / "run" / "follow.jsonl"
    for line in p.read_text().splitlines() if p.is_file() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        for sid in r.get("ids", []):
            m = REQUEST_ID.search(sid)
            if m:
                first.setdefault(m.group(1), int(r["step"]))
    loads, seen = [], set()
    for v, step, at in history:
        if v and v not in seen:
            seen.add(v)
            loads.append((step, at))
    lat = []
    for rec in ok:
        s = first.get(rec.get("id"))
        t = next((at for step, at in loads if s is not None and step >= s and at >= rec["t_s"]), None)
        if t is not None:
            lat.append(t - rec["t_s"])
    lat.sort()
    return {"requests_trained": len(first), "reached_serving": len(lat),
            "median_s": statistics.median(lat) if lat else None,
            "p90_s": lat[int(0.9 * (len(lat) - 1))] if lat else None}


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
    from hstap.store.format import store_bytes_per_token
    from hstap.store.manifest import committed_ids_of, load_manifest

    store = out / "store"
    if not (store / "manifest.json").is_file():
        return {"peak_bytes": up.peak_bytes, "samples_committed": 0}
    m = load_manifest(store)
    per_tok = store_bytes_per_token(len(m["layers"]), int(m["target"]["hidden_size"]), m["dtype"])
    longest = cfg.max_model_len
    return {"peak_bytes": up.peak_bytes, "peak_shard_files": up.peak_shards,
            "bound_bytes": cfg.stream.keep_shards * (cfg.shard_tokens + longest) * per_tok,
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
         "updates": up.updates, "updates_taken": sum("load_s" in u and "error" not in u for u in up.updates),
         "lossless": _lossless(records, ref), "store": _store_block(cfg, out, up),
         "disk_bytes": {"exports": _du(out / "exports"), "run": _du(out / "run"), "store": _du(out / "store")}}
    if cfg.mode == "loop":
        s["gate"] = {"refused": sum(u.get("gate", {}).get("decision") == "refuse" for u in up.updates),
                     "rolled_back": sum("rollback" in u for u in up.updates),
                     "held_back_missed": up.held.missed}
        s["learned_after"] = learned_after(out, ok, up.history)
    if cfg.mode != "target":  # the drafter serving at the end (hstap format): what a later run can serve fixed
        s["final_drafter"] = str(Path(up.hstap_dirs[up.version]).resolve())
    if cfg.mode != "target":
        from hstap.plots import serve_loop_plot

        serve_loop_plot({cfg.mode: s}, out / "acceptance.png")
    w = s["windows"]
    print(f"hstap serve-loop ({cfg.mode}): {s['answered']}/{s['requests']} answered, {s['lost']} lost, "
          f"{s['duplicates']} duplicated, {s['tokens_per_s']:.1f} generated tok/s"
          + (f"; vLLM acceptance {acc:.3f} (tau {tau:.2f}), first {w[0]['acceptance']:.3f} -> last "
             f"{w[-1]['acceptance']:.3f} per {cfg.update_every} answers" if w and cfg.mode != "target" else "")
          + (f"; {s['updates_taken']} drafter updates loaded, {s['gate']['refused']} refused by the gate, "
             f"{s['gate']['rolled_back']} rolled back" if cfg.mode == "loop" else "")
          + (f"; store peak {s['store']['peak_bytes'] / 1e6:.1f} MB (bound "
             f"{s['store'].get('bound_bytes', 0) / 1e6:.1f} MB)" if cfg.mode == "loop" else "")
          + (f"; outputs equal the reference on {s['lossless']['equal']}/{s['lossless']['compared']}"
             if s["lossless"] else ""), flush=True)
    return s
