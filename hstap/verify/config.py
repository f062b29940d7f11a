"""`hstap verify`'s config (`VerifyConfig`), a module of its own so that the command line reads and checks it before
torch loads. What each mode checks: `hstap.verify.stage`'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import at_least


@dataclass(frozen=True)
class VerifyConfig:
    store: str | None = None
    """Store to check: alone, a full integrity check; with --target, a recomputation of --samples samples."""
    target: str | None = None
    """Target model directory (HF format) to recompute the store's hidden states with."""
    a: str | None = None
    """First store of an --a/--b comparison (same samples captured twice: two engines, dtypes, fp8 vs bf16)."""
    b: str | None = None
    """Second store of an --a/--b comparison: the reference (put the more precise capture here)."""
    samples: int | None = None
    """Samples to compare: recompute mode default 4 (spread evenly over the store); --a/--b default all common ids."""
    device: str = "cpu"
    """Device for the recomputation: cpu, cuda, cuda:N or auto."""
    compute_dtype: str = field(default="auto", metadata={"choices": ["auto", "fp32", "bf16"]})
    """Recomputation dtype: auto = fp32 on CPU, bf16 on CUDA. Tolerances follow the coarsest precision involved."""
    max_tokens: int = 1024
    """Recompute mode: compare the first max_tokens tokens of each sample (all layer outputs are held in memory)."""
    load_gb: float | None = None
    """Recompute mode: memory budget in GB for the target and its copy in the other precision. A target that does not
    fit is checked on the layers that do (the embedding and the first layers, up to a stored aux layer; the others
    and the final state are reported as not checked: hstap.verify.partial). Default: half the device's free memory."""
    report: str | None = None
    """Also write the full report (per-layer metrics, problems) as JSON to this path: a new file, or an earlier verify
    report with --overwrite (any other file is never replaced)."""
    overwrite: bool = False
    """Replace an earlier verify report at --report (a file verify did not write is never replaced)."""

    def __post_init__(self):
        if (self.a is None) != (self.b is None):
            raise HstapError("verify: --a and --b go together")
        if self.a is not None and (self.store is not None or self.target is not None):
            raise HstapError("verify: use either --store [--target] or --a/--b, not both")
        if self.target is not None and self.store is None:
            raise HstapError("verify: --target needs --store")
        if self.a is None and self.store is None:
            raise HstapError("verify: nothing to verify: pass --store S [--target DIR] or --a S1 --b S2")
        at_least("verify", self, ("samples", "max_tokens"))
        if self.load_gb is not None and not (self.load_gb > 0 and self.load_gb < float("inf")):
            raise HstapError(f"verify: --load-gb: must be a number > 0, got {self.load_gb}")
        if self.compute_dtype not in ("auto", "fp32", "bf16"):
            raise HstapError(f"verify: compute_dtype: expected auto, fp32 or bf16, got {self.compute_dtype!r}")
