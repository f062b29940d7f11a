"""`hstap train`'s config, `TrainConfig`: the run (its directory, target, seed and modes) and its sections, each
handed whole to what reads it (`hstap.config`: a section checks its own fields; the run checks how they combine):

- `hyper` (`HyperParams`): what a drafter learns and at what pace (the objective, the optimizer and its schedule, the
  batches, the steps, the evaluation and checkpoint cadence): the trainer, the schedule and the loop;
- `inputs` (`TrainInputs`): where the states come from (a store, or the live target on a prepared set), the draft
  vocabulary, the aux layers and the eval split: `hstap.train.inputs`'s resolvers and the data builder;
- `drafter` (`DrafterInit`): the drafter the run starts from (its decoder layers, lm_head init, or given weights);
- `devices` (`Devices`): device, dtype, attention, compilation, sharding, loader workers, chunking;
- `stream` (`StreamParams`): how a --follow run draws from the store being written (the window it keeps, replay,
  the held-back fraction, an anchor store): `hstap.train.follow`.

Every section is `FLAT` in `hstap train`: its fields keep their flag names (`--lr`, `--store`, `--keep-shards`); in
config.json each is nested under its name (an earlier, flat config.json replays as well). Loops that train a drafter
as one of their stages embed the sections as they are: `hstap serve-loop` and `hstap demo` take `HyperParams` as their
`train` section (`--train.lr`) with their own defaults as overrides of train's, in one place; the serve loop also takes
`StreamParams` (`--keep-shards`, `--holdout-frac`, ...).

The config is what the user asked, as parsed (frozen); what a run resolves from it and its inputs (ce chunk, draft
vocabulary, vocabulary map, layers, resume point) is `hstap.train.plan.TrainPlan`. The stage itself, the objective and
every figure: `hstap.train.stage`'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import FLAT, LAYERS, FieldError, absolute, at_least, fractions, layer_list, positive

LOSS_TERMS = ("ce", "tv", "rkl", "hard", "topk")
"""Terms of `--loss`; "a+b" mixes two of them, "lk" is the adaptive ce/tv hybrid (`hstap.train.ttt.loss_core`)."""


def loss_terms(loss: str) -> list[str]:
    """The terms of a `--loss` value ("lk": ce and tv); ValueError naming it when it is none of the forms above. Read
    here, without torch, so that a config is checked before the objective's module loads."""
    names = loss.split("+") if loss != "lk" else ["ce", "tv"]
    if len(names) > 2 or any(n not in LOSS_TERMS for n in names) or len(set(names)) != len(names):
        raise ValueError(f"loss: expected one of {LOSS_TERMS}, 'a+b' of two of them, or 'lk'; got {loss!r}")
    return names


@dataclass(frozen=True, kw_only=True)
class HyperParams:
    """The hyper-parameters of a drafter's training (`hstap train`'s flags of the same names)."""

    steps: int | None = None
    """Optimizer steps to train (default: --epochs)."""
    epochs: int | None = None
    """Epochs over the training split (default 1 when --steps is not given)."""
    ttt: int = 5
    """Training-time-test steps K (1 = no TTT); 5 = eval's default k. With lr 3e-3, decay 0.6, ce+hard: chain-5
    tau 1.083x lr 2e-3 / TTT 7 / 0.8 / ce (RESULTS.md, Drafter quality); a tree deeper than K drafts untrained steps."""
    ttt_decay: float = 0.6
    """Weight of TTT step k is ttt_decay**k (0.6: the early drafts weigh most; 0.7-1.0 measured lower)."""
    loss: str = "ce+hard"
    """Per-row objective (`hstap.train.ttt.loss_core`): ce (soft cross-entropy), tv (total variation = 1 - acceptance under
    sampling), rkl (reverse KL), hard (cross-entropy against the target argmax), topk (cross-entropy over the target's
    10 most likely ids: HASS's term), 'a+b' = (1 - --loss-mix) a + --loss-mix b, or lk (per-row ce/tv hybrid
    weighted by exp(-lk_decay * acceptance))."""
    loss_mix: float = 0.5
    """Weight of the second term of an 'a+b' --loss."""
    lk_decay: float = 3.0
    """--loss lk: the cross-entropy's weight of a row is exp(-lk_decay * (1 - tv))."""
    side_branches: int = 0
    """A store with side branches (the rows of drafts the target rejected, `hstap serve-loop --side-rows`): train on
    at most this many per sample, evenly spread over it, each as one more sequence of the sample's batch
    (hstap/train/side.py: the accepted prefix, then the rejected drafts; only the rejected rows' distributions are
    targets, with --loss and TTT's decay). 0: a store's side branches are not trained on."""
    side_context: int = 64
    """Tokens of the accepted sequence before a side branch that its training sequence keeps (what the drafter
    attends to there; at least --ttt + 1, so the verify step's anchor is inside)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW; RESULTS.md: with TTT 5, 3e-3 ~ 4e-3 > 2e-3 > 1e-3 on the reference drafter). Not
    measured at wide shapes, where a lower rate (SpecForge: 1e-4) may be safer."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of --lr. 0.1 with --warmup-ratio 0.05: the best schedule on validation
    (RESULTS.md, Drafter quality: earlier findings; eval chain-5 tau 2.636 against 2.610 with 0.0 / 0.015)."""
    warmup_ratio: float = 0.05
    """Linear warmup over this fraction of the steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Clip the global gradient norm to this (0 = off)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    batch_tokens: int = 16384
    """Micro-batch size: B * max_len <= batch_tokens (a longer sample goes alone)."""
    eval_every: int = 0
    """Evaluate every N steps (0 = at every checkpoint); always at the end."""
    save_every: int = 1000
    """Write a checkpoint every N steps; always at the end."""
    keep: int = 3
    """Checkpoints kept in RUN/checkpoints (the newest)."""
    log_every: int = 10
    """Write a metrics line every N steps."""

    def __post_init__(self):
        w = "train"
        at_least(w, self, ("ttt", "grad_accum", "batch_tokens", "save_every", "keep", "log_every", "steps", "epochs"))
        at_least(w, self, ("eval_every",), lo=0)  # 0: at every checkpoint
        at_least(w, self, ("side_branches",), lo=0)
        if self.side_context < self.ttt + 1:
            raise FieldError(w, "side_context", f"must be >= --ttt + 1 = {self.ttt + 1}, got {self.side_context}")
        fractions(w, self, ("warmup_ratio",))
        for name in ("min_lr_ratio", "loss_mix"):  # 1.0: a flat schedule; the second term alone
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FieldError(w, name, f"must be in [0, 1], got {getattr(self, name)}")
        positive(w, self, ("lr",))
        positive(w, self, ("ttt_decay", "grad_clip", "lk_decay", "weight_decay"), zero=True)
        try:
            loss_terms(self.loss)
        except ValueError as e:
            raise FieldError(w, "loss", str(e).removeprefix("loss: ")) from None


@dataclass(frozen=True, kw_only=True)
class TrainInputs:
    """Where a training run's states come from, its draft vocabulary, aux layers and eval split (`hstap train`'s flags
    of the same names)."""

    store: str | None = None
    """Hidden-state store (hstap capture output) to train on (offline mode)."""
    data: str | None = None
    """Prepared set (hstap prepare output): the samples in --online mode; otherwise only the source of the vocab map."""
    online: bool = False
    """Run the target in-process on --data batches (no store, no disk) and train on its states."""
    vocab_map: str | None = None
    """vocab_map.safetensors (or a prepared dir) with d2t/t2d; default: --data's, else the store's (the prepared set's
    map, copied by capture), else derived from the store's token counts (--draft-vocab)."""
    draft_vocab: int = 0
    """Draft vocabulary size. 0: the vocab map's (--vocab-map, --data's, else the store's), or 32000 when derived from
    the store's loss-masked token counts (a store without a map). N > 0 unlike the prepared or stored map's size: the
    top N of the store's counts (clamped to V); unlike an explicit --vocab-map's: an error."""
    aux_layers: str = field(default="", metadata=LAYERS)
    """fc inputs: '' = the store's layers (online: [1, N//2-1, N-4]); 'final' = final state only (EAGLE-1-style); or a
    comma list of canonical ids (offline: a subset of the store's layers)."""
    eval_store: str | None = None
    """Separate store for evaluation (offline); default: an --eval-frac split of the training samples."""
    eval_frac: float = 0.05
    """Fraction of samples held out for evaluation, chosen by a hash of the sample id (0 = no eval split)."""
    skip_verify: bool = False
    """Skip the pre-flight check that the store matches the target (hstap.verify.stage.quick_check)."""
    allow_other_variant: bool = False
    """Train on a store whose header's target fingerprint (config.json's sha256, the weight files' fingerprint) is
    not --target's: a store captured from another variant of the model, e.g. its full-precision original when --target
    is the INT4 or FP8 checkpoint that serves. Refused by default; the recomputation of the pre-flight check still has
    to pass."""

    def __post_init__(self):
        w = "train"
        if self.online and not self.data:
            raise HstapError(f"{w}: --online needs --data PREPARED")
        if self.online and self.eval_store:
            raise HstapError(f"{w}: --eval-store: offline only (online mode evaluates on an --eval-frac split)")
        at_least(w, self, ("draft_vocab",), lo=0)  # 0: the map's
        fractions(w, self, ("eval_frac",))
        layer_list(w, self, "aux_layers")
        absolute(self, "store", "data", "vocab_map", "eval_store")


@dataclass(frozen=True, kw_only=True)
class DrafterInit:
    """The drafter a training run starts from (`hstap train`'s flags of the same names)."""

    draft_layers: int = 1
    """Drafter decoder layers: 1 = the EAGLE-3 midlayer alone; N > 1 adds N-1 plain Llama layers (vLLM export)."""
    init_lm_head: bool = True
    """Initialise the drafter lm_head from the target lm_head's rows of the draft vocabulary."""
    init_from: str | None = None
    """Start from this hstap drafter's weights (RUN/best, RUN/checkpoints/step_*, export --to hf) instead of the init;
    same config and vocab map as this run (`hstap serve-loop`: the served drafter trained on). Not with --resume's
    checkpoint, which wins."""

    def __post_init__(self):
        at_least("train", self, ("draft_layers",))


@dataclass(frozen=True, kw_only=True)
class Devices:
    """Where and how a training run computes (`hstap train`'s flags of the same names)."""

    device: str = field(default="auto", metadata={"choices": ["auto", "cpu", "cuda"]})
    """Device; under torchrun each rank takes GPU LOCAL_RANK."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "bf16", "fp32"]})
    """Compute dtype: bf16 = autocast with fp32 master weights (auto on CUDA); fp32 (auto on CPU)."""
    attn: str = field(default="auto", metadata={"choices": ["auto", "flex", "sdpa", "causal"]})
    """TTT attention: flex (auto on CUDA) and sdpa (auto on CPU) are exact; causal approximates (no TTT diagonal)."""
    compile: bool = True
    """torch.compile the decoder layers' dense parts and the CE (CUDA only): 1.6x eager's tok/s (reference shape)."""
    fsdp: bool = False
    """Shard with FSDP2 (fully_shard) instead of DDP when running under torchrun."""
    workers: int = -1
    """DataLoader worker processes (-1 = 4 on CUDA, 0 on CPU)."""
    ce_chunk: int = 0
    """Rows per chunk of the target head and of the fused lm_head + cross-entropy (memory vs. kernel size); 0 = auto:
    16,384 when a chunk's target logits are at most 2^28 values (a vocab <= 16,384), else 4,096 (the 8B's setting)."""
    peak_tflops: float = 790.0
    """Peak bf16 TFLOP/s of one device for the MFU estimate (H200: 790)."""

    def __post_init__(self):
        at_least("train", self, ("ce_chunk",), lo=0)  # 0: auto
        at_least("train", self, ("workers",), lo=-1)  # -1: auto


@dataclass(frozen=True, kw_only=True)
class StreamParams:
    """How a --follow run draws its samples from a store while it is written (`hstap train`'s flags of the same names;
    `hstap serve-loop` embeds the section as it is, under the same flags, with its own defaults)."""

    keep_shards: int | None = None
    """The window: shard files the store may hold at once (all writer ranks together; each writer rank gets N // W);
    the consuming trainer (train --consume) deletes each shard once its last use is trained and checkpointed."""
    replay_fraction: float = 0.0
    """Fraction of each slot's samples drawn again from the earlier shards the window still keeps (seeded; train: with
    --consume)."""
    holdout_frac: float = 0.0
    """Samples whose id falls in this fraction are never trained on (the same hash split as --eval-frac:
    `hstap.train.data.held_back`): held back, so that a gate (hstap serve-loop) can score candidate drafters on recent
    traffic neither drafter trained on (serve-loop: 0 = no gate, every newer checkpoint is loaded)."""
    anchor_store: str | None = None
    """A fixed store (e.g. the drafter's own offline training store, the domain it was trained on) from which each slot
    also draws --anchor-fraction of its samples: rehearsal that keeps the drafter from forgetting that domain while it
    follows served traffic. Complete, and of the followed store's target, layers, hidden size and dtype."""
    anchor_fraction: float = 0.0
    """--anchor-store: each slot also draws round(n F / (1 - F)) samples of the anchor store (n: the slot's own regular
    samples), seeded by (--seed, slot, 2), without replacement within a slot."""

    def __post_init__(self):
        w = "train"
        at_least(w, self, ("keep_shards",))
        fractions(w, self, ("replay_fraction", "holdout_frac", "anchor_fraction"))
        if bool(self.anchor_fraction) != bool(self.anchor_store):
            raise HstapError(f"{w}: --anchor-store and --anchor-fraction go together (the store each slot also draws "
                             f"from, and how much of it: > 0)")
        absolute(self, "anchor_store")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """`hstap train`: the run (its directory, target, seed and modes) and its sections (module docstring), each `FLAT`:
    their fields keep their own flag names (`--lr`, `--store`, `--device`, `--keep-shards`)."""

    out: str
    """Run directory (config.json, plan.json, metrics.jsonl, checkpoints/, best/)."""
    target: str
    """Target model directory (HF format): its config shapes the drafter; its embedding and lm_head are read from it."""
    inputs: TrainInputs = field(default_factory=TrainInputs, metadata=FLAT)
    """Where the states come from, the draft vocabulary, the aux layers, the eval split."""
    drafter: DrafterInit = field(default_factory=DrafterInit, metadata=FLAT)
    """The drafter the run starts from."""
    devices: Devices = field(default_factory=Devices, metadata=FLAT)
    """Where and how the run computes."""
    resume: bool = False
    """Continue from RUN's newest complete checkpoint (weights, optimizer, schedule, data position, RNG); a larger
    --steps extends the run (the cosine schedule is then laid out over the new total)."""
    seed: int = 0
    """Seed of the drafter init and of the data order (the eval split is a hash of the sample ids)."""
    tensorboard: bool = True
    """Also log to RUN/tb when tensorboard is installed."""
    follow: bool = False
    """Train on --store while it is written: each shard once committed, waiting when caught up; ends at --steps or
    when every writer closed the store and every sample was used --epochs times (`hstap.train.follow`)."""
    consume: bool = False
    """--follow: delete each shard once its last use is trained and checkpointed; the writers keep to --keep-shards."""
    stream: StreamParams = field(default_factory=StreamParams, metadata=FLAT)
    """--follow: how the run draws from the store being written."""
    hyper: HyperParams = field(default_factory=HyperParams, metadata=FLAT)
    """What the drafter learns and at what pace."""

    def __post_init__(self):
        w = "train"
        if not self.inputs.online and not self.inputs.store:
            raise HstapError(f"{w}: --store: required (or --online --data PREPARED)")
        if self.hyper.steps is not None and self.hyper.epochs is not None and not self.follow:
            raise HstapError(f"{w}: give --steps or --epochs, not both")
        if self.follow or self.consume or self.stream != StreamParams():
            self._check_follow()
        absolute(self, "out", "target")

    def _check_follow(self) -> None:
        w, inp, st = "train", self.inputs, self.stream
        if not self.follow:
            raise HstapError(f"{w}: --consume, --keep-shards, --replay-fraction, --holdout-frac and --anchor-store "
                             f"need --follow")
        if inp.online:
            raise HstapError(f"{w}: --follow follows a --store; it has no --online mode")
        if self.consume != (st.keep_shards is not None):
            raise HstapError(f"{w}: --consume and --keep-shards go together (the window the store's writers keep to)")
        if st.replay_fraction and not self.consume:
            raise HstapError(f"{w}: --replay-fraction draws from the shards --consume keeps: pass --consume "
                             f"--keep-shards N")
        if not (inp.vocab_map or inp.data):
            raise HstapError(f"{w}: --follow: the draft vocabulary must be fixed before the store is complete: pass "
                             f"--vocab-map (or --data PREPARED, whose vocab map is used)")
        if inp.eval_frac > 0 and not inp.eval_store:
            raise HstapError(f"{w}: --follow: evaluation needs a fixed held-out set: pass --eval-store STORE, or "
                             f"--eval-frac 0")
