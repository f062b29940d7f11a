"""`hstap train`'s config: `HyperParams`, the section that decides what a drafter learns and at what pace (the
objective, the optimizer and its schedule, the batches, the steps, the evaluation and checkpoint cadence), and
`TrainConfig`, which extends it with the run's inputs, devices and modes. Loops that train a drafter as one of their
stages (`hstap serve-loop`, `hstap demo`) embed `HyperParams` as their `train` section (`--train.lr`) and state their
own defaults as overrides of train's, in one place.

The config is what the user asked, as parsed (frozen); what a run resolves from it and its inputs (ce chunk, draft
vocabulary, vocabulary map, layers, resume point) is `hstap.train.plan.TrainPlan`. The stage itself, the objective and
every figure: `hstap.train.stage`'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import LAYERS, absolute, at_least, layer_list

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
            raise HstapError(f"{w}: --side-context must be >= --ttt + 1 = {self.ttt + 1} (got {self.side_context})")
        if not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise HstapError(f"{w}: --warmup-ratio must be in [0, 1) and --min-lr-ratio in [0, 1]")
        if self.lr <= 0 or self.grad_clip < 0:
            raise HstapError(f"{w}: --lr must be > 0 and --grad-clip >= 0")
        try:
            loss_terms(self.loss)
        except ValueError as e:
            raise HstapError(f"{w}: --{e}") from None
        if not 0.0 <= self.loss_mix <= 1.0 or self.lk_decay < 0:
            raise HstapError(f"{w}: --loss-mix must be in [0, 1] and --lk-decay >= 0")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(HyperParams):
    """`hstap train`: the hyper-parameters (`HyperParams`) and the run's inputs, devices and modes."""

    out: str
    """Run directory (config.json, metrics.jsonl, checkpoints/, best/)."""
    target: str
    """Target model directory (HF format): its config shapes the drafter; its embedding and lm_head are read from it."""
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
    draft_layers: int = 1
    """Drafter decoder layers: 1 = the EAGLE-3 midlayer alone; N > 1 adds N-1 plain Llama layers (vLLM export)."""
    eval_store: str | None = None
    """Separate store for evaluation (offline); default: an --eval-frac split of the training samples."""
    eval_frac: float = 0.05
    """Fraction of samples held out for evaluation, chosen by a hash of the sample id (0 = no eval split)."""
    resume: bool = False
    """Continue from RUN's newest complete checkpoint (weights, optimizer, schedule, data position, RNG); a larger
    --steps extends the run (the cosine schedule is then laid out over the new total)."""
    skip_verify: bool = False
    """Skip the pre-flight check that the store matches the target (hstap.verify.stage.quick_check)."""
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
    init_lm_head: bool = True
    """Initialise the drafter lm_head from the target lm_head's rows of the draft vocabulary."""
    init_from: str | None = None
    """Start from this hstap drafter's weights (RUN/best, RUN/checkpoints/step_*, export --to hf) instead of the init;
    same config and vocab map as this run (`hstap serve-loop`: the served drafter trained on). Not with --resume's
    checkpoint, which wins."""
    seed: int = 0
    """Seed of the drafter init and of the data order (the eval split is a hash of the sample ids)."""
    peak_tflops: float = 790.0
    """Peak bf16 TFLOP/s of one device for the MFU estimate (H200: 790)."""
    tensorboard: bool = True
    """Also log to RUN/tb when tensorboard is installed."""
    follow: bool = False
    """Train on --store while it is written: each shard once committed, waiting when caught up; ends at --steps or
    when every writer closed the store and every sample was used --epochs times (module docstring)."""
    consume: bool = False
    """--follow: delete each shard once its last use is trained and checkpointed; the writers keep to --keep-shards."""
    keep_shards: int | None = None
    """--consume: shard files the store may hold at once (all writer ranks together; each writer rank gets N // W)."""
    replay_fraction: float = 0.0
    """--consume: fraction of each slot's samples drawn again from the earlier shards it still keeps (seeded)."""
    holdout_frac: float = 0.0
    """--follow: samples whose id falls in this fraction are never trained on (the same hash split as --eval-frac:
    `hstap.train.data.held_back`): held back, so that a gate (hstap serve-loop) can score candidate drafters on recent
    traffic neither drafter trained on."""
    anchor_store: str | None = None
    """--follow: a fixed store (e.g. the drafter's own offline training store, the domain it was trained on) from which
    each slot also draws --anchor-fraction of its samples: rehearsal that keeps the drafter from forgetting that domain
    while it follows served traffic. Complete, and of the followed store's target, layers, hidden size and dtype."""
    anchor_fraction: float = 0.0
    """--anchor-store: each slot also draws round(n F / (1 - F)) samples of the anchor store (n: the slot's own regular
    samples), seeded by (--seed, slot, 2), without replacement within a slot."""

    def __post_init__(self):
        w = "train"
        if self.online and not self.data:
            raise HstapError(f"{w}: --online needs --data PREPARED")
        if not self.online and not self.store:
            raise HstapError(f"{w}: --store: required (or --online --data PREPARED)")
        if self.online and self.eval_store:
            raise HstapError(f"{w}: --eval-store: offline only (online mode evaluates on an --eval-frac split)")
        if self.steps is not None and self.epochs is not None and not self.follow:
            raise HstapError(f"{w}: give --steps or --epochs, not both")
        if (self.follow or self.consume or self.keep_shards is not None or self.replay_fraction or self.holdout_frac
                or self.anchor_store or self.anchor_fraction):
            self._check_follow()
        super().__post_init__()
        at_least(w, self, ("draft_layers",))
        at_least(w, self, ("draft_vocab", "ce_chunk"), lo=0)  # 0: auto
        at_least(w, self, ("workers",), lo=-1)  # -1: auto
        if not 0.0 <= self.eval_frac < 1.0:
            raise HstapError(f"{w}: --eval-frac: must be in [0, 1), got {self.eval_frac}")
        layer_list(w, self, "aux_layers")
        absolute(self, "out", "target", "store", "data", "vocab_map", "eval_store", "anchor_store")

    def _check_follow(self) -> None:
        w = "train"
        if not self.follow:
            raise HstapError(f"{w}: --consume, --keep-shards, --replay-fraction, --holdout-frac and --anchor-store "
                             f"need --follow")
        if self.online:
            raise HstapError(f"{w}: --follow follows a --store; it has no --online mode")
        if self.consume != (self.keep_shards is not None):
            raise HstapError(f"{w}: --consume and --keep-shards go together (the window the store's writers keep to)")
        at_least(w, self, ("keep_shards",))
        if not 0.0 <= self.replay_fraction < 1.0:
            raise HstapError(f"{w}: --replay-fraction: must be in [0, 1), got {self.replay_fraction}")
        if not 0.0 <= self.holdout_frac < 1.0:
            raise HstapError(f"{w}: --holdout-frac: must be in [0, 1), got {self.holdout_frac}")
        if not 0.0 <= self.anchor_fraction < 1.0:
            raise HstapError(f"{w}: --anchor-fraction: must be in [0, 1), got {self.anchor_fraction}")
        if bool(self.anchor_fraction) != bool(self.anchor_store):
            raise HstapError(f"{w}: --anchor-store and --anchor-fraction (> 0) go together (the store each slot also "
                             f"draws from, and how much)")
        if self.replay_fraction and not self.consume:
            raise HstapError(f"{w}: --replay-fraction draws from the shards --consume keeps: pass --consume "
                             f"--keep-shards N")
        if not (self.vocab_map or self.data):
            raise HstapError(f"{w}: --follow: the draft vocabulary must be fixed before the store is complete: pass "
                             f"--vocab-map (or --data PREPARED, whose vocab map is used)")
        if self.eval_frac > 0 and not self.eval_store:
            raise HstapError(f"{w}: --follow: evaluation needs a fixed held-out set: pass --eval-store STORE, or "
                             f"--eval-frac 0")
