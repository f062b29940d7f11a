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
line (hstap/serve_loop/report.py), acceptance.png, server.log, train.log, run.config.json (the trainer's config),
store/, run/, drafters/, exports/. Prints a progress line (requests served, vLLM's acceptance over the last 32 answers,
drafter version, store size, trainer step, held-back samples).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hstap.common import HstapError, atomic_write_json, free_port, one_line, run_meta, write_run_config
from hstap.serve_loop.config import ServeLoopConfig
from hstap.train.config import DrafterInit, Devices, TrainConfig, TrainInputs


def stop_ids(target: str) -> list[int]:
    """The ids that end an answer (eos and end of turn: `hstap.data.decode.stop_token_ids`), sent with each request."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hstap.data.decode import stop_token_ids
    from hstap.artifacts.model_dir import load_config, load_tokenizer

    try:
        gen = GenerationConfig.from_pretrained(target)
    except OSError:
        gen = None
    return stop_token_ids(SimpleNamespace(generation_config=gen, config=load_config(target)), load_tokenizer(target))


def request_prompts(cfg: ServeLoopConfig) -> list[list[int]]:
    """The requests' prompt token ids, in order, checked against --requests and --max-model-len."""
    from hstap.artifacts.model_dir import load_tokenizer
    from hstap.speculative.evaluate import load_prompts

    prompts = [p for _, p in load_prompts(cfg.prompts, load_tokenizer(cfg.target), cfg.requests or None)]
    if cfg.requests and len(prompts) < cfg.requests:
        raise HstapError(f"{cfg.prompts}: {len(prompts)} usable prompts, fewer than --requests {cfg.requests} (each "
                         "prompt is served once)")
    longest = max(map(len, prompts))
    if longest + cfg.max_tokens > cfg.max_model_len:
        raise HstapError(f"{cfg.prompts}: a prompt of {longest} tokens + --max-tokens {cfg.max_tokens} exceeds "
                         f"--max-model-len {cfg.max_model_len}")
    return prompts


def start_drafter(cfg: ServeLoopConfig, out: Path) -> Path:
    """The hstap drafter directory the server starts with and the trainer starts from (module docstring); writes
    OUT/vocab_map.safetensors, the trainer's fixed draft vocabulary."""
    import torch
    from safetensors.torch import load_file, save_file

    from hstap.artifacts.drafter_dir import resolve_drafter_dir, save_drafter

    if cfg.drafter:
        d = resolve_drafter_dir(cfg.drafter)
        w = load_file(str(d / "drafter.safetensors"))
        d2t, t2d = w["d2t"], w["t2d"]
    else:
        from hstap.artifacts.vocab_map import load_vocab_map
        from hstap.layers import default_aux_layers, parse_layers
        from hstap.artifacts.model_dir import load_config, target_head
        from hstap.artifacts.vocab_map import VocabMap
        from hstap.train.trainer import init_drafter

        hf = load_config(cfg.target)
        N, V = hf.num_hidden_layers, hf.vocab_size
        if cfg.vocab_map:
            d2t, t2d = load_vocab_map(cfg.vocab_map)
        else:  # the whole vocabulary: draft id i is target id i
            d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
        layers = parse_layers(cfg.layers, N) if cfg.layers else default_aux_layers(N)
        embed, head = target_head(cfg.target)
        vocab = VocabMap(d2t, t2d, cfg.vocab_map or "the whole target vocabulary")
        drafter = init_drafter(hf, vocab, layers, embed.float(), head.float(), seed=cfg.seed, draft_layers=1)
        d = out / "drafter-init"
        save_drafter(d, drafter, {"store": {"layers": layers}, "init": "the trainer's initialisation, never trained"})
    tmp = out / ".vocab_map.safetensors.tmp"
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp))
    tmp.replace(out / "vocab_map.safetensors")
    return d


def check_cpus(cfg: ServeLoopConfig) -> None:
    """--server-cpus / --trainer-cpus name CPUs of this machine (else taskset would fail only after start). Not this
    process's own affinity: it may be pinned to the trainer's CPUs itself."""
    have = set(range(os.cpu_count() or 1))
    for name in ("server_cpus", "trainer_cpus"):
        want = set()
        for part in filter(None, getattr(cfg, name).split(",")):
            lo, _, hi = part.partition("-")
            want |= set(range(int(lo), int(hi or lo) + 1))
        if want - have:
            raise HstapError(f"serve-loop: --{name.replace('_', '-')} {getattr(cfg, name)}: CPU(s) "
                             f"{sorted(want - have)} not on this machine (CPUs 0-{max(have)})")


def check_anchor(cfg: ServeLoopConfig, out: Path) -> None:
    """--anchor-store against the store the tap will write (the served drafter's layers, the target's hidden size and
    fingerprint, --tap-dtype), before anything is written: the trainer would refuse it only once serving has begun."""
    from hstap.artifacts.drafter_dir import resolve_drafter_dir
    from hstap.artifacts.model_dir import load_config, target_fingerprint
    from hstap.layers import default_aux_layers, parse_layers
    from hstap.train.follow import open_anchor

    hf = load_config(cfg.target)
    if cfg.drafter:
        meta = json.loads((resolve_drafter_dir(cfg.drafter) / "drafter.json").read_text())
        layers = list(meta["config"]["aux_layers"])
    else:
        N = hf.num_hidden_layers
        layers = parse_layers(cfg.layers, N) if cfg.layers else default_aux_layers(N)
    header = {"layers": layers, "hidden_size": int(hf.hidden_size), "dtype": cfg.tap_dtype,
              "target": target_fingerprint(cfg.target)}
    open_anchor(cfg.stream.anchor_store, str(out / "store"), header)


def server_args(cfg: ServeLoopConfig, device: str, dtype: str, drafter_dir: Path | None, store: Path) -> list[str]:
    """`vllm serve` arguments of a --mode run (module docstring)."""
    from hstap.capture.vllm.eagle_tap import CONNECTOR, CONNECTOR_MODULE
    from hstap.engines.vllm import VLLM_DTYPES

    args = ["--dtype", VLLM_DTYPES[dtype], "--max-model-len", str(cfg.max_model_len), "--no-enable-prefix-caching",
            "--seed", str(cfg.seed)] + (["--enforce-eager"] if device == "cpu" else [])
    if cfg.mode == "target":
        return args
    args += ["--speculative-config", json.dumps({"method": "eagle3", "model": str(drafter_dir),
                                                 "num_speculative_tokens": cfg.k}),
             "--per-request-spec-decode-metrics", "summary"]
    if cfg.mode == "loop":
        extra = {"store": str(store), "tap": True, "tap_dtype": cfg.tap_dtype, "shard_tokens": cfg.shard_tokens,
                 "flush_s": cfg.flush_s, **({"max_store_gb": cfg.max_store_gb} if cfg.max_store_gb else {}),
                 **({"side_rows": cfg.side_rows, "side_max_accepted": cfg.side_max_accepted}
                    if cfg.side_rows != "none" else {})}
        args += ["--kv-transfer-config", json.dumps({"kv_connector": CONNECTOR, "kv_connector_module_path":
                                                     CONNECTOR_MODULE, "kv_role": "kv_producer",
                                                     "kv_connector_extra_config": extra}),
                 "--worker-extension-cls", "hstap.serve_loop.worker.HstapWorker"]
    return args


def trainer_config(cfg: ServeLoopConfig, out: Path, drafter0: Path, device: str) -> TrainConfig:
    """The trainer's config: the loop's `train` section (train's hyper-parameters) and what the loop fixes: follow
    OUT/store and consume it within --keep-shards, from `drafter0` (its decoder layers) with OUT's fixed vocabulary map,
    no eval split, the loop's seed and device, no TensorBoard; the loop's hold-out (the gate's samples), window replay
    and anchor store."""
    dl = json.loads((drafter0 / "drafter.json").read_text())["config"].get("num_layers", 1)
    return TrainConfig(out=str(out / "run"), target=cfg.target, seed=cfg.seed, tensorboard=False, follow=True,
                       consume=True, hyper=cfg.train, stream=cfg.stream,
                       inputs=TrainInputs(store=str(out / "store"), vocab_map=str(out / "vocab_map.safetensors"),
                                          eval_frac=0.0),
                       drafter=DrafterInit(init_from=str(drafter0), draft_layers=dl), devices=Devices(device=device))


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


def read_reference(path: str, n: int) -> dict[int, list[int]]:
    """{prompt index: output tokens} of a --mode target run's served.jsonl (--reference), checked to be one: every line
    a record of a served request ("i", and its "tokens" or its "error"), every one of the `n` prompts served here
    recorded there (else the comparison would be of nothing), and, where its run record lies beside it, of a --mode
    target run. One line naming the file (and line) otherwise."""
    from hstap.common import read_record

    p = Path(path)
    if not p.is_file():
        raise HstapError(f"{p}: --reference: not a file (the served.jsonl of a --mode target run)")
    what = "--reference: not a served.jsonl of hstap serve-loop"
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise HstapError(f"{p}: {what} (not UTF-8 text)") from None
    out: dict[int, list[int]] = {}
    seen: set[int] = set()
    for k, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
            i = r["i"]
            if not isinstance(i, int) or isinstance(i, bool) or not ("tokens" in r or "error" in r):
                raise ValueError("a record has an integer \"i\" and its \"tokens\" or its \"error\"")
            if "tokens" in r:
                if not isinstance(r["tokens"], list) or not all(isinstance(t, int) for t in r["tokens"]):
                    raise ValueError("\"tokens\" is a list of token ids")
                out[i] = r["tokens"]
            seen.add(i)
        except (ValueError, KeyError, TypeError) as e:
            raise HstapError(f"{p}:{k}: {what} ({one_line(e)})") from None
    missing = [i for i in range(n) if i not in seen]
    if missing:
        raise HstapError(f"{p}: --reference: holds no answer to prompt {missing[0]} ({len(missing)} of the {n} served "
                         f"here are not in it): the reference of other prompts, or of fewer")
    rec = read_record(p.parent / "config.json")
    if rec is not None and rec["stage"] == "serve-loop" and (rec.get("config") or {}).get("mode") != "target":
        raise HstapError(f"{p}: --reference: served by a --mode {rec['config'].get('mode')} run "
                         f"({p.parent / 'config.json'}); the reference is a --mode target run's")
    return out


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
    from hstap.device import auto_device, auto_dtype
    from hstap.artifacts.outputs import check_not_input, check_out_dir

    # Everything is checked before anything is written or removed: --out, the engine, the prompts, the reference.
    out = Path(cfg.out)
    if cfg.mode == "loop":  # the tap reads V1's model runner: a server asked for V2 is refused now, not once started
        from hstap.engines.vllm_runner import ENV, require_v1

        require_v1("v2" if os.environ.get(ENV, "").strip().lower() in ("1", "true") else "v1", "hstap serve-loop",
                   "its tap beside EAGLE-3")
    check_not_input(out, [("--target", cfg.target), ("--prompts", cfg.prompts), ("--drafter", cfg.drafter),
                          ("--reference", cfg.reference), ("--vocab-map", cfg.vocab_map)])
    replace = check_out_dir(out, "serve-loop", cfg.overwrite)
    device = auto_device(cfg.device)
    dtype = auto_dtype(cfg.dtype, device)
    prompts, stops = request_prompts(cfg), stop_ids(cfg.target)
    ref = read_reference(cfg.reference, len(prompts)) if cfg.reference else None
    check_cpus(cfg)
    if cfg.stream.anchor_store and cfg.mode == "loop":
        check_anchor(cfg, out)
    require_vllm("serve-loop")  # last of the checks (its import takes seconds), before anything is written
    if replace:  # an earlier serve-loop's directory (its run record says so)
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_run_config(out, "serve-loop", cfg)
    drafter0 = start_drafter(cfg, out) if cfg.mode != "target" else None
    if cfg.mode == "loop":  # the trainer's config, checked before the server starts
        atomic_write_json(out / "run.config.json", run_meta("train", trainer_config(cfg, out, drafter0, device)))
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
            stream = Stream(Client(url, cfg.max_tokens, stops, cfg.seed), prompts, cfg.concurrency,
                            out / "served.jsonl")
            up = Updater(cfg, url, out, dtype, trainer, drafter0, clock=stream.clock)
            stream.status = up.status
            records, wall = stream.run(up.on_answer)
            after = server_counters(url) if cfg.mode != "target" else {}
            stop_process(trainer)  # the stream is over
            if probe is not None:
                probe(url, out)
    finally:
        stop_process(trainer)
    summary = summarize(cfg, out, prompts, records, wall, up, before, after, ref, started_s)
    atomic_write_json(out / "summary.json", summary)
    return summary
