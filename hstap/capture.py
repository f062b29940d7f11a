"""`hstap capture`: run the target over a prepared set and store the hidden states an EAGLE-3 drafter trains on.

    hstap capture --target MODEL_DIR --data PREPARED --out STORE             # one GPU (bf16), or the CPU (fp32)
    torchrun --nproc-per-node 8 -m hstap.cli capture --target MODEL_DIR --data PREPARED --out STORE
    hstap capture --target ../shared/reference/target-tiny --data runs/prepared --out runs/store \
        --dtype fp32 --device cpu

What is stored per sample (format: `hstap/store.py`): input_ids, loss_mask, `aux` = outputs of the decoder layers
`--layers` (canonical ids, default [1, N//2-1, N-4]) and `final` = the final-norm output, in `--dtype`.

Resumable: a sample is written once its shard commits; killing the run (even with SIGKILL) loses at most the open
shards, and re-running the same command skips every committed sample. A store made with another target, tokenizer,
layer set or dtype is refused unless `--new` (which wipes it). Data prepared with another tokenizer than the target's
is refused.

Multi-GPU: under torchrun each rank takes samples rank::world_size, runs its own copy of the model on cuda:LOCAL_RANK
and writes its own shards; rank 0 merges the manifest after a barrier (a gloo process group is used only for barriers
and the final counts). Engines: `hf` (embedded, engines/hf.py), `sglang` (a server with the hstap plugin) and
`vllm-import` (convert vLLM extract_hidden_states output); the last two live in engines/sglang.py / engines/vllm.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hstap.common import HstapError, git_commit, write_run_config

ENGINES = ("hf", "sglang", "vllm-import")
DTYPES = ("bf16", "fp8", "fp32")


@dataclass
class CaptureConfig:
    target: str
    """Target model directory (HF format: config.json, safetensors weights, tokenizer)."""
    data: str
    """Prepared dataset directory (output of `hstap prepare`, made with the target's tokenizer)."""
    out: str
    """Store directory to create or resume (see hstap/store.py for the format)."""
    layers: str = ""
    """Comma-separated canonical layer ids to tap (output of decoder layer i); empty = EAGLE-3's [1, N//2-1, N-4]."""
    dtype: str = "bf16"
    """Storage dtype: bf16, fp8 (float8_e4m3fn + one fp32 scale per token per layer, ~half the bytes) or fp32
    (exact)."""
    batch_tokens: int = 16384
    """Batch budget: samples are length-sorted and packed so that batch_size * longest <= this (a longer one runs
    alone)."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available). Under torchrun each rank uses cuda:LOCAL_RANK."""
    compute_dtype: str = "auto"
    """Dtype the target runs in: auto (fp32 on CPU, bf16 on CUDA), fp32 or bf16."""
    max_samples: int | None = None
    """Capture only the first N samples of the prepared set (all by default)."""
    new: bool = False
    """Wipe an existing store at --out instead of resuming it (needed when target, layers or dtype changed)."""
    shard_tokens: int = 1 << 20
    """Close a shard after this many tokens (or shard_mb, whichever comes first). A kill loses only the open shard."""
    shard_mb: int = 1024
    """Close a shard once it holds this many MiB. An open shard is held in host memory until written, so this bounds
    the writer's memory ((K+1)*H*2 bytes/token in bf16: 32 KiB/token for an 8B target)."""
    queue_size: int = 4
    """Batches waiting for the writer thread before the GPU waits for storage."""
    engine: str = "hf"
    """hf (run the target in this process), sglang (capture through a running SGLang server) or vllm-import (convert
    hidden states written by vLLM's extract_hidden_states)."""
    server: str | None = None
    """sglang engine: base URL of the SGLang server, e.g. http://127.0.0.1:30000."""
    src: str | None = None
    """vllm-import engine: directory of vLLM extract_hidden_states output to import."""
    vllm_layers: str | None = None
    """vllm-import engine: the vLLM layer ids of the captured states (input of layer j), comma-separated."""
    concurrency: int = 8
    """sglang engine: requests in flight."""

    def __post_init__(self):
        for name, allowed in (("dtype", DTYPES), ("engine", ENGINES), ("device", ("auto", "cpu", "cuda")),
                              ("compute_dtype", ("auto", "fp32", "bf16"))):
            v = getattr(self, name)
            if v not in allowed and not (name == "device" and isinstance(v, str) and v.startswith("cuda:")):
                raise HstapError(f"--{name.replace('_', '-')}: expected one of {', '.join(allowed)}, got {v!r}")
        for name in ("batch_tokens", "shard_tokens", "shard_mb", "queue_size", "concurrency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise HstapError(f"--{name.replace('_', '-')}: expected a positive integer, got {v!r}")
        if self.max_samples is not None and (isinstance(self.max_samples, bool) or not isinstance(self.max_samples, int)
                                             or self.max_samples < 0):
            raise HstapError(f"--max-samples: expected a non-negative integer, got {self.max_samples!r}")
        if self.layers is None:
            self.layers = ""
        # Absolute paths, so that config.json replays the run from any working directory.
        for name in ("target", "data", "out", "src"):
            v = getattr(self, name)
            if v:
                setattr(self, name, os.path.abspath(v))


# ---------------------------------------------------------------------------------------------------------------------
# Pieces shared with the other engines (engines/sglang.py, engines/vllm.py)


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise HstapError("RANK / WORLD_SIZE / LOCAL_RANK must be integers") from None
    if not 0 <= rank < world:
        raise HstapError(f"RANK={rank} is out of range for WORLD_SIZE={world}")
    return rank, world, local


def init_barrier(world_size: int):
    """A gloo process group for barriers and counts (no tensors of the model go through it); None for one process."""
    if world_size <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        # hours, not the default 30 min: a rank that finished waits at the final barrier for the slowest one
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
    return dist


def check_tokenizer(data: str, meta: dict, target_block: dict, max_token_id=None) -> None:
    """Refuse prepared data tokenized by another tokenizer than the target's.

    With a tokenizer in the target directory the two tokenizer_sha256 must match; without one, the prepared vocabulary
    must fit the target's embedding (vocab_size, and `max_token_id()` when given, a callable: it scans the data)."""
    want, got = target_block.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    meta_path = Path(data) / "meta.json"
    if want is not None:
        if got != want:
            raise HstapError(f"{meta_path}:1: tokenizer_sha256: the data was prepared with the tokenizer of "
                             f"{meta.get('tokenizer')!r} ({str(got)[:12]}), not the target's ({want[:12]}, "
                             f"{target_block['path']}); re-run hstap prepare --tokenizer {target_block['path']}")
        return
    V = int(target_block["vocab_size"])
    if int(meta.get("vocab_size", 0)) > V:
        raise HstapError(f"{meta_path}:1: vocab_size: the data's tokenizer has {meta.get('vocab_size')} tokens, "
                         f"more than the target's {V} embedding rows (prepared with another tokenizer?)")
    if max_token_id is not None:
        mx = max_token_id()
        if mx is not None and mx >= V:
            raise HstapError(f"{data}: token id {mx} is out of the target's vocabulary (0..{V - 1}); "
                             "prepared with another tokenizer?")


def store_header(target_block: dict, engine: dict, dtype: str, layers: list[int], cfg,
                 data_meta: dict | None = None) -> dict:
    """The StoreWriter header (see hstap/store.py). `data` records what the samples were rendered and tokenized with."""
    h = {"target": target_block, "engine": engine, "dtype": dtype, "layers": list(layers),
         "hidden_size": int(target_block["hidden_size"]),
         "capture_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg or {}),
         "git_commit": git_commit()}
    if data_meta is not None:
        keys = ("tokenizer", "tokenizer_sha256", "chat_template", "chat_template_sha256", "vocab_size", "max_len")
        h["data"] = {k: data_meta.get(k) for k in keys}
    return h


def _engine_fn(module: str, name: str):
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise HstapError(f"--engine: {module}.{name} is not available in this hstap "
                         f"({type(e).__name__}: {e})") from None
    return fn


# ---------------------------------------------------------------------------------------------------------------------
# Entry point


def capture(cfg: CaptureConfig) -> dict:
    """Capture hidden states into cfg.out; prints and returns a summary (rank 0's has the totals of all ranks)."""
    if cfg.engine == "sglang":
        return _engine_fn("hstap.engines.sglang", "run_sglang_capture")(cfg)
    if cfg.engine == "vllm-import":
        return _engine_fn("hstap.engines.vllm", "import_vllm")(cfg)
    return capture_hf(cfg)


def _dataset_columns(ds, n: int) -> tuple[list[str], list[int]]:
    """(ids, lengths) of the first n rows, read column-wise from Arrow (no Python lists of tokens)."""
    import pyarrow.compute as pc

    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    ids = [str(x) for x in ds.data.column("id").slice(0, n).to_pylist()]
    lens = pc.list_value_length(ds.data.column("input_ids").slice(0, n)).to_pylist()
    return ids, [int(x or 0) for x in lens]


def _max_token_id(ds, n: int):
    import pyarrow.compute as pc

    col = ds.data.column("input_ids").slice(0, n)
    return pc.max(pc.list_flatten(col)).as_py()


def capture_hf(cfg: CaptureConfig) -> dict:
    """The embedded engine: the HF model in this process (engines/hf.py)."""
    import torch

    from hstap.data import load_prepared, read_meta
    from hstap.engines.hf import batches_by_tokens, run_capture
    from hstap.model_dir import load_target, resolve_device, resolve_dtype, target_fingerprint
    from hstap.layers import parse_layers
    from hstap.store import StoreWriter, store_bytes_per_token

    t_start = time.perf_counter()
    rank, world, local_rank = dist_env()
    meta = read_meta(cfg.data)
    ds = load_prepared(cfg.data)
    n = len(ds) if cfg.max_samples is None else min(len(ds), cfg.max_samples)

    target_block = target_fingerprint(cfg.target)
    check_tokenizer(cfg.data, meta, target_block, max_token_id=lambda: _max_token_id(ds, n))
    layers = parse_layers(cfg.layers, target_block["num_layers"])

    device = cfg.device
    if world > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # streams, events and pinned copies then all default to the target's GPU
    compute_dtype = resolve_dtype(cfg.compute_dtype, dev)
    import transformers

    engine = {"name": "hf", "version": f"transformers {transformers.__version__}", "torch": torch.__version__,
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "compute_dtype": {torch.float32: "fp32", torch.bfloat16: "bf16"}[compute_dtype]}
    header = store_header(target_block, engine, cfg.dtype, layers, cfg, meta)

    dist = init_barrier(world)
    try:
        with StoreWriter(cfg.out, header, rank=rank, world_size=world, shard_tokens=cfg.shard_tokens, new=cfg.new,
                         shard_bytes=cfg.shard_mb << 20,
                         barrier=dist.barrier if dist else None) as writer:
            committed = writer.committed_ids()
            ids, lens = _dataset_columns(ds, n)
            mine = [i for i in range(rank, n, world) if ids[i] not in committed and lens[i] > 0]
            empty = sum(1 for i in range(rank, n, world) if lens[i] == 0)
            skipped = sum(1 for i in range(rank, n, world) if ids[i] in committed)
            todo_tokens = sum(lens[i] for i in mine)
            writer.expect(todo_tokens)  # shards shrink toward the end: little is left to write after the last forward

            batches = [[mine[j] for j in b] for b in batches_by_tokens([lens[i] for i in mine], cfg.batch_tokens)]
            t_load = time.perf_counter()
            # nothing left (a finished resume, or a rank with no share): no need to load the weights
            target = load_target(cfg.target, dev, engine["compute_dtype"])[0] if batches else None
            load_s = time.perf_counter() - t_load

            def fetch():
                for b in batches:
                    rows = ds[b]  # column dict for these rows
                    yield [{"id": str(i), "input_ids": x, "loss_mask": m}
                           for i, x, m in zip(rows["id"], rows["input_ids"], rows["loss_mask"])]

            bar = _progress(rank, todo_tokens)

            def progress(run, batch):
                if bar is not None:
                    bar.update(sum(len(s["input_ids"]) for s in batch))
                    bar.set_postfix_str(f"{run.samples}/{len(mine)} samples, {run.bytes / 1e9:.2f} GB out",
                                        refresh=False)

            stats = {"samples": 0, "tokens": 0, "bytes": 0, "seconds": 0.0, "writer_wait_s": 0.0}
            if batches:
                stats = run_capture(target, layers, writer, fetch(), dtype=cfg.dtype, queue_size=cfg.queue_size,
                                    progress=progress)
            if bar is not None:
                bar.close()
        # leaving the block closed the writer: last shard committed, barrier, rank 0 merged the manifest
        counts = [stats["samples"], stats["tokens"], stats["bytes"], skipped, empty]
        if dist is not None:
            t = torch.tensor(counts, dtype=torch.float64)
            dist.all_reduce(t)
            sec = torch.tensor([stats["seconds"]], dtype=torch.float64)
            dist.all_reduce(sec, op=dist.ReduceOp.MAX)
            counts, stats["seconds"] = [int(x) for x in t.tolist()], float(sec.item())
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()

    samples, tokens, nbytes, skipped, empty = counts
    summary = {"samples": samples, "tokens": tokens, "skipped_committed": skipped, "skipped_empty": empty,
               "seconds": round(stats["seconds"], 3), "load_s": round(load_s, 3),
               "tokens_per_s": round(tokens / stats["seconds"], 1) if stats["seconds"] > 0 else 0.0,
               "gb_written": round(nbytes / 1e9, 4), "world_size": world, "layers": layers, "dtype": cfg.dtype,
               "writer_wait_s": round(stats["writer_wait_s"], 3), "out": cfg.out}
    if rank == 0:
        summary.update(_store_totals(cfg.out, len(layers), target_block["hidden_size"], cfg.dtype,
                                     store_bytes_per_token))
        write_run_config(cfg.out, "capture", cfg)
        print(f"capture: {samples} samples, {tokens} tokens in {summary['seconds']:.1f} s on {world} process(es) "
              f"({engine['device']}, {engine['compute_dtype']}): {summary['tokens_per_s']:,.0f} tok/s; "
              f"{skipped} already in the store")
        print(f"capture: store {summary['store_samples']} samples, {summary['store_tokens']} tokens, "
              f"{summary['store_bytes'] / 1e9:.3f} GB, {summary['bytes_per_token']:.1f} bytes/token "
              f"(formula {summary['bytes_per_token_formula']}); layers {layers}, {cfg.dtype}")
        print(f"capture: wrote {cfg.out} (model load {load_s:.1f} s, total {time.perf_counter() - t_start:.1f} s)")
    return summary


def _store_totals(out: str, num_aux: int, hidden: int, dtype: str, bpt_fn) -> dict:
    from hstap.store import open_store

    s = open_store(out)
    entries = s.manifest["shards"]
    tok = sum(int(e["tokens"]) for e in entries)
    b = sum(int(e["bytes"]) for e in entries)
    return {"store_samples": len(s), "store_tokens": tok, "store_bytes": b,
            "bytes_per_token": round(b / tok, 2) if tok else 0.0,
            "bytes_per_token_formula": bpt_fn(num_aux, hidden, dtype)}


def _progress(rank: int, total_tokens: int):
    if rank != 0 or not sys.stderr.isatty():  # a log file gets the summary lines, not a progress bar
        return None
    from tqdm import tqdm

    # tok/s and ETA come from tqdm's rate; samples and GB handed to the store go in the postfix
    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="capture", file=sys.stderr, disable=None,
                dynamic_ncols=True)
