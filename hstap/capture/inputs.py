"""What a capture run needs, resolved once (`resolve` -> `CapturePlan`), and the pieces every engine uses: the store to
resume (`check_out`), the store header (`store_header`, also the servers' taps'), the prepared set's vocabulary map
(`copy_vocab_map`), messages and summaries. It lives below the stage (`hstap.capture.stage`, which reaches the engines)
and the engines (capture/hf/driver.py, capture/sglang/driver.py, capture/vllm/driver.py, capture/vllm/importer.py), which
call it and never the stage.

`resolve` reads the prepared set and the target once and refuses data made with another tokenizer or chat template
than the target's (`hstap.data.fits`), then (`check_store`) a damaged store to resume, then the layers: --layers, or
for vllm-import the canonical ids of --vllm-layers. An engine that builds its header before it checks the store (the
embedded one: its device and compute dtype go into it) calls `check_out` itself, with the header.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from hstap.capture.config import CaptureConfig
from hstap.common import HstapError, atomic_write_bytes, git_commit, sha256_bytes


@dataclass(frozen=True, eq=False)
class CapturePlan:
    """The inputs of one capture run, resolved (module docstring)."""

    meta: dict
    """The prepared set's meta (what its samples were rendered and tokenized with)."""
    ds: object
    """The prepared dataset."""
    n: int
    """Samples to capture: its first n rows (--max-samples)."""
    target: dict
    """The target's header block (`hstap.artifacts.model_dir.target_fingerprint`)."""
    layers: tuple[int, ...]
    """The canonical layer ids to tap."""

    def header(self, engine: dict, cfg: CaptureConfig) -> dict:
        """The store header of this run on `engine` (`store_header`)."""
        return store_header(self.target, engine, cfg.dtype, list(self.layers), dataclasses.asdict(cfg), self.meta)


def resolve(cfg: CaptureConfig, rank: int = 0, world: int = 1, scan: bool = False,
            check_store: bool = True) -> CapturePlan:
    """The plan of a capture run, after refusing data made with another tokenizer or chat template than the target's
    (scan: also the largest token id, where the target has no tokenizer to compare), (check_store) a damaged store to
    resume (`check_out`; an engine that builds its header first calls it itself, with the header) and layers the
    target does not have."""
    from hstap.data.fits import check_template, check_tokenizer
    from hstap.data.prepare import load_prepared, max_token_id, read_meta
    from hstap.artifacts.model_dir import target_fingerprint

    meta = read_meta(cfg.data)
    ds = load_prepared(cfg.data)
    n = len(ds) if cfg.max_samples is None else min(len(ds), cfg.max_samples)
    tb = target_fingerprint(cfg.target)
    check_tokenizer(cfg.data, meta, tb, max_token_id=(lambda: max_token_id(ds, n)) if scan else None)
    check_template(cfg.data, meta, tb, cfg.allow_template_mismatch)
    if check_store:
        check_out(cfg.out, cfg.new, rank, world)
    return CapturePlan(meta, ds, n, tb, tuple(_layers(cfg, tb["num_layers"])))


def _layers(cfg: CaptureConfig, N: int) -> list[int]:
    """The canonical layers of the run: --layers; vllm-import: those of --vllm-layers (--layers, if given, must
    agree)."""
    from hstap.layers import parse_layers, parse_vllm_layers

    if cfg.engine != "vllm-import":
        return parse_layers(cfg.layers, N)
    layers = parse_vllm_layers(cfg.vllm_layers, N)[1]
    if cfg.layers and parse_layers(cfg.layers, N) != layers:
        raise HstapError(f"--layers {cfg.layers} disagrees with --vllm-layers {cfg.vllm_layers} (canonical {layers}); "
                         "leave --layers empty")
    return layers


def check_out(out: str, new: bool, rank: int = 0, world: int = 1, header: dict | None = None) -> bool:
    """The store a capture resumes (`out`, unless `new`: --out without --new), before any sample is counted as already
    captured: made with this run's target, layers and dtype (`header`, when given: refused before anything is loaded),
    and every committed shard present at its recorded size and hashed against its checksum (ranks split the shards).
    Returns whether there is a store to resume."""
    from hstap.store.header import check_resumable
    from hstap.store.manifest import check_store_dir
    from hstap.store.reader import open_store

    if not check_store_dir(out) or new:  # a directory of other files is refused, --new or not
        return False
    if header is not None:
        check_resumable(out, header)
    try:
        st = open_store(out).check(rank, world)
    except HstapError as e:
        raise HstapError(f"{e}; --new captures the store again from scratch") from None
    if rank == 0 and st["checksums"] and st["shards"]:
        print(f"capture: checked the {st['shards']} committed shard(s) of {out} against their checksums: "
              f"{st['gb']:.3f} GB in {st['seconds']:.1f} s" + (f" (rank 0's share of {world})" if world > 1 else ""),
              file=sys.stderr)
    return True


def store_header(target_block: dict, engine: dict, dtype: str, layers: list[int], config: dict,
                 data_meta: dict | None = None, work: dict | None = None) -> dict:
    """The StoreWriter header (see hstap/store/format.py). `config`: what made the store (a capture config as a dict,
    or a tap's settings), recorded as `capture_config`; `data` records what the samples were rendered and tokenized
    with; `vocab_map` the prepared set's draft vocabulary map (`hstap.artifacts.vocab_map.vocab_map_record`) of the prepared
    set `config["data"]`, when it has one; `work` the store's identity (format.py: kind, producer, data): `work`, else
    a capture of the prepared set `data_meta` describes (its path, and the sha256 of its meta.json's content)."""
    from hstap.artifacts.vocab_map import vocab_map_record

    h = {"target": target_block, "engine": engine, "dtype": dtype, "layers": list(layers),
         "hidden_size": int(target_block["hidden_size"]),
         "capture_config": dict(config),
         "git_commit": git_commit()}
    if data_meta is not None:
        keys = ("tokenizer", "tokenizer_sha256", "chat_template", "chat_template_sha256", "vocab_size", "max_len")
        h["data"] = {k: data_meta.get(k) for k in keys}
        path = config.get("data") or ""
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
    from hstap.artifacts.vocab_map import VOCAB_MAP_FILE, vocab_map_record
    from hstap.store.manifest import load_manifest

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
