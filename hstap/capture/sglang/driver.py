"""The `sglang` engine's driver: `hstap capture --engine sglang --server URL` (runs in the hstap process).

`run_sglang_capture(cfg)` checks the server's settings (`server_info`, `server_problems`), sends prefill-only
`/generate` requests and waits until the server-side hook (capture/sglang/hook.py) committed each sample (the store is
shared). Request ids, the hook spec and the events directory come from capture/sglang/protocol.py; this module never
imports the hook's, nor the `sglang` package, and the server process never loads this one.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import time
import urllib.error
import urllib.request
import uuid

from hstap.capture.session import RequestError, Requests, encode_rid, end_session, http_json, lock_events
from hstap.capture.config import CaptureConfig
from hstap.capture.inputs import copy_vocab_map, resolve
from hstap.capture.sglang.protocol import ENV_LAYERS, EVENTS_DIR, HOOK_FACTORY, LOGITS_MODULES, hook_spec
from hstap.common import HstapError, write_run_config
from hstap.data.prepare import prepared_columns
from hstap.layers import check_sglang_capturable, to_sglang
from hstap.store.manifest import committed_ids_of, merge_manifest
from hstap.store.writer import StoreWriter


def server_info(server: str) -> dict:
    """GET /server_info (0.5.10+), falling back to the older /get_server_info."""
    last: Exception | None = None
    for path in ("/server_info", "/get_server_info"):
        try:
            return http_json(server.rstrip("/") + path)
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
        if not any(fnmatch.fnmatch(m, t) for m in LOGITS_MODULES for t in h.get("target_modules") or []):
            p.append(f"the hstap forward hook must target the model's LogitsProcessor "
                     f"(\"target_modules\": {json.dumps(list(LOGITS_MODULES))})")
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
    p += scatter_problems(info)
    if info.get("enable_return_aux_hidden_states"):
        want = to_sglang(layers, model_type)
        got = info.get("return_aux_hidden_state_layer_ids")
        if got is not None and list(got) != list(want):
            p.append(f"--return-aux-hidden-state-layer-ids is {got}, canonical layers {layers} need {want} "
                     f"(or drop --enable-return-aux-hidden-states and set {ENV_LAYERS}={','.join(map(str, layers))})")
    return p


def store_world(info: dict) -> int:
    """Store ranks the server's hooks write: one per data-parallel scheduler, i.e. attention-DP groups times DP
    replicas. SGLang 0.5.2x reports both widths (`--dp-size N --enable-dp-attention` resolves to attn_dp_size N,
    dp_size 1); older versions only dp_size, which is the attention-DP width under --enable-dp-attention."""
    dp = int(info.get("dp_size") or 1)
    if info.get("attn_dp_size") is not None:
        return dp * int(info["attn_dp_size"] or 1)
    return dp if info.get("enable_dp_attention") else 1


def scatter_problems(info: dict) -> list[str]:
    """Settings under which a rank's aux hidden states are not the rows of its batch, each with its fix.

    Handled, no refusal: expert parallelism (--ep-size, --moe-a2a-backend) and DP attention. Their MoE layers leave
    the residual stream scattered over the attention-TP ranks, and SGLang captures aux states on the attention's
    compute-input rows, gathered over attention TP (0.5.23: srt/layers/layer_boundary/stage.py:461-482 with the gather
    boundary.py:582-615 binds; what sglang PR #14280 and #20492 did inside deepseek_v2.py before), so each DP
    scheduler's hook sees its own batch and writes its own store rank (`store_world`). The hook refuses a batch whose
    aux rows do not cover it (a version or a layout without that gather). Refused here: settings under which the
    captured rows are a rank's slice of the batch."""
    p: list[str] = []
    if info.get("enable_attn_tp_input_scattered") and int(info.get("tp_size") or 1) > 1:
        p.append("--enable-attn-tp-input-scattered hands each attention-TP rank a slice of the prefill's tokens, and "
                 "the aux states SGLang captures are that slice (SGLang itself turns it off under EAGLE3, "
                 "srt/layers/layer_boundary/adapters/attention.py:84-92): drop it")
    if info.get("enable_prefill_cp"):
        p.append("--enable-prefill-cp splits each prompt's tokens over the context-parallel ranks, and each captures "
                 "its own chunk of them (srt/layers/layer_boundary/boundary.py:563-581 gathers the attention's input, "
                 "not the capture): capture without it")
    if info.get("attn_dp_size") is None and not info.get("enable_dp_attention") and int(info.get("dp_size") or 1) > 1:
        p.append(f"--dp-size {info.get('dp_size')} runs data-parallel replicas this SGLang version does not number "
                 "for the hook (each would write store rank 0): use --dp-size 1, one server per replica")
    return p


def run_sglang_capture(cfg: CaptureConfig, poll_s: float = 0.5, commit_timeout_s: float = 300.0,
                       request_timeout_s: float = 3600.0) -> dict:
    """`hstap capture --engine sglang --server URL`: cfg is a CaptureConfig (target, data, out, layers, dtype, new,
    max_samples, shard_tokens, server, concurrency). Returns the summary dict it prints."""
    if not cfg.server:
        raise HstapError("--server: required with --engine sglang (e.g. http://127.0.0.1:30000)")
    t0 = time.perf_counter()
    server = cfg.server.rstrip("/")
    inputs = resolve(cfg)
    ds, n, target_block, layers = inputs.ds, inputs.n, inputs.target, list(inputs.layers)
    check_sglang_capturable(layers, target_block["num_layers"])  # before the server is asked anything
    info = server_info(server)
    problems = server_problems(info, cfg.out, cfg.data, layers, target_block["model_type"])
    if problems:
        raise HstapError(f"--server {server}: " + "; ".join(problems))
    ctx = int(info.get("context_length") or 0)
    engine = {"name": "sglang", "version": str(info.get("version")), "device": f"server {server}",
              "compute_dtype": str(info.get("dtype")), "model_path": info.get("model_path")}
    header = inputs.header(engine, cfg)
    # create / check only: the hooks own the ranks (one per data-parallel scheduler) and write the shards
    writers = store_world(info)
    StoreWriter(cfg.out, header, new=cfg.new, shard_tokens=cfg.shard_tokens, world_size=writers, claim=False).close()
    copy_vocab_map(cfg.data, cfg.out)
    lock = lock_events(cfg.out, EVENTS_DIR, cfg.new)
    session = uuid.uuid4().hex[:12]
    t_wall0 = time.time() - 1.0  # events older than this run belong to earlier runs

    committed = committed_ids_of(cfg.out)  # consumed shards included: a following trainer may have deleted some
    ids, lens = prepared_columns(ds, n)
    too_long = [i for i in range(n) if ctx and lens[i] > ctx]
    todo = [i for i in range(n) if ids[i] not in committed and lens[i] > 0 and not (ctx and lens[i] > ctx)]
    skipped = sum(1 for i in range(n) if ids[i] in committed)
    run = Requests(cfg.out, EVENTS_DIR, session, ids, t_wall0, cfg.concurrency, poll_s,
                   _generate(server, session, ids, request_timeout_s), who="server hook")
    run.send_all(todo, lambda i: list(ds[i]["input_ids"]))
    run.wait_for_commits(commit_timeout_s)
    closed = end_session(cfg.out, EVENTS_DIR, session, poll_s, min(commit_timeout_s, 60.0)) if not (run.errors or run.pending) \
        else False
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    summary_store = merge_manifest(cfg.out)
    run.check(f"--server {server}", commit_timeout_s, "its hook")
    dropped = run.dropped
    write_run_config(cfg.out, "capture", cfg)
    reasons = run.reasons()
    summary = {"samples": len(todo) - len(dropped), "tokens": sum(lens[i] for i in todo if ids[i] not in dropped),
               "skipped_committed": skipped, "skipped_too_long": len(too_long), "dropped": reasons,
               "seconds": round(time.perf_counter() - t0, 3), "layers": layers, "dtype": cfg.dtype, "out": cfg.out,
               "store_samples": summary_store["samples"], "server": server, "session": session,
               "writers_closed": closed}
    print(f"capture: {summary['samples']} samples via SGLang {engine['version']} at {server} in "
          f"{summary['seconds']:.1f} s; {skipped} already in the store, {len(too_long)} longer than the context, "
          f"dropped {reasons or 0}")
    run.print_drops(closed, f"the server's hook did not close every store rank (writers {writers}); a trainer "
                            f"following {cfg.out} will keep waiting for it")
    return summary


def _generate(server: str, session: str, ids: list[str], timeout_s: float):
    """The `Requests` callback: one prefill-only `/generate` request for a row."""
    def request(row: int, input_ids: list[int], attempt: int) -> None:
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0},
                "rid": encode_rid(session, row, ids[row], attempt),
                # its own radix-cache namespace: no prefix hits, so the radix cache can stay on
                "extra_key": uuid.uuid4().hex}
        r = http_json(server + "/generate", body, timeout=timeout_s)
        got = (r.get("meta_info") or {}).get("prompt_tokens")
        if got is not None and int(got) != len(input_ids):
            raise RequestError(f"the server ran {got} of its {len(input_ids)} tokens")
    return request
