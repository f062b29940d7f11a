"""The client side of `hstap serve-loop` (hstap/serve_loop/stage.py): a bounded stream of requests against a vLLM server
(`/v1/completions`, prompts as token ids, greedy), the per-request acceptance vLLM reports, the server's counters, the
store's size on disk, and the progress line.

- Every prompt is sent exactly once and never retried: an answer is recorded once, by prompt index; a request that
  fails (HTTP error, timeout) is recorded as lost, not sent again. `served.jsonl` (one line per finished request, in
  the order they finished) and the summary count both.
- Acceptance is vLLM's own: the server runs with `--per-request-spec-decode-metrics summary`, so each answer carries
  `metrics.speculative_decoding` (draft tokens proposed, accepted, verify steps, for that request alone: vLLM's
  `RequestSpecDecodeMetrics`), and `/metrics` holds the aggregate `vllm:spec_decode_*` counters (`server_counters`),
  whose totals over a run the summary checks against the sum of the per-request ones.
- acceptance = accepted draft tokens / proposed draft tokens (vLLM's `draft_acceptance_rate`); tau = 1 + accepted /
  verify steps (vLLM's `mean_acceptance_length`, the bonus token included: hstap's tau).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

SPEC = ("num_draft_tokens", "num_accepted_draft_tokens", "num_spec_steps")
"""The per-request counters of vLLM's `metrics.speculative_decoding` that hstap sums."""


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def server_counters(url: str) -> dict:
    """vLLM's `vllm:spec_decode_*` counters from /metrics: {name: total} (summed over label sets), accepted per
    position as a list."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_") or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0].removesuffix("_total")
        if base == "vllm:spec_decode_num_accepted_tokens_per_pos":
            m = re.search(r'position="(\d+)"', name)
            if m:
                per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + float(value)
        elif not name.split("{")[0].endswith("_created"):
            out[base] = out.get(base, 0.0) + float(value)
    out["vllm:spec_decode_num_accepted_tokens_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def store_usage(store: Path) -> tuple[int, int]:
    """(bytes of every file under the store, shard files on disk); (0, 0) before it exists."""
    total, shards = 0, 0
    for root, _, files in os.walk(store):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:  # a consumed shard deleted while we walk
                continue
            shards += os.path.basename(root) == "shards" and not f.startswith(".")
    return total, shards


class Client:
    """One server, greedy completions of token-id prompts (module docstring)."""

    def __init__(self, url: str, max_tokens: int, stop_ids: list[int], seed: int, timeout: float = 600.0):
        self.url, self.max_tokens, self.stop_ids, self.seed, self.timeout = url, max_tokens, stop_ids, seed, timeout
        self.model = served_model(url)

    def complete(self, i: int, prompt: list[int]) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "stop_token_ids": self.stop_ids, "return_token_ids": True, "seed": self.seed}
        t0 = time.perf_counter()
        try:
            r = post(self.url + "/v1/completions", body, self.timeout)
        except (urllib.error.URLError, OSError, ValueError) as e:
            return {"i": i, "error": f"{type(e).__name__}: {e}"[:300], "latency_s": time.perf_counter() - t0}
        choice = r["choices"][0]
        spec = ((r.get("metrics") or {}).get("speculative_decoding") or {})
        return {"i": i, "id": r.get("id"), "tokens": list(choice.get("token_ids") or []),
                "finish": choice.get("finish_reason"), "latency_s": time.perf_counter() - t0,
                **{k: int(spec.get(k, 0)) for k in SPEC}}


def acceptance(recs: list[dict]) -> tuple[float, float]:
    """(acceptance, tau) over answered records: accepted / proposed draft tokens, 1 + accepted / verify steps."""
    drafted = sum(r.get("num_draft_tokens", 0) for r in recs)
    accepted = sum(r.get("num_accepted_draft_tokens", 0) for r in recs)
    steps = sum(r.get("num_spec_steps", 0) for r in recs)
    return (accepted / drafted if drafted else 0.0), (1 + accepted / steps if steps else 1.0)


class Stream:
    """The request loop: `prompts` sent in order, `concurrency` in flight; `on_answer(rec, done)` runs in the calling
    thread after each finished request (drafter updates happen there: serving goes on meanwhile), then the record goes
    to `log_path` (served.jsonl). A progress line on stderr at most every `every_s` seconds."""

    def __init__(self, client: Client, prompts: list[list[int]], concurrency: int, log_path: Path,
                 status: Callable[[], str] = lambda: "", window: int = 32, every_s: float = 2.0):
        self.client, self.prompts, self.concurrency = client, prompts, concurrency
        self.log_path, self.status, self.window, self.every_s = log_path, status, window, every_s
        self.t0 = time.perf_counter()
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._last = 0.0

    def run(self, on_answer: Callable[[dict, int], None]) -> tuple[list[dict], float]:
        """(records in finishing order, wall seconds)."""
        t0 = self.t0 = time.perf_counter()
        with open(self.log_path, "w") as log, ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(self.client.complete, i, p) for i, p in enumerate(self.prompts)]
            try:
                for fut in as_completed(futures):
                    rec = fut.result()
                    rec["t_s"] = time.perf_counter() - t0
                    self.records.append(rec)
                    rec["served"] = len(self.records)
                    on_answer(rec, len(self.records))  # it may tag the record (the drafter serving) before it is logged
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    self._progress(time.perf_counter() - t0)
            except BaseException:  # a failed run (on_answer's error, Ctrl-C): the requests not yet sent are not sent
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        wall = time.perf_counter() - t0
        self._progress(wall, force=True)
        return self.records, wall

    def clock(self) -> float:
        """Seconds since the stream began (the records' t_s)."""
        return time.perf_counter() - self.t0

    def _progress(self, elapsed: float, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        ok = [r for r in self.records if "error" not in r]
        acc, tau = acceptance(ok[-self.window:])
        lost = len(self.records) - len(ok)
        rate = len(self.records) / max(elapsed, 1e-9)
        print(f"serve-loop: {len(self.records)}/{len(self.prompts)} served ({rate:.2f} "
              f"req/s{f', {lost} lost' if lost else ''}) | vLLM acceptance {acc:.3f}, tau {tau:.2f} (last "
              f"{min(self.window, len(ok))}) | {self.status()}", file=sys.stderr, flush=True)
