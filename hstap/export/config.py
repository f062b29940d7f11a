"""`hstap export`'s config (`ExportConfig`), a module of its own so that the command line reads and checks it before
torch loads. The stage itself: `hstap.export.stage`'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import at_least


@dataclass(frozen=True)
class ExportConfig:
    run: str
    """A training RUN directory (its best/, else newest checkpoint) or a drafter directory in the hstap format."""
    to: str = field(metadata={"choices": ["sglang", "vllm", "hf"]})
    """Target format: sglang (LlamaForCausalLMEagle3), vllm (speculators Eagle3Speculator), hf (hstap format + config)."""
    out: str
    """Output directory (written to a temp sibling, then renamed; must not exist unless --overwrite, and never a
    directory of the run's inputs)."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "bf16", "fp32"]})
    """Weight dtype: auto = bf16 for sglang/vllm, the checkpoint's own dtype for hf (so eval sees the same logits)."""
    store: str | None = None
    """Optional store path: refuse unless its layers (and hidden size, target) are the ones the drafter was trained on."""
    target: str | None = None
    """Optional target model directory: verifier name/architectures for vllm, and a check of vocab/hidden sizes."""
    speculative_tokens: int = 3
    """vllm only: speculative_tokens of the greedy proposal method (vLLM's default num_speculative_tokens)."""
    overwrite: bool = False
    """Replace an earlier export at --out (the old one is removed only after the new one is in place); a directory
    hstap export did not write is never replaced (hstap/artifacts/outputs.py)."""

    def __post_init__(self):
        if self.to not in ("sglang", "vllm", "hf"):
            raise HstapError(f"export: to: expected sglang, vllm or hf, got {self.to!r}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise HstapError(f"export: dtype: expected auto, bf16 or fp32, got {self.dtype!r}")
        at_least("export", self, ("speculative_tokens",))
