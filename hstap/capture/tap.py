"""Capture in the pass that generates: store samples made of a prompt and the answer the target generated for it, with
the states the target computed while generating (the prompt's at prefill, each answer token's at its decode step),
so that the target runs once per sample instead of twice (`hstap generate` then `hstap capture`).

Used by `hstap generate --capture STORE` (embedded engine: `generate` below composes the data stage's generate with a
`GeneratedStore`, since the data stage never imports this one); the servers' tap modes (hstap's vLLM connector, the SGLang
hook) share what tapping means here: which requests are kept (`tapped`), the bound on the store (`TapBudget`) and the
header's `contents`. A sample is a conversation's last assistant turn: input_ids
= the rendered prompt + the generated tokens the target was fed (the stop token and, for an answer cut at
--max-new-tokens, the last token were never fed, so they have no state; vLLM's `include_output_tokens` keeps the same
tokens), loss_mask = 1 on the answer, 0 on the prompt (earlier assistant turns included). The state of token t is the
one that predicted token t+1, as capture stores it. A multi-turn conversation keeps its KV-cache row across its turns
(`hstap generate`'s continuous engine, hstap/data/continuous.py), and the states with it: the last turn's sample takes
the earlier turns' states from the passes that computed them (prefill or decode step) and computes only what the turn
adds, so the tap costs no more prefill than generating does (tested equal to a prefill recompute, fp32, on the real
SmolLM2 too). An answer cut at --max-new-tokens ends its sample at the cut (no closing token the target did not
produce). Same store format, header and commit protocol as `hstap capture`;
the header's `contents` says what the samples are (`"generated"` here; `"served traffic"` for a server's tap).

Exactly once with the JSONL: a conversation's line is appended to the generate output only once its sample's shard is
committed (`StoreWriter.when_written`), so a kill loses both or neither; on resume a conversation already in the store
but not yet in the JSONL (killed between the two) is generated again and only its line is written.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from hstap.common import HstapError
from hstap.data.generate_config import GenerateConfig

CONTENTS = {"generated": "the target's own answers, generated and captured in one pass (hstap generate --capture)",
            "served traffic": "requests a server answered, prompts and generated tokens, captured while serving"}


def contents_block(kind: str, **extra) -> dict:
    """The store header's `contents`: what its samples are and where their loss mask is."""
    return {"kind": kind, "what": CONTENTS[kind], "loss_mask": "1 on the generated tokens of the answer", **extra}


def tapped(request_id: str, fraction: float) -> bool:
    """Whether a server's tap keeps this request: a hash of its id below `fraction` (the same answer on every rank and
    every restart)."""
    if fraction >= 1.0:
        return True
    h = int.from_bytes(hashlib.sha256(str(request_id).encode()).digest()[:8], "little")
    return h < fraction * 2 ** 64


class TapBudget:
    """`max_store_gb` of a server's tap: the store's size on disk (re-read every `rescan_s`, so that shards a
    `train --follow --keep-shards` consumer deleted free room) plus what was taken since; a rescan forgets what is
    taken but not yet on disk, so the store may pass the bound by about one open shard. None: unbounded."""

    def __init__(self, store: str, max_gb: float | None, rescan_s: float = 30.0):
        self.store, self.max_bytes, self.rescan_s = Path(store), None if max_gb is None else max_gb * 1e9, rescan_s
        self.used, self.scanned = 0, None

    def take(self, nbytes: int) -> bool:
        """Reserve `nbytes` for one sample; False (nothing reserved) when it would pass the bound."""
        if self.max_bytes is None:
            return True
        now = time.monotonic()
        if self.scanned is None or now - self.scanned > self.rescan_s:
            self.used = _disk_bytes(self.store)
            self.scanned = now
        if self.used + nbytes > self.max_bytes:
            return False
        self.used += nbytes
        return True


def _disk_bytes(d: Path) -> int:
    """Bytes of the files under `d` (0 when absent); a file deleted while counted (a consumer's) counts 0."""
    n = 0
    for f in d.rglob("*") if d.is_dir() else ():
        try:
            n += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return n


class GeneratedStore:
    """A store written from generated answers (module docstring); `add` per finished answer, `close` at the end."""

    def __init__(self, store: str, target: str, layers: str, dtype: str, cfg: GenerateConfig, compute_dtype: str,
                 new: bool, shard_tokens: int = 1 << 20):
        """cfg: the generate run's config, recorded in the store header as `capture_config`."""
        import transformers

        from hstap.capture.inputs import check_out, store_header
        from hstap.data.conversations import files_fingerprint
        from hstap.store.manifest import committed_ids_of
        from hstap.layers import parse_layers
        from hstap.artifacts.model_dir import target_fingerprint
        from hstap.store.writer import StoreWriter

        if dtype not in ("bf16", "fp8", "fp32"):
            raise HstapError(f"--capture-dtype: expected bf16, fp8 or fp32, got {dtype!r}")
        tb = target_fingerprint(target)
        self.layers = parse_layers(layers, tb["num_layers"])
        engine = {"name": "hf-generate", "version": f"transformers {transformers.__version__}", "device": "embedded",
                  "compute_dtype": compute_dtype}
        data = {"tokenizer": target, "tokenizer_sha256": tb.get("tokenizer_sha256"), "chat_template": target,
                "chat_template_sha256": tb.get("chat_template_sha256"), "vocab_size": tb["vocab_size"],
                "max_len": None}
        # no prepared set: its data block is the target's
        header = store_header(tb, engine, dtype, self.layers, asdict(cfg))
        header.update(data=data, contents=contents_block("generated"),
                      work={"kind": "generated", "producer": "hstap generate --capture",
                            "data": {"path": list(cfg.data), "sha256": files_fingerprint(cfg.data)}})
        # A store to resume is checked now (its header, its shards), and the writer made at the first answer: a run
        # that fails before it has one (a target that does not load) leaves no store behind to refuse the next run.
        resume = check_out(store, new, header=header)
        self.committed = committed_ids_of(store) if resume else set()
        self.writer: StoreWriter | None = None
        self._open = lambda: StoreWriter(store, header, new=new, shard_tokens=shard_tokens)
        self.samples = self.tokens = 0

    def add(self, sample_id: str, prompt: list[int], answer: list[int], states, then: Callable[[], object]) -> bool:
        """Queue the sample of one answer (`states` = (aux (T, K, H), final (T, H)) from `generate_batch`); `then()`
        runs once it is committed (at once when the store has it already, or when there is nothing to store)."""
        if sample_id in self.committed or states is None:
            then()
            return False
        aux, final = states
        T, P = int(aux.shape[0]), len(prompt)
        if not P <= T <= P + len(answer):
            raise HstapError(f"generate --capture: {sample_id}: {T} states for a {P}-token prompt and a "
                             f"{len(answer)}-token answer")
        ids = torch.tensor(prompt + answer[:T - P], dtype=torch.long)  # (T,)
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[P:] = 1
        if self.writer is None:
            self.writer = self._open()
        self.writer.add(sample_id, ids, mask, aux, final)  # (T, K, H), (T, H)
        self.writer.when_written(then)
        self.committed.add(sample_id)
        self.samples, self.tokens = self.samples + 1, self.tokens + T
        return True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def generate(cfg: GenerateConfig) -> dict:
    """`hstap generate` (`hstap.data.generate_config.GenerateConfig`): with --capture STORE, the data stage's generate
    with a `GeneratedStore` as its tap, made where the data stage would make it (after its output's resume checks)."""
    from hstap.data.generate import generate as run

    if cfg.capture is None:
        return run(cfg)
    from hstap.device import resolve_device, resolve_dtype

    def make_tap() -> GeneratedStore:
        dt = resolve_dtype(cfg.dtype, resolve_device(cfg.device))
        name = str(dt).replace("torch.", "").replace("float32", "fp32").replace("bfloat16", "bf16")
        return GeneratedStore(cfg.capture, cfg.target, cfg.layers, cfg.capture_dtype, cfg, name, cfg.new)

    return run(cfg, make_tap)
