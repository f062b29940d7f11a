"""The `sglang` engine's driver: `hstap capture --engine sglang --server URL` (runs in the hstap process).

`run_sglang_capture(cfg)` checks the server's settings (`server_info`, `server_problems`), sends prefill-only
`/generate` requests and waits until the server-side hook (capture/sglang/hook.py) committed each sample (the store is
shared). Request ids, the hook spec and the events directory come from capture/sglang/protocol.py; this module never
imports the hook's, nor the `sglang` package, and the server process never loads this one.
"""

from __future__ import annotations

import collections
import fcntl
import fnmatch
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hstap.capture.sglang.protocol import ENV_LAYERS, EVENTS_DIR, HOOK_FACTORY, encode_rid, end_marker, hook_spec
from hstap.capture.stage import check_template, check_tokenizer, copy_vocab_map, short_id, store_header
from hstap.common import HstapError, atomic_write_json, write_run_config
from hstap.data.prepare import load_prepared, prepared_columns, read_meta
from hstap.layers import parse_layers, to_sglang
from hstap.model_dir import target_fingerprint
from hstap.store.format import committed_ids_of, load_manifest, load_parts, merge_manifest, writing_state
from hstap.store.writer import StoreWriter


def _http(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def server_info(server: str) -> dict:
    """GET /server_info (0.5.10+), falling back to the older /get_server_info."""
    last: Exception | None = None
    for path in ("/server_info", "/get_server_info"):
        try:
            return _http(server.rstrip("/") + path)
        except urllib.error.HTTPError as e:
            last = e
            if e.code != 404:
                break
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise HstapError(f"--server {server}: cannot reach the SGLang server ({e})") from None
    raise HstapError(f"--server {server}: /server_info failed ({last})")


def server_problems(info: dict, store: str, data: str, layers: list[int], model_type: str = "llama") -> list[str]:
    """Settings of a running server that would make the capture wrong or hang, each with its fix."""
    p: list[str] = []
    spec = json.dumps(hook_spec(store, data, layers))
    hooks = [h for h in (info.get("forward_hooks") or [])
             if isinstance(h, dict) and h.get("hook_factory") == HOOK_FACTORY]
    if not hooks:
        p.append(f"the hstap forward hook is not configured: relaunch with --forward-hooks '[{spec}]'")
    for h in hooks:
        c = h.get("config") or {}
        if not any(fnmatch.fnmatch("logits_processor", t) for t in h.get("target_modules") or []):
            p.append("the hstap forward hook must target the module 'logits_processor' "
                     "(\"target_modules\": [\"logits_processor\"])")
        for k, want in (("store", os.path.abspath(store)), ("data", os.path.abspath(data)), ("layers", list(layers))):
            got = c.get(k)
            if (os.path.abspath(got) if k != "layers" and isinstance(got, str) else got) != want:
                p.append(f"the hook's config.{k} is {got!r}, this run needs {want!r}: relaunch with --forward-hooks "
                         f"'[{spec}]'")
    graph = info.get("cuda_graph_config")
    prefill_backend = (graph.get("prefill") or {}).get("backend") if isinstance(graph, dict) else None
    if info.get("disable_cuda_graph"):
        pass
    elif prefill_backend is not None:
        if str(prefill_backend).lower() != "disabled":
            p.append(f"prefill CUDA graphs are on (backend {prefill_backend}): forward hooks do not run on graph "
                     "replay; add --disable-prefill-cuda-graph")
    elif "disable_prefill_cuda_graph" in info:
        if not info["disable_prefill_cuda_graph"]:
            p.append("prefill CUDA graphs are on: forward hooks do not run on graph replay; "
                     "add --disable-prefill-cuda-graph")
    elif "disable_piecewise_cuda_graph" in info and not info["disable_piecewise_cuda_graph"]:
        p.append("piecewise (prefill) CUDA graphs are on: hooks do not run on replay; "
                 "add --disable-piecewise-cuda-graph")
    if info.get("enable_mixed_chunk"):
        p.append("mixed chunks are on: drop --enable-mixed-chunk (prefill and decode rows share a batch)")
    if info.get("enable_pdmux"):
        p.append("PD multiplexing (--enable-pdmux) runs split prefills without aux hidden states: drop it")
    if info.get("enable_two_batch_overlap"):
        p.append("two-batch overlap is on: layers run through TBO skip the aux capture; "
                 "drop --enable-two-batch-overlap")
    if int(info.get("pp_size") or 1) > 1:
        p.append(f"pipeline parallelism (--pp-size {info.get('pp_size')}) is not supported: use --pp-size 1")
    if info.get("speculative_algorithm"):
        p.append(f"speculative decoding ({info['speculative_algorithm']}) is on: capture needs no draft and "
                 "prefill-only requests are not available under it; drop --speculative-algorithm and the draft model")
    if info.get("enable_return_aux_hidden_states"):
        want = to_sglang(layers, model_type)
        got = info.get("return_aux_hidden_state_layer_ids")
        if got is not None and list(got) != list(want):
            p.append(f"--return-aux-hidden-state-layer-ids is {got}, canonical layers {layers} need {want} "
                     f"(or drop --enable-return-aux-hidden-states and set {ENV_LAYERS}={','.join(map(str, layers))})")
    return p


def _read_events(store: str) -> list[dict]:
    out = []
    d = Path(store) / EVENTS_DIR
    if d.is_dir():
        for f in sorted(d.glob("*.jsonl")):
            for line in f.read_text(errors="replace").splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
    return out


def run_sglang_capture(cfg, poll_s: float = 0.5, commit_timeout_s: float = 300.0,
                       request_timeout_s: float = 3600.0) -> dict:
    """`hstap capture --engine sglang --server URL`: cfg is a CaptureConfig (target, data, out, layers, dtype, new,
    max_samples, shard_tokens, server, concurrency). Returns the summary dict it prints."""
    if not cfg.server:
        raise HstapError("--server: required with --engine sglang (e.g. http://127.0.0.1:30000)")
    t0 = time.perf_counter()
    server = cfg.server.rstrip("/")
    meta = read_meta(cfg.data)
    ds = load_prepared(cfg.data)
    n = len(ds) if cfg.max_samples is None else min(len(ds), cfg.max_samples)
    target_block = target_fingerprint(cfg.target)
    check_tokenizer(cfg.data, meta, target_block)
    check_template(cfg.data, meta, target_block, cfg.allow_template_mismatch)
    layers = parse_layers(cfg.layers, target_block["num_layers"])
    info = server_info(server)
    problems = server_problems(info, cfg.out, cfg.data, layers, target_block["model_type"])
    if problems:
        raise HstapError(f"--server {server}: " + "; ".join(problems))
    ctx = int(info.get("context_length") or 0)
    engine = {"name": "sglang", "version": str(info.get("version")), "device": f"server {server}",
              "compute_dtype": str(info.get("dtype")), "model_path": info.get("model_path")}
    header = store_header(target_block, engine, cfg.dtype, layers, cfg, meta)
    # create / check only: the hook's writers own the ranks (one per attention-DP rank) and write the shards
    writers = int(info.get("dp_size") or 1) if info.get("enable_dp_attention") else 1
    StoreWriter(cfg.out, header, new=cfg.new, shard_tokens=cfg.shard_tokens, world_size=writers, claim=False).close()
    copy_vocab_map(cfg.data, cfg.out)
    lock = _lock_events(cfg.out, cfg.new)
    session = uuid.uuid4().hex[:12]
    t_wall0 = time.time() - 1.0  # events older than this run belong to earlier runs

    committed = committed_ids_of(cfg.out)  # consumed shards included: a following trainer may have deleted some
    ids, lens = prepared_columns(ds, n)
    too_long = [i for i in range(n) if ctx and lens[i] > ctx]
    todo = [i for i in range(n) if ids[i] not in committed and lens[i] > 0 and not (ctx and lens[i] > ctx)]
    skipped = sum(1 for i in range(n) if ids[i] in committed)
    run = _Requests(server, cfg.out, session, ids, t_wall0, cfg.concurrency, poll_s, request_timeout_s)
    run.send_all(todo, lambda i: list(ds[i]["input_ids"]))
    run.wait_for_commits(commit_timeout_s)
    closed = _end_session(cfg.out, session, poll_s, min(commit_timeout_s, 60.0)) if not (run.errors or run.pending) \
        else False
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    summary_store = merge_manifest(cfg.out)
    errors, pending, dropped = run.errors, run.pending, run.dropped
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise HstapError(f"--server {server}: {errors[0]}{more}")
    if pending:
        raise HstapError(f"{cfg.out}: {len(pending)} sample(s) were answered by the server but never committed by its "
                         f"hook within {commit_timeout_s:.0f} s (e.g. {short_id(sorted(pending)[0])}); is the hook "
                         f"writing to this directory? re-run to resume")
    write_run_config(cfg.out, "capture", cfg)
    reasons = collections.Counter(v.split(":")[0] for v in dropped.values())
    summary = {"samples": len(todo) - len(dropped), "tokens": sum(lens[i] for i in todo if ids[i] not in dropped),
               "skipped_committed": skipped, "skipped_too_long": len(too_long), "dropped": dict(reasons),
               "seconds": round(time.perf_counter() - t0, 3), "layers": layers, "dtype": cfg.dtype, "out": cfg.out,
               "store_samples": summary_store["samples"], "server": server, "session": session,
               "writers_closed": closed}
    print(f"capture: {summary['samples']} samples via SGLang {engine['version']} at {server} in "
          f"{summary['seconds']:.1f} s; {skipped} already in the store, {len(too_long)} longer than the context, "
          f"dropped {dict(reasons) or 0}")
    for sid, why in list(dropped.items())[:5]:
        print(f"capture: dropped {short_id(sid)}: {why}")
    if not closed:
        print(f"capture: the server's hook did not close every store rank (writers {writers}); a trainer following "
              f"{cfg.out} will keep waiting for it")
    return summary


def _end_session(out: str, session: str, poll_s: float, timeout_s: float) -> bool:
    """Tell the hook that this session wrote everything (`end_marker`) and wait until every store rank is closed
    (the end of writing a `hstap train --follow` waits on). Returns whether they all closed within `timeout_s`."""
    atomic_write_json(Path(out) / EVENTS_DIR / end_marker(session), {"session": session, "t": time.time()})
    deadline = time.monotonic() + timeout_s
    while True:
        ranks, finished = writing_state(load_manifest(Path(out)), load_parts(Path(out)))
        if len(finished) == ranks:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def _lock_events(out: str, new: bool):
    """Create STORE/sglang-events (emptied with --new) and take its driver lock: one driver per store at a time."""
    events_dir = Path(out) / EVENTS_DIR
    if new and events_dir.exists():
        shutil.rmtree(events_dir)
    events_dir.mkdir(exist_ok=True)
    lock = open(events_dir / "driver.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise HstapError(f"{out}: another hstap capture is driving a server into this store") from None
    return lock


class _Requests:
    """The prefill-only requests of one session, `concurrency` in flight, and what the hook reports back: `pending`
    (sample ids sent or to send and not committed yet), `dropped` (id -> reason) and `errors` (the run stops at the
    first)."""

    def __init__(self, server: str, store: str, session: str, ids: list[str], t_wall0: float, concurrency: int,
                 poll_s: float, request_timeout_s: float):
        self.server, self.store, self.session, self.ids, self.t_wall0 = server, store, session, ids, t_wall0
        self.concurrency, self.poll_s, self.request_timeout_s = concurrency, poll_s, request_timeout_s
        self.errors: list[str] = []
        self.pending: set[str] = set()
        self.dropped: dict[str, str] = {}
        self.last_progress = time.monotonic()
        self.sem = threading.BoundedSemaphore(concurrency)

    def send_all(self, todo: list[int], input_ids) -> None:
        """Send rows `todo` (`input_ids(row)` gives a row's tokens), polling the store while requests are in flight."""
        self.pending = {self.ids[i] for i in todo}
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            next_poll = time.monotonic() + self.poll_s
            for i in todo:
                while not self.sem.acquire(timeout=self.poll_s):
                    self.poll()
                if self.errors:
                    self.sem.release()
                    break
                pool.submit(self.send, i, input_ids(i))
                if time.monotonic() > next_poll:
                    self.poll()
                    next_poll = time.monotonic() + self.poll_s

    def wait_for_commits(self, commit_timeout_s: float) -> None:
        """Poll until every pending sample is committed or dropped, an error came, or nothing moved for the timeout."""
        self.last_progress = time.monotonic()
        while self.pending and not self.errors and time.monotonic() - self.last_progress < commit_timeout_s:
            self.poll()
            if self.pending:
                time.sleep(self.poll_s)

    def send(self, row: int, input_ids: list[int]) -> None:
        sid = self.ids[row]
        try:
            for attempt in range(3):
                body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0},
                        "rid": encode_rid(self.session, row, sid, attempt),
                        # its own radix-cache namespace: no prefix hits, so the radix cache can stay on
                        "extra_key": uuid.uuid4().hex}
                try:
                    r = _http(self.server + "/generate", body, timeout=self.request_timeout_s)
                    got = (r.get("meta_info") or {}).get("prompt_tokens")
                    if got is not None and int(got) != len(input_ids):
                        self.errors.append(f"sample {short_id(sid)}: the server ran {got} of its "
                                           f"{len(input_ids)} tokens")
                    return
                except urllib.error.HTTPError as e:
                    self.errors.append(f"sample {short_id(sid)}: HTTP {e.code}: {e.read()[:300]!r}")
                    return
                except (urllib.error.URLError, OSError) as e:
                    if attempt == 2:
                        self.errors.append(f"sample {short_id(sid)}: {e}")
                    time.sleep(1.0 + 2 * attempt)
        finally:
            self.sem.release()

    def poll(self) -> None:
        """Read this session's events (drops, hook errors) and the samples committed so far."""
        for e in _read_events(self.store):
            if e.get("session") not in (self.session, None) or float(e.get("t", 0)) < self.t_wall0:
                continue
            if e.get("event") == "dropped" and e.get("id") in self.pending:
                self.dropped[e["id"]] = f"{e.get('reason')}: {e.get('detail')}"
                self.pending.discard(e["id"])
            elif e.get("event") == "error":
                msg = f"server hook: {e.get('kind')}: {e.get('message')}"
                if msg not in self.errors:
                    self.errors.append(msg)
        done = self.pending & committed_ids_of(self.store)  # consumed shards too: their samples were committed
        if done:
            self.pending.difference_update(done)
            self.last_progress = time.monotonic()
