"""What a training run resolved from its config and inputs: `TrainPlan`, made once by `hstap.train.inputs.resolve`.

The config (`hstap.train.config.TrainConfig`) stays what the user asked, as parsed: RUN/config.json. The plan is what
ran: the ce chunk (--ce-chunk 0 resolved), the draft vocabulary map (`hstap.artifacts.vocab_map.VocabMap`: an explicit
map, the prepared set's, the store's copy of it or the store's token counts), the aux layers and their indices into the
store, the resume point, the ranks and the compute dtype. It is frozen, handed to what builds the run, and recorded beside the config as
RUN/plan.json (`TrainPlan.record`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hstap.artifacts.vocab_map import VocabMap


@dataclass(frozen=True, eq=False)
class TrainPlan:
    """What this run resolved (module docstring), the same on every rank."""

    world: int
    """Ranks training together."""
    device: str
    """cpu or cuda (each rank its own GPU)."""
    bf16: bool
    """Compute dtype: bf16 autocast with fp32 master weights (True) or fp32."""
    ce_chunk: int
    """Rows per chunk of the target head and of the fused lm_head + cross-entropy (--ce-chunk; 0 resolved by the
    target's vocabulary size, `hstap.train.data.auto_ce_chunk`)."""
    vocab: VocabMap
    """The draft vocabulary map the drafter is trained on (--vocab-map, --data's, the store's, or its counts)."""
    layers: tuple[int, ...]
    """The drafter's aux layers, canonical ids (() = the final state alone, EAGLE-1-style)."""
    store_indices: tuple[int, ...] | None
    """Their indices into the store's aux (None: the final state is fed; online: (), the live target taps them)."""
    resume: Path | None
    """The checkpoint a --resume continues from (None: a fresh run)."""
    resume_step: int
    """The optimizer steps that checkpoint had done (0 for a fresh run)."""

    def record(self) -> dict:
        """RUN/plan.json."""
        return {"world_size": self.world, "device": self.device, "dtype": "bf16" if self.bf16 else "fp32",
                "ce_chunk": self.ce_chunk, "draft_vocab": self.vocab.size,
                "vocab_map": {"source": self.vocab.source, "sha256": self.vocab.sha256()},
                "aux_layers": list(self.layers),
                "store_indices": None if self.store_indices is None else list(self.store_indices),
                "resume": str(self.resume) if self.resume is not None else None, "resume_step": self.resume_step}
