"""`hstap demo`'s config (`DemoConfig`): what the demo runs is `hstap.demo.stage`'s module docstring. It composes
`hstap train`'s hyper-parameters (`HyperParams`) as its `train` section instead of copying them: `TRAIN` states, in one
place, where the demo's drafter departs from train's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.config import at_least
from hstap.train.config import HyperParams

TRAIN = {
    "steps": 500,  # drafter training steps
    "batch_tokens": 2048,  # tokens per drafter micro-batch
    "eval_every": 100,  # 5 evaluations over the 500 steps (RUN/best follows the best of them)
    "save_every": 250,  # 2 checkpoints
    "log_every": 20,
}
"""The demo's drafter's hyper-parameters where they are not `hstap train`'s defaults (the `train` section's default)."""


@dataclass(frozen=True)
class DemoConfig:
    out: str = "hstap-demo"
    """Work directory for every stage's outputs (removed first when it holds an earlier demo; a directory the demo
    did not write is refused)."""
    target: str | None = None
    """Target model directory; default: build and train a toy target under OUT/target."""
    data: list[str] | None = None
    """Conversation files (JSONL/JSON/Parquet); default: chat data made from Python's own documentation."""
    target_steps: int = 700
    """Optimizer steps of the toy target (only without --target; 2,048 tokens a step). More is not better for the
    demo: a toy target trained longer memorizes its corpus and answers new prompts less predictably (tau measured on
    8 eval prompts, other defaults unchanged: 400 steps 3.4, 700 steps 2.6, 1,200 steps 1.6)."""
    max_samples: int = 2400
    """Conversations used (the demo's data budget); 5% of them (at least --eval-prompts) are held out for eval."""
    generate: bool = True
    """Regenerate the training answers with the target (greedy) before capture: the drafter learns the target's own
    outputs, which is what it will be asked to predict (SpecForge / EAGLE practice; usually lifts acceptance a lot)."""
    generate_tokens: int = 128
    """Most tokens of a regenerated answer."""
    train: HyperParams = field(default_factory=lambda: HyperParams(**TRAIN))
    """The drafter's hyper-parameters, `hstap train`'s (--train.steps, --train.ttt, --train.lr, ...): train's defaults
    (the objective and its step weights, the TTT steps, the learning rate) but for the demo's own (TRAIN: 500 steps of
    2,048-token micro-batches, 5 evaluations and 2 checkpoints over them, a metrics line every 20 steps)."""
    eval_prompts: int = 16
    """Held-out prompts decoded in the eval stage."""
    max_new_tokens: int = 64
    """New tokens per eval prompt."""
    k: int = 5
    """Chain length of the speculative decoding eval."""
    device: str = field(default="auto", metadata={"choices": ["auto", "cpu", "cuda"]})
    """Device for every stage."""
    threads: int = 2
    """torch CPU threads of the demo's compute, capped by the CPU count: pinned, so a loaded machine runs the same
    kernels (and prints the same figures) as an idle one."""
    seed: int = 0
    """Seed of the toy target, the data split and the drafter."""

    def __post_init__(self):
        at_least("demo", self, ("max_samples", "eval_prompts", "max_new_tokens", "k", "target_steps",
                                "generate_tokens", "threads"))
