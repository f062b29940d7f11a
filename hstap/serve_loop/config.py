"""`hstap serve-loop`'s config (`ServeLoopConfig`), below the modules that read it (`hstap.serve_loop.stage`, what runs:
its module docstring; `hstap.serve_loop.updates`). It composes two of `hstap train`'s sections instead of copying
their fields: the hyper-parameters (`HyperParams`) as its `train` section (`--train.lr`), and the follow stream's
(`StreamParams`: the window, the held-back fraction, replay, the anchor store) as its `stream` section, `FLAT`
(`--keep-shards`, `--holdout-frac`, as train spells them). `TRAIN` and `STREAM` state, in one place, where the loop
departs from train's defaults; the trainer starts from a `TrainConfig` of those sections and what the loop fixes
(`hstap.serve_loop.stage.trainer_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import FLAT, LAYERS, at_least, fractions, layer_list, positive
from hstap.train.config import HyperParams, StreamParams

TRAIN = {
    "ttt": 3,  # training-time-test steps: match --k (deeper draft positions are what TTT trains)
    "batch_tokens": 4096,  # the trainer's micro-batch tokens
    "save_every": 10,  # a checkpoint every N steps: the drafters an update can take
    "log_every": 1,  # a metrics line every step: the progress line reads the trainer's step from them
}
"""The loop's trainer's hyper-parameters where they are not `hstap train`'s defaults (the `train` section's default)."""

STREAM = {
    "keep_shards": 4,  # the window: shard files the store holds at most (train --keep-shards)
    "holdout_frac": 0.15,  # the tapped requests the gate scores on, never trained on
}
"""The loop's follow stream where it is not `hstap train`'s defaults (the `stream` section's default)."""


def cpu_list(name: str, v: str) -> set[int]:
    """The CPUs of a taskset list ("0", "0-1,3"; "": none) of the flag `--name`; one error line for any other syntax,
    a reversed range among them (taskset would refuse it only once the server starts)."""
    out: set[int] = set()
    for part in filter(None, v.split(",")) if v else ():
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise HstapError(f"serve-loop: --{name.replace('_', '-')}: expected a CPU list like 0 or 0-1,3 (ranges "
                             f"low-high), got {v!r}")
        out |= set(range(int(lo), int(hi or lo) + 1))
    if v and not out:
        raise HstapError(f"serve-loop: --{name.replace('_', '-')}: expected a CPU list like 0 or 0-1,3, got {v!r}")
    return out


@dataclass(frozen=True)
class ServeLoopConfig:
    target: str
    """Target model directory (HF format) that vLLM serves."""
    prompts: str
    """Held-out conversations (JSONL / JSON / Parquet; or a prepared set): each one's last user turn, rendered with the
    target's chat template, is one request, in file order."""
    out: str
    """Work directory (store/, run/, exports/, served.jsonl, summary.json, acceptance.png, logs)."""
    mode: str = field(default="loop", metadata={"choices": ["loop", "fixed", "target"]})
    """loop: tap + follow training + drafter updates; fixed: the start drafter only (the loop off); target: no
    speculation (reference outputs and throughput)."""
    drafter: str | None = None
    """Start drafter: an hstap drafter directory or training RUN (trained offline); none: the trainer's initialisation
    (module docstring: "no drafter"). Required with --mode fixed."""
    requests: int = 0
    """Requests to serve: the first N prompts (0 = all); each prompt is sent once."""
    concurrency: int = 4
    """Requests in flight at a time."""
    max_tokens: int = 128
    """Tokens generated per request at most (greedy; stops at the target's end-of-turn / eos ids)."""
    k: int = 3
    """Draft tokens per verify step (vLLM's num_speculative_tokens; vLLM drafts chains)."""
    update_every: int = 32
    """Answered requests between drafter updates (the trainer's newest checkpoint, when newer than the served one)."""
    vocab_map: str | None = None
    """Draft vocabulary (vocab_map.safetensors or a prepared dir) of the drafter started from nothing; default: the
    whole target vocabulary. A --drafter brings its own."""
    layers: str = field(default="", metadata=LAYERS)
    """Canonical aux layers of the drafter started from nothing (default: [1, N//2-1, N-4])."""
    shard_tokens: int = 8192
    """Tokens per store shard: the unit the trainer takes and consumes."""
    max_store_gb: float | None = None
    """Also stop tapping once the store holds this many GB (the tap's max_store_gb)."""
    flush_s: float = 5.0
    """The tap commits its open shard after this many idle seconds (the end of a stream is not lost in it)."""
    tap_dtype: str = field(default="bf16", metadata={"choices": ["bf16", "fp8", "fp32"]})
    """Store dtype of the tapped states."""
    side_rows: str = field(default="none", metadata={"choices": ["none", "first", "all"]})
    """Rows of rejected drafts the tap keeps per verify step, as side branches of each stored request (a store of
    format version 2; --train.side-branches trains on them): none, the first rejected draft, or all past the accepted
    prefix."""
    side_max_accepted: int = -1
    """With --side-rows: keep only the verify steps that accepted at most this many drafts (the worst steps); -1:
    every step with a rejection."""
    train: HyperParams = field(default_factory=lambda: HyperParams(**TRAIN))
    """The trainer's hyper-parameters, `hstap train`'s (--train.lr, --train.epochs, ...): train's defaults but for
    the loop's own (TRAIN: TTT 3, micro-batches of 4,096 tokens, a checkpoint every 10 steps, a metrics line every
    step). Without --train.steps a follow run has no horizon: its learning rate is constant (--train.lr)."""
    trainer_threads: int = 1
    """Torch threads of the trainer process (CPU: the rest is the server's)."""
    gate_samples: int = 64
    """Held-back samples the gate keeps and scores on (the newest; copied into memory as shards are committed)."""
    gate_min_samples: int = 8
    """Fewer held-back samples than this: no candidate is judged yet (it is considered again at the next update)."""
    check_answers: int = 16
    """Answers that started after a load before its reload check (vLLM's acceptance after it against before it)."""
    rollback_ratio: float = 0.5
    """A load whose acceptance after it falls below this fraction of the acceptance before it is rolled back."""
    stream: StreamParams = field(default_factory=lambda: StreamParams(**STREAM), metadata=FLAT)
    """The trainer's follow stream, `hstap train`'s, under train's flags (--keep-shards: the window, default 4;
    --holdout-frac: the tapped requests the gate scores each candidate drafter on against the served one, never trained
    on, default 0.15, 0: no gate; --replay-fraction; --anchor-store with --anchor-fraction: the start drafter's own
    training store keeps it from forgetting the traffic it was trained on)."""
    server_cpus: str = ""
    """CPUs the server runs on (taskset list, e.g. "0"; its OpenMP threads bound to them on the CPU backend);
    "": unpinned."""
    trainer_cpus: str = ""
    """CPUs the trainer runs on (taskset list, e.g. "1"); "": unpinned."""
    reference: str | None = None
    """served.jsonl of a --mode target run on the same prompts: outputs compared token for token (lossless)."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "fp32", "bf16"]})
    """Server dtype: auto = fp32 on the CPU, bf16 on CUDA."""
    device: str = field(default="auto", metadata={"choices": ["auto", "cpu", "cuda"]})
    """Where vLLM and the trainer run (auto: cuda when available)."""
    max_model_len: int = 2048
    """vLLM's max_model_len: prompts longer than this minus --max-tokens are refused before anything starts."""
    kv_cache_gib: int = 1
    """CPU backend: vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, an integer, unless set in the environment)."""
    seed: int = 0
    """Seed of the drafter init, the trainer and vLLM."""
    port: int = 0
    """Server port (1-65535; 0: a free one)."""
    overwrite: bool = False
    """Replace an earlier serve-loop's --out (a directory hstap serve-loop did not write is never replaced)."""


    def __post_init__(self):
        w = "serve-loop"
        if self.mode not in ("loop", "fixed", "target"):
            raise HstapError(f"{w}: --mode: expected loop, fixed or target, got {self.mode!r}")
        if self.mode == "fixed" and not self.drafter:
            raise HstapError(f"{w}: --mode fixed serves a given drafter: pass --drafter")
        at_least(w, self, ("concurrency", "max_tokens", "k", "update_every", "shard_tokens", "trainer_threads",
                           "max_model_len", "kv_cache_gib"))
        at_least(w, self, ("requests", "port"), lo=0)  # 0: all prompts; a free port
        if self.port > 65535:
            raise HstapError(f"{w}: --port: must be a TCP port, 1-65535 (0: a free one), got {self.port}")
        positive(w, self, ("flush_s", "max_store_gb"))
        at_least(w, self, ("gate_samples", "gate_min_samples", "check_answers"))
        fractions(w, self, ("rollback_ratio",))
        if self.stream.keep_shards is None:
            raise HstapError(f"{w}: --keep-shards: the loop's store keeps a window of shards: an integer >= 1")
        if self.gate_min_samples > self.gate_samples:
            raise HstapError(f"{w}: --gate-min-samples {self.gate_min_samples} > --gate-samples {self.gate_samples}")
        for name in ("server_cpus", "trainer_cpus"):
            cpu_list(name, getattr(self, name))
        self._check_mode()
        epochs = self.train.epochs or 1
        if self.stream.keep_shards < epochs:
            raise HstapError(f"{w}: --keep-shards {self.stream.keep_shards} < --train.epochs {epochs}: a shard must stay "
                             "on disk for all its passes")
        layer_list(w, self, "layers")

    def _check_mode(self) -> None:
        """Options that mean something only in some modes are refused in the others, not ignored."""
        w = "serve-loop"
        if self.mode != "loop":
            for name, v in (("anchor_store", self.stream.anchor_store), ("max_store_gb", self.max_store_gb)):
                if v is not None:
                    raise HstapError(f"{w}: --{name.replace('_', '-')}: the trainer's and the tap's, which run only "
                                     f"in --mode loop (this is --mode {self.mode})")
        if self.mode == "target" and self.drafter:
            raise HstapError(f"{w}: --drafter: --mode target serves no drafter (target-only outputs); leave it out, "
                             f"or --mode fixed / loop")
        if self.drafter:
            for name in ("layers", "vocab_map"):
                if getattr(self, name):
                    raise HstapError(f"{w}: --{name.replace('_', '-')}: shapes the drafter started from nothing; "
                                     f"--drafter {self.drafter} brings its own")
