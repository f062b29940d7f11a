"""The `vllm` engine's driver: `hstap capture --engine vllm` (runs in the hstap process).

    hstap capture --engine vllm --target MODEL --data PREPARED --out STORE            # vLLM's LLM in this process
    hstap capture --engine vllm --server http://127.0.0.1:8000 --target MODEL --data PREPARED --out STORE

Both send every prepared sample not yet in the store to vLLM as a prefill-only request (its token ids, max_tokens 1,
the hstap request id in `kv_transfer_params`) and wait until hstap's connector inside vLLM (capture/vllm/connector.py)
committed it, then end the session (the connector closes its store rank: the end of writing `train --follow` waits
on). Embedded, the driver starts `vllm.LLM` itself with the connector and the extract_hidden_states method (the store
created first); against a server, the server must have been launched with them for this store
(`hstap.capture.vllm.protocol.serve_command`), which the driver checks from the settings the connector recorded
(STORE/vllm-events/server-<pid>.json) and from each answer's `kv_transfer_params`. What the two sides agree on is
capture/vllm/protocol.py; this module never imports the connector's.

Resumable like every engine: a sample is stored once its shard commits; re-running the same command skips the
committed ones (a kill -9 of the whole run loses at most the open shard, which is captured again).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sys
import time
import uuid
from pathlib import Path

from hstap.capture.config import CaptureConfig
from hstap.capture.inputs import copy_vocab_map, resolve, short_id
from hstap.capture.session import RequestError, Requests, encode_rid, end_session, http_json, lock_events
from hstap.capture.vllm.protocol import (EVENTS_DIR, HELLO_PREFIX, PARAMS_KEY, kv_transfer_config, serve_command,
                                         speculative_config)
from hstap.common import HstapError, write_run_config
from hstap.data.prepare import prepared_columns
from hstap.layers import to_vllm
from hstap.artifacts.model_dir import load_config
from hstap.device import auto_device, auto_dtype
from hstap.store.manifest import committed_ids_of, merge_manifest
from hstap.store.writer import StoreWriter
from hstap.engines.vllm import check_quantized_dtype, require_vllm, start_llm, stop_llm

CHUNK = 256  # embedded: prompts handed to LLM.generate at a time (progress and commits are polled in between)


def run_vllm_capture(cfg: CaptureConfig, poll_s: float = 0.5, commit_timeout_s: float = 300.0,
                     request_timeout_s: float = 3600.0) -> dict:
    """`hstap capture --engine vllm`: cfg is a CaptureConfig (target, data, out, layers, dtype, new, max_samples,
    shard_tokens, server, concurrency, device, compute_dtype, batch_tokens). Returns the summary dict it prints."""
    t0 = time.perf_counter()
    inputs = resolve(cfg)
    ds, n, N, layers = inputs.ds, inputs.n, inputs.target["num_layers"], list(inputs.layers)
    vids = to_vllm(layers) + [N]  # + the last layer's pre-norm output, from which the connector computes `final`
    ids, lens = prepared_columns(ds, n)
    server = cfg.server.rstrip("/") if cfg.server else None
    if server:
        info = _server_info(server, cfg, layers, vids)
        engine = {"name": "vllm", "version": info["vllm"], "device": f"server {server}",
                  "compute_dtype": _short_dtype(info["dtype"]), "model_path": info["model"], "vllm_layers": vids}
        max_len = int(info["max_model_len"])
    else:
        dtype = auto_dtype(cfg.compute_dtype, cfg.device)
        check_quantized_dtype(cfg.target, dtype, auto_device(cfg.device))  # before the store is created
        engine = {"name": "vllm", "version": _vllm_version(), "device": auto_device(cfg.device),
                  "compute_dtype": dtype, "model_path": cfg.target, "vllm_layers": vids}
        max_len = max((lens[i] for i in range(n)), default=1) + 1
    header = inputs.header(engine, cfg)
    StoreWriter(cfg.out, header, new=cfg.new, shard_tokens=cfg.shard_tokens, claim=False).close()  # the connector writes
    copy_vocab_map(cfg.data, cfg.out)
    lock = lock_events(cfg.out, EVENTS_DIR, cfg.new, keep=f"{HELLO_PREFIX}*.json")
    session = uuid.uuid4().hex[:12]
    t_wall0 = time.time() - 1.0  # events older than this run belong to earlier runs
    committed = committed_ids_of(cfg.out)
    too_long = [i for i in range(n) if lens[i] > max_len - 1]
    todo = [i for i in range(n) if ids[i] not in committed and 0 < lens[i] <= max_len - 1]
    skipped = sum(1 for i in range(n) if ids[i] in committed)
    if server:
        run = Requests(cfg.out, EVENTS_DIR, session, ids, t_wall0, cfg.concurrency, poll_s,
                       _completion(server, info["served_model"], session, ids, cfg.out, request_timeout_s),
                       who="vLLM connector")
        t_send = time.perf_counter()
        run.send_all(todo, lambda i: list(ds[i]["input_ids"]))
        run.wait_for_commits(commit_timeout_s)
        timing = {"capture_s": round(time.perf_counter() - t_send, 3)}
        closed = _end(cfg, run, session, poll_s, commit_timeout_s)
    else:
        run = Requests(cfg.out, EVENTS_DIR, session, ids, t_wall0, 1, min(poll_s, 0.1), lambda *a: None,
                       who="vLLM connector")
        t_start = time.perf_counter()
        llm = _start_llm(cfg, dtype, vids, max_len)
        try:
            t_send = time.perf_counter()
            _generate_all(llm, run, todo, ds, session, ids, cfg.out)
            run.wait_for_commits(commit_timeout_s)
            timing = {"engine_start_s": round(t_send - t_start, 3), "capture_s": round(time.perf_counter() - t_send, 3)}
            closed = _end(cfg, run, session, poll_s, commit_timeout_s)
        finally:
            stop_llm(llm)
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    plan = _Plan(layers, todo, ids, lens, skipped, too_long)
    return _finish(cfg, run, engine, server, session, t0, plan, closed, commit_timeout_s, timing)


@dataclasses.dataclass
class _Plan:
    """What a run set out to do: the layers, the rows to send, every row's id and length, what it skipped."""
    layers: list[int]
    todo: list[int]
    ids: list[str]
    lens: list[int]
    skipped: int
    too_long: list[int]


def _end(cfg: CaptureConfig, run: Requests, session: str, poll_s: float, commit_timeout_s: float) -> bool:
    if run.errors or run.pending:
        return False
    return end_session(cfg.out, EVENTS_DIR, session, poll_s, min(commit_timeout_s, 60.0))


def _finish(cfg: CaptureConfig, run: Requests, engine: dict, server: str | None, session: str, t0: float, plan: _Plan,
            closed: bool, commit_timeout_s: float, timing: dict) -> dict:
    summary_store = merge_manifest(cfg.out)
    run.check(f"--server {server}" if server else f"{cfg.out}", commit_timeout_s, "hstap's connector")
    dropped = run.dropped
    write_run_config(cfg.out, "capture", cfg)
    reasons = run.reasons()
    done = [i for i in plan.todo if plan.ids[i] not in dropped]
    seconds = time.perf_counter() - t0
    summary = {"samples": len(done), "tokens": sum(plan.lens[i] for i in done), "skipped_committed": plan.skipped,
               "skipped_too_long": len(plan.too_long), "dropped": reasons, "seconds": round(seconds, 3),
               "layers": plan.layers, "vllm_layers": engine["vllm_layers"], "dtype": cfg.dtype, "out": cfg.out,
               "store_samples": summary_store["samples"], "server": server, "session": session,
               "writers_closed": closed, "compute_dtype": engine["compute_dtype"], **timing}
    print(f"capture: {summary['samples']} samples ({summary['tokens']:,} tokens) via vLLM {engine['version']} "
          f"({'server ' + server if server else 'in this process'}, {engine['compute_dtype']}) in {seconds:.1f} s "
          f"({timing['capture_s']:.1f} s from the first request to the last commit); "
          f"{plan.skipped} already in the store, {len(plan.too_long)} longer than the context, "
          f"dropped {reasons or 0}")
    run.print_drops(closed, f"hstap's connector did not close its store rank; a trainer following {cfg.out} will "
                            "keep waiting for it")
    return summary


# -- embedded: vLLM's LLM in this process -------------------------------------------------------------------------------


def _vllm_version() -> str:
    require_vllm("--engine vllm")
    import vllm

    return vllm.__version__


def _start_llm(cfg: CaptureConfig, dtype: str, vids: list[int], max_len: int):
    """vLLM's LLM on the target with hstap's connector writing into cfg.out; --batch-tokens is vLLM's token budget per
    step (max_num_batched_tokens: a longer prompt is prefilled in chunks, which vLLM's block table stitches)."""
    if max_len > int(getattr(load_config(cfg.target), "max_position_embeddings", None) or max_len):
        # vLLM wants prompt + 1 <= max_model_len; a capture request never runs its sampled token through the model
        # (max_tokens 1), so no position beyond the target's max_position_embeddings is ever computed
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return start_llm(cfg.target, dtype, auto_device(cfg.device), max_len, max_num_batched_tokens=cfg.batch_tokens,
                     speculative_config=speculative_config(vids), kv_transfer_config=kv_transfer_config(
                         cfg.out, cfg.data, shard_tokens=cfg.shard_tokens, flush_s=0.25))  # the last commit comes sooner


def _generate_all(llm, run: Requests, todo: list[int], ds, session: str, ids: list[str], store: str) -> None:
    """Every row of `todo` through `llm.generate` (prefill only), CHUNK prompts at a time, polling commits between."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run.pending = {ids[i] for i in todo}
    done = 0
    for lo in range(0, len(todo), CHUNK):
        rows = todo[lo:lo + CHUNK]
        prompts = [TokensPrompt(prompt_token_ids=list(ds[i]["input_ids"])) for i in rows]
        params = [SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {
            PARAMS_KEY: encode_rid(session, i, ids[i])}}) for i in rows]
        for i, p, out in zip(rows, prompts, llm.generate(prompts, params, use_tqdm=False)):
            problem = _answer_problem(out.kv_transfer_params, len(out.prompt_token_ids or []),
                                      len(p["prompt_token_ids"]), store)
            if problem:
                run.errors.append(f"sample {short_id(ids[i])}: {problem}")
        done += len(rows)
        run.poll()
        print(f"capture: {done}/{len(todo)} samples through vLLM, {len(todo) - len(run.pending)} committed",
              file=sys.stderr, flush=True)
        if run.errors:
            return


def _answer_problem(params: dict | None, got_tokens: int, sent_tokens: int, store: str) -> str | None:
    """What is wrong with vLLM's answer to one capture request (None: nothing)."""
    if not isinstance(params, dict) or PARAMS_KEY not in params:
        return "the answer carries no hstap kv_transfer_params: vLLM does not run hstap's connector"
    if os.path.abspath(str(params.get("store"))) != os.path.abspath(store):
        return f"hstap's connector writes to {params.get('store')}, not to this run's store {os.path.abspath(store)}"
    if got_tokens != sent_tokens:
        return f"vLLM ran {got_tokens} of its {sent_tokens} tokens"
    return None


# -- a running server -----------------------------------------------------------------------------------------------------


def _server_info(server: str, cfg: CaptureConfig, layers: list[int], vids: list[int]) -> dict:
    """The connector's recorded settings (newest STORE/vllm-events/server-*.json) checked against this run, plus the
    served model's name from /v1/models."""
    try:
        models = http_json(server + "/v1/models").get("data") or []
    except (OSError, ValueError) as e:
        raise HstapError(f"--server {server}: cannot reach the vLLM server ({e})") from None
    if not models:
        raise HstapError(f"--server {server}: /v1/models lists no model")
    fix = f"launch it as: {serve_command(cfg.target, cfg.out, cfg.data, vids)}"
    hellos = sorted(Path(cfg.out, EVENTS_DIR).glob(f"{HELLO_PREFIX}*.json"), key=lambda p: p.stat().st_mtime)
    if not hellos:
        raise HstapError(f"--server {server}: no vLLM server with hstap's connector for {cfg.out} has started "
                         f"(no {EVENTS_DIR}/{HELLO_PREFIX}*.json); {fix}")
    info = json.loads(hellos[-1].read_text())
    problems = []
    for key, want in (("store", os.path.abspath(cfg.out)), ("data", os.path.abspath(cfg.data)), ("layers", layers),
                      ("vllm_layers", vids)):
        if info.get(key) != want:
            problems.append(f"its {key} is {info.get(key)!r}, this run needs {want!r}")
    if problems:
        raise HstapError(f"--server {server}: hstap's connector was started with other settings "
                         f"({hellos[-1].name}): {'; '.join(problems)}; {fix}")
    return {**info, "served_model": models[0].get("id"), "max_model_len": models[0].get("max_model_len")
            or info["max_model_len"]}


def _completion(server: str, model: str, session: str, ids: list[str], store: str, timeout_s: float):
    """The `Requests` callback: one prefill-only /v1/completions request (token ids, max_tokens 1) for a row."""
    def request(row: int, input_ids: list[int], attempt: int) -> None:
        body = {"model": model, "prompt": input_ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {PARAMS_KEY: encode_rid(session, row, ids[row], attempt)}}
        r = http_json(server + "/v1/completions", body, timeout=timeout_s)
        got = (r.get("usage") or {}).get("prompt_tokens")
        problem = _answer_problem(r.get("kv_transfer_params"), int(got if got is not None else len(input_ids)),
                                  len(input_ids), store)
        if problem:
            raise RequestError(problem)
    return request


def _short_dtype(name: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(name), str(name))
