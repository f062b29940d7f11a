"""`hstap serve-loop`: train as you serve, closed, on a live vLLM server. The server drafts with an EAGLE-3 drafter and
taps the requests it serves into a store; `hstap train --follow --consume` trains on that store beside it, never on
a held-back share of it; every --update-every answered requests the drafter the trainer has reached (its newest
checkpoint) is scored against the served drafter on the held-back traffic and, only when better, exported and taken
up by the running server, in place, then checked against the server's own counters and rolled back if it does not
draft as well (hstap/serve_loop/updates.py, gate.py). Composes the stages (capture's tap, train, export) like
hstap/demo/stage.py.

    hstap serve-loop --target T --prompts heldout.jsonl --out W                       # from no drafter (below)
    hstap serve-loop --target T --prompts heldout.jsonl --out W --drafter RUN          # from a drafter trained offline
    hstap serve-loop ... --drafter RUN --anchor-store STORE --anchor-fraction 0.3     # rehearsing its first domain
    hstap serve-loop ... --mode fixed --drafter RUN       # the loop off: that drafter, no tap, no trainer (baseline)
    hstap serve-loop ... --mode target                    # no speculation: target-only outputs (--reference for others)

What runs (processes): `vllm serve` (hstap.engines.vllm.vllm_server, on --server-cpus) with `--speculative-config`
eagle3 + the served drafter, the tap beside EAGLE-3 (hstap/capture/vllm/eagle_tap.py, `--kv-transfer-config`),
hstap's worker extension (hstap/serve_loop/worker.py, `--worker-extension-cls`) and VLLM_SERVER_DEV_MODE=1 (for
vLLM's /collective_rpc endpoint); the trainer (`python -m hstap.cli train --config OUT/run.config.json`, on
--trainer-cpus: train's config made of the loop's --train.* section and what the loop fixes, `--follow --consume
--keep-shards N --init-from DRAFTER0 --holdout-frac F ...`); this process, the client (hstap/serve_loop/requests.py:
the prompts of --prompts in order, --concurrency in flight, greedy, each sent once) and the updater.

- How the server takes a new drafter up: `hstap_load_drafter(DIR)` through /collective_rpc, i.e. vLLM's own
  `reload_weights` on the draft model, between two engine steps (hstap/serve_loop/worker.py says why this one among vLLM
  0.32's ways, and docs/engines.md where each is in vLLM). No restart, no request paused or dropped; the drafter's KV
  of requests in flight was computed by the previous weights (their next drafts may be a little worse); outputs are
  the target's either way (`--reference` checks them token for token).
- "No drafter" (no --drafter): vLLM cannot run EAGLE-3 without a drafter, so the server starts with the drafter the
  trainer starts from: the trainer's own initialisation (lm_head = the target head's rows of the draft vocabulary,
  embedding = the target's, the rest PyTorch's default init under --seed), whose drafts are rarely accepted; the first
  update replaces it. Its draft vocabulary is --vocab-map's, else the target's whole vocabulary.
- From a drafter (--drafter, an hstap drafter directory or training RUN): the server starts with it and the trainer
  continues it (`--init-from`) on the served traffic, with its vocabulary map; --anchor-store (its training store)
  keeps a share of every training slot on the domain it was trained on.
- Bounded disk: the store is a window of --keep-shards shard files of --shard-tokens tokens (the trainer deletes what
  it consumed, the tap drops requests rather than make serving wait when the window is full; --max-store-gb on top);
  of the exports (and their hstap-format copies, OUT/drafters) only the start drafter, the served one and the one
  before it are kept; the trainer keeps its newest 3 checkpoints; the gate keeps --gate-samples samples in memory.

Outputs in --out: served.jsonl (one line per answered request: prompt index, tokens, vLLM's per-request draft counters,
the drafter version serving when it finished), updates.jsonl (hstap/serve_loop/updates.py), summary.json and the last
line (hstap/serve_loop/report.py), acceptance.png, server.log, train.log, config.json (the config as parsed), plan.json
(what the loop resolved from it and its inputs, once, before anything was written: hstap/serve_loop/plan.py),
run.config.json (the trainer's config), store/, run/, drafters/, exports/. Prints a progress line (requests served,
vLLM's acceptance over the last 32 answers, drafter version, store size, trainer step, held-back samples).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hstap.common import HstapError, atomic_write_json, free_port, run_meta, write_run_config
from hstap.serve_loop.config import ServeLoopConfig
from hstap.serve_loop.plan import ServeLoopPlan, resolve
from hstap.train.config import DrafterInit, Devices, TrainConfig, TrainInputs


def start_drafter(cfg: ServeLoopConfig, plan: ServeLoopPlan, out: Path) -> Path:
    """The hstap drafter directory the server starts with and the trainer starts from (module docstring): the plan's
    (a --drafter), else the trainer's initialisation written now as OUT/drafter-init; writes OUT/vocab_map.safetensors,
    the trainer's fixed draft vocabulary."""
    from hstap.artifacts.vocab_map import VOCAB_MAP_FILE, write_vocab_map

    d = plan.drafter
    if d is None:
        from hstap.artifacts.drafter_dir import save_drafter
        from hstap.artifacts.model_dir import target_head
        from hstap.train.trainer import init_drafter

        embed, head = target_head(cfg.target)
        drafter = init_drafter(plan.hf_config, plan.vocab, list(plan.layers), embed.float(), head.float(),
                               seed=cfg.seed, draft_layers=plan.draft_layers)
        d = out / "drafter-init"
        save_drafter(d, drafter, {"store": {"layers": list(plan.layers)},
                                  "init": "the trainer's initialisation, never trained"})
    write_vocab_map(out / VOCAB_MAP_FILE, plan.vocab.d2t, plan.vocab.t2d)
    return d


def server_args(cfg: ServeLoopConfig, device: str, dtype: str, drafter_dir: Path | None, store: Path) -> list[str]:
    """`vllm serve` arguments of a --mode run (module docstring)."""
    from hstap.capture.vllm.protocol import tap_transfer_config
    from hstap.engines.vllm import VLLM_DTYPES, eagle3_config, serve_flags

    args = ["--dtype", VLLM_DTYPES[dtype], "--max-model-len", str(cfg.max_model_len), "--no-enable-prefix-caching",
            "--seed", str(cfg.seed)] + (["--enforce-eager"] if device == "cpu" else [])
    if cfg.mode == "target":
        return args
    args += [*serve_flags(speculative_config=eagle3_config(drafter_dir, cfg.k)),
             "--per-request-spec-decode-metrics", "summary"]
    if cfg.mode == "loop":
        tap = tap_transfer_config(store, tap_dtype=cfg.tap_dtype, shard_tokens=cfg.shard_tokens, flush_s=cfg.flush_s,
                                  **({"max_store_gb": cfg.max_store_gb} if cfg.max_store_gb else {}),
                                  **({"side_rows": cfg.side_rows, "side_max_accepted": cfg.side_max_accepted}
                                     if cfg.side_rows != "none" else {}))
        args += [*serve_flags(kv_transfer_config=tap), "--worker-extension-cls", "hstap.serve_loop.worker.HstapWorker"]
    return args


def trainer_config(cfg: ServeLoopConfig, out: Path, drafter0: Path, draft_layers: int, device: str) -> TrainConfig:
    """The trainer's config: the loop's `train` and `stream` sections as they are, and what the loop fixes: follow
    OUT/store and consume it within --keep-shards, from `drafter0` (of `draft_layers` decoder layers) with OUT's fixed
    vocabulary map, no eval split, the loop's seed and device, no TensorBoard."""
    return TrainConfig(out=str(out / "run"), target=cfg.target, seed=cfg.seed, tensorboard=False, follow=True,
                       consume=True, hyper=cfg.train, stream=cfg.stream,
                       inputs=TrainInputs(store=str(out / "store"), vocab_map=str(out / "vocab_map.safetensors"),
                                          eval_frac=0.0),
                       drafter=DrafterInit(init_from=str(drafter0), draft_layers=draft_layers),
                       devices=Devices(device=device))


def pinned(cmd: list[str], cpus: str) -> list[str]:
    """`cmd` run on the CPUs `cpus` (taskset), or as is for ""."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def start_trainer(cfg: ServeLoopConfig, out: Path) -> subprocess.Popen:
    """`hstap train --follow --consume` on OUT/store in a process of its own (log: OUT/train.log), started from its
    config (`trainer_config`), written as OUT/run.config.json before the server started."""
    cmd = pinned([sys.executable, "-m", "hstap.cli", "train", "--config", str(out / "run.config.json")],
                 cfg.trainer_cpus)
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.trainer_threads), "TOKENIZERS_PARALLELISM": "false"}
    with open(out / "train.log", "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_for_claim(out: Path, trainer: subprocess.Popen, timeout: float = 600.0) -> None:
    """Until the trainer wrote STORE/consumer.json (its window, which the tap's writer keeps to from its first
    shard); HstapError with the end of train.log if it exits first."""
    from hstap.store.consumer import RECORD

    deadline = time.monotonic() + timeout
    while not (out / "store" / RECORD).is_file():
        if trainer.poll() is not None or time.monotonic() > deadline:
            tail = (out / "train.log").read_text()[-2000:] if (out / "train.log").is_file() else ""
            raise HstapError(f"{out / 'train.log'}: the trainer did not claim the store ({tail.strip()[-600:]})")
        time.sleep(0.2)


def stop_process(p: subprocess.Popen | None) -> None:
    if p is None or p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)


def serve_loop(cfg: ServeLoopConfig, probe=None) -> dict:
    """Run one serve-loop (module docstring); returns the summary (also OUT/summary.json). `probe(url, out)`, when
    given (tests), runs against the server after the stream, the trainer stopped, before the server stops."""
    from hstap.serve_loop.requests import Client, Stream, post, server_counters
    from hstap.serve_loop.report import summarize
    from hstap.serve_loop.updates import Updater, export_vllm
    from hstap.engines.vllm import require_vllm, vllm_server
    from hstap.artifacts.outputs import check_not_input, check_out_dir

    # Everything is checked before anything is written or removed: --out, the engine, the inputs resolved once (the
    # plan: the target, the prompts, the reference, the start drafter, the anchor store).
    out = Path(cfg.out)
    if cfg.mode == "loop":  # the tap reads V1's model runner: a server asked for V2 is refused now, not once started
        from hstap.engines.vllm_runner import ENV, require_v1

        require_v1("v2" if os.environ.get(ENV, "").strip().lower() in ("1", "true") else "v1", "hstap serve-loop",
                   "its tap beside EAGLE-3")
    check_not_input(out, [("--target", cfg.target), ("--prompts", cfg.prompts), ("--drafter", cfg.drafter),
                          ("--reference", cfg.reference), ("--vocab-map", cfg.vocab_map)])
    replace = check_out_dir(out, "serve-loop", cfg.overwrite)
    plan = resolve(cfg, out)
    device, dtype = plan.device, plan.dtype
    require_vllm("serve-loop")  # last of the checks (its import takes seconds), before anything is written
    if replace:  # an earlier serve-loop's directory (its run record says so)
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_run_config(out, "serve-loop", cfg)
    atomic_write_json(out / "plan.json", plan.record())
    drafter0 = start_drafter(cfg, plan, out) if cfg.mode != "target" else None
    if cfg.mode == "loop":  # the trainer's config, checked before the server starts
        atomic_write_json(out / "run.config.json",
                          run_meta("train", trainer_config(cfg, out, drafter0, plan.draft_layers, device)))
    if drafter0 is not None:
        export_vllm(cfg.target, cfg.k, drafter0, out / "exports" / "v0000", dtype)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_V2_MODEL_RUNNER": "0"}  # V1: the tap reads it
    if cfg.mode == "loop":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM's /collective_rpc endpoint (its development endpoints)
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
        if cfg.server_cpus:  # vLLM's CPU backend binds its OpenMP threads itself: to these CPUs, not all of them
            env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.server_cpus
    port = cfg.port or free_port()
    t_start, trainer = time.perf_counter(), None
    try:
        with vllm_server(cfg.target, port, out / "server.log",
                         *server_args(cfg, device, dtype, out / "exports" / "v0000", out / "store"), env=env,
                         cpus=cfg.server_cpus) as url:
            started_s = time.perf_counter() - t_start
            if cfg.mode == "loop":  # the trainer claims the store's window before the first request is served
                trainer = start_trainer(cfg, out)
                wait_for_claim(out, trainer)
                post(url + "/collective_rpc", {"method": "hstap_tap_start"})
            before = server_counters(url) if cfg.mode != "target" else {}
            stream = Stream(Client(url, cfg.max_tokens, plan.stop_ids, cfg.seed), plan.prompts, cfg.concurrency,
                            out / "served.jsonl")
            up = Updater(cfg, url, out, dtype, trainer, drafter0, clock=stream.clock)
            stream.status = up.status
            records, wall = stream.run(up.on_answer)
            up.check_running()  # the stream is over: a trainer or tap that died on the way fails the run
            after = server_counters(url) if cfg.mode != "target" else {}
            stop_process(trainer)  # the stream is over
            if probe is not None:
                probe(url, out)
    finally:
        stop_process(trainer)
    summary = summarize(cfg, out, plan.prompts, records, wall, up, before, after, plan.reference, started_s)
    atomic_write_json(out / "summary.json", summary)
    return summary
