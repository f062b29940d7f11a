"""`hstap capture`: run the target over a prepared set and store the hidden states an EAGLE-3 drafter trains on.

    hstap capture --target MODEL_DIR --data PREPARED --out STORE             # one GPU (bf16), or the CPU (fp32)
    torchrun --nproc-per-node 8 -m hstap.cli capture --target MODEL_DIR --data PREPARED --out STORE
    hstap capture --target ../shared/reference/target-tiny --data runs/prepared --out runs/store \
        --dtype fp32 --device cpu

What is stored per sample (format: `hstap/store/format.py`): input_ids, loss_mask, `aux` = outputs of the decoder layers
`--layers` (canonical ids, default [1, N//2-1, N-4]) and `final` = the final-norm output, in `--dtype`.

Resumable: a sample is written once its shard commits; killing the run (even with SIGKILL) loses at most the open
shards, and re-running the same command skips every committed sample, once every committed shard is checked against
its recorded size and checksum (a damaged one is refused by name: its samples are not "already captured"). A store made with another target, tokenizer,
layer set or dtype is refused unless `--new` (which wipes it). Data prepared with another tokenizer than the target's
is refused, and so is data rendered with another chat template than the target's (unless --allow-template-mismatch).
The prepared set's draft vocabulary map is copied into the store (STORE/vocab_map.safetensors, its sha256 in the
header), so that `hstap train --store STORE` uses the vocabulary chosen at prepare (--draft-vocab).

Multi-GPU: under torchrun each rank takes samples rank::world_size, runs its own copy of the model on cuda:LOCAL_RANK
and writes its own shards; rank 0 merges the manifest after a barrier (a gloo process group is used only for barriers
and the final counts; torchrun's environment is read by hstap/dist.py). Engines, each owning its capture loop:
`hf` (embedded, capture/hf.py), `sglang` (a server with the hstap plugin and hook, capture/sglang/hook.py, driven by
capture/sglang/driver.py), `vllm` (vLLM's own engine with hstap's connector, capture/vllm/connector.py, driven by
capture/vllm/driver.py) and `vllm-import` (convert stock vLLM extract_hidden_states output,
capture/vllm/importer.py). This module holds what they share: the config, the input checks (`open_inputs`: the data's
tokenizer and template against the target's, `hstap.data.fits`; `check_out`: a store to resume made with this run's
target, layers and dtype, its committed shards at their recorded sizes and checksums), the store header and the
summary pieces. Everything is checked before the store is created or extended: a run refused on its inputs leaves
--out as it was.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hstap.common import HstapError, atomic_write_bytes, git_commit, sha256_bytes

# --engine NAME -> "module:function" that runs it. Loaded on use: the config is checked before torch or any engine is
# imported, and this module depends on no engine (each engine owns its capture loop and uses the pieces below).
ENGINES = {"hf": "hstap.capture.hf:capture_hf", "sglang": "hstap.capture.sglang.driver:run_sglang_capture",
           "vllm": "hstap.capture.vllm.driver:run_vllm_capture", "vllm-import": "hstap.capture.vllm.importer:import_vllm"}
DTYPES = ("bf16", "fp8", "fp32")


@dataclass
class CaptureConfig:
    target: str
    """Target model directory (HF format: config.json, safetensors weights, tokenizer)."""
    data: str
    """Prepared dataset directory (output of `hstap prepare`, made with the target's tokenizer)."""
    out: str
    """Store directory to create or resume (see hstap/store/format.py for the format)."""
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
    """Capture only the first N >= 1 samples of the prepared set (all by default)."""
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
    """hf (run the target in this process), sglang (through a running SGLang server with hstap's hook), vllm (vLLM's
    engine with hstap's connector: in this process, or a running server with --server) or vllm-import (convert files
    written by stock vLLM's extract_hidden_states)."""
    server: str | None = None
    """sglang / vllm engine: base URL of the server, e.g. http://127.0.0.1:30000 (vllm: without it, vLLM runs in this
    process)."""
    src: str | None = None
    """vllm-import engine: directory of vLLM extract_hidden_states output to import."""
    vllm_layers: str | None = None
    """vllm-import engine: the vLLM layer ids of the captured states (input of layer j), comma-separated."""
    concurrency: int = 8
    """sglang / vllm --server: requests in flight."""
    allow_template_mismatch: bool = False
    """Capture data rendered with another chat template than the target's (refused by default: the drafter would
    learn from conversations laid out unlike the ones it will serve)."""

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
                                             or self.max_samples < 1):  # 0 would write an empty store and succeed
            raise HstapError(f"--max-samples: expected a positive integer, got {self.max_samples!r}")
        if self.layers is None:
            self.layers = ""
        # Absolute paths, so that config.json replays the run from any working directory.
        for name in ("target", "data", "out", "src"):
            v = getattr(self, name)
            if v:
                setattr(self, name, os.path.abspath(v))


# ---------------------------------------------------------------------------------------------------------------------
# Entry point


def capture(cfg: CaptureConfig) -> dict:
    """Capture hidden states into cfg.out; prints and returns a summary (rank 0's has the totals of all ranks)."""
    module, name = ENGINES[cfg.engine].split(":")
    return getattr(importlib.import_module(module), name)(cfg)


# ---------------------------------------------------------------------------------------------------------------------
# Pieces every engine uses (capture/hf.py, capture/sglang/driver.py, capture/vllm/importer.py)


def open_inputs(cfg, rank: int = 0, world: int = 1, scan: bool = False,
                check_store: bool = True) -> tuple[dict, object, int, dict]:
    """(prepared meta, prepared dataset, samples to capture (--max-samples), the target's header block) of a capture
    run, after refusing data made with another tokenizer or chat template than the target's (scan: also the largest
    token id, where the target has no tokenizer to compare) and (check_store) a damaged store to resume (`check_out`;
    an engine that builds its header first calls it itself, with the header)."""
    from hstap.data.fits import check_template, check_tokenizer
    from hstap.data.prepare import load_prepared, max_token_id, read_meta
    from hstap.model_dir import target_fingerprint

    meta = read_meta(cfg.data)
    ds = load_prepared(cfg.data)
    n = len(ds) if cfg.max_samples is None else min(len(ds), cfg.max_samples)
    tb = target_fingerprint(cfg.target)
    check_tokenizer(cfg.data, meta, tb, max_token_id=(lambda: max_token_id(ds, n)) if scan else None)
    check_template(cfg.data, meta, tb, cfg.allow_template_mismatch)
    if check_store:
        check_out(cfg, rank, world)
    return meta, ds, n, tb


def check_out(cfg, rank: int = 0, world: int = 1, header: dict | None = None) -> bool:
    """The store a capture resumes (--out without --new), before any sample is counted as already captured: made with
    this run's target, layers and dtype (`header`, when given: refused before anything is loaded), and every committed
    shard present at its recorded size and hashed against its checksum (ranks split the shards). Returns whether there
    is a store to resume."""
    from hstap.store.format import check_resumable, check_store_dir
    from hstap.store.reader import open_store

    if not check_store_dir(cfg.out) or cfg.new:  # a directory of other files is refused, --new or not
        return False
    if header is not None:
        check_resumable(cfg.out, header)
    try:
        st = open_store(cfg.out).check(rank, world)
    except HstapError as e:
        raise HstapError(f"{e}; --new captures the store again from scratch") from None
    if rank == 0 and st["checksums"] and st["shards"]:
        print(f"capture: checked the {st['shards']} committed shard(s) of {cfg.out} against their checksums: "
              f"{st['gb']:.3f} GB in {st['seconds']:.1f} s" + (f" (rank 0's share of {world})" if world > 1 else ""),
              file=sys.stderr)
    return True


def store_header(target_block: dict, engine: dict, dtype: str, layers: list[int], cfg,
                 data_meta: dict | None = None, work: dict | None = None) -> dict:
    """The StoreWriter header (see hstap/store/format.py). `data` records what the samples were rendered and tokenized
    with; `vocab_map` the prepared set's draft vocabulary map (`hstap.data.vocab.vocab_map_record`), when it has one;
    `work` the store's identity (format.py: kind, producer, data): `work`, else a capture of the prepared set
    `data_meta` describes (its path, and the sha256 of its meta.json's content)."""
    from hstap.data.vocab import vocab_map_record

    h = {"target": target_block, "engine": engine, "dtype": dtype, "layers": list(layers),
         "hidden_size": int(target_block["hidden_size"]),
         "capture_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg or {}),
         "git_commit": git_commit()}
    if data_meta is not None:
        keys = ("tokenizer", "tokenizer_sha256", "chat_template", "chat_template_sha256", "vocab_size", "max_len")
        h["data"] = {k: data_meta.get(k) for k in keys}
        path = (cfg.get("data") if isinstance(cfg, dict) else getattr(cfg, "data", None)) or ""
        rec = vocab_map_record(path)
        if rec is not None:
            h["vocab_map"] = rec
        work = work or {"kind": "prepared", "producer": "hstap capture",
                        "data": {"path": path, "sha256": sha256_bytes(json.dumps(data_meta, sort_keys=True))}}
    if work is not None:
        h["work"] = work
    return h


def copy_vocab_map(data: str, out: str) -> None:
    """Copy PREPARED/vocab_map.safetensors into the store (atomically) when the store's header records that very file
    (same sha256) and the store lacks it: after the store is created, or on the resume of a run killed before.
    A store created from another prepared set keeps its own map (with a note)."""
    from hstap.data.vocab import VOCAB_MAP_FILE, vocab_map_record
    from hstap.store.format import load_manifest

    rec, stored = vocab_map_record(data), load_manifest(Path(out)).get("vocab_map")
    if rec is None or stored is None:
        return
    if rec["sha256"] != stored.get("sha256"):
        print(f"capture: note: {out} keeps the draft vocabulary map it was created with ({stored.get('size')} ids), "
              f"not {data}'s ({rec['size']} ids)", file=sys.stderr)
        return
    dst = Path(out) / VOCAB_MAP_FILE
    src_bytes = (Path(data) / VOCAB_MAP_FILE).read_bytes()
    if not dst.is_file() or dst.read_bytes() != src_bytes:
        atomic_write_bytes(dst, src_bytes)


def short_id(sample_id: str, n: int = 60) -> str:
    """A sample id for a message: repr, cut to n characters (ids can be anything, e.g. 5000 characters)."""
    r = repr(sample_id)
    return r if len(r) <= n else r[:n] + f"...({len(sample_id)} chars)"


def store_totals(out: str, num_aux: int, hidden: int, dtype: str) -> dict:
    """What the store at `out` holds now (samples, tokens, bytes, bytes per token) and the bytes-per-token formula."""
    from hstap.store.format import store_bytes_per_token
    from hstap.store.reader import open_store

    s = open_store(out)
    entries = s.manifest["shards"]
    tok = sum(int(e["tokens"]) for e in entries)
    b = sum(int(e["bytes"]) for e in entries)
    return {"store_samples": len(s), "store_tokens": tok, "store_bytes": b,
            "bytes_per_token": round(b / tok, 2) if tok else 0.0,
            "bytes_per_token_formula": store_bytes_per_token(num_aux, hidden, dtype)}


def progress_bar(rank: int, total_tokens: int):
    """A tqdm bar of captured tokens on rank 0 when stderr is a terminal, else None."""
    if rank != 0 or not sys.stderr.isatty():  # a log file gets the summary lines, not a progress bar
        return None
    from tqdm import tqdm

    # tok/s and ETA come from tqdm's rate; samples and GB handed to the store go in the postfix
    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="capture", file=sys.stderr, disable=None,
                dynamic_ncols=True)
