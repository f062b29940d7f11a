"""What `hstap eval` checks before it loads a model or decodes a token: that its inputs belong together.

- the report directory: one that holds a report (report.json) is replaced only with --overwrite;
- the target: a complete model directory (config, weights; `hstap.model_dir.target_fingerprint`);
- the drafter against the target (`hstap.export.fit.check_drafter_target`: vocabulary, hidden size, tapped layers, the
  tokenizer it was trained with), for an hstap drafter, a training RUN and an SGLang or vLLM export alike;
- prepared prompts against the target's tokenizer (`hstap.data.fits.check_tokenizer`, as capture checks them): ids of
  another tokenizer would be decoded as another vocabulary's text, and every figure would be about noise.

Each is one line naming the file and field, exit status 2, and nothing written.
"""

from __future__ import annotations

from pathlib import Path

from hstap.common import HstapError
from hstap.speculative.config import EvalConfig


def check_inputs(cfg: EvalConfig) -> dict:
    """Every check above for an `EvalConfig`; returns the target's fingerprint block."""
    from hstap.data.fits import check_tokenizer
    from hstap.data.prepare import read_meta
    from hstap.export.fit import check_drafter_target
    from hstap.model_dir import target_fingerprint

    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise HstapError(f"{out}: --out: exists and is not a directory")
    if (out / "report.json").exists() and not cfg.overwrite:
        raise HstapError(f"{out}: --out: holds a report already (report.json); pass --overwrite to replace it, or "
                         f"choose another --out")
    target = target_fingerprint(cfg.target)
    if cfg.drafter is not None:
        check_drafter_target(cfg.drafter, target)
    data = Path(cfg.data)
    if data.is_dir():
        check_tokenizer(str(data), read_meta(data), target)
    elif not data.is_file():
        raise HstapError(f"{data}: --data: not found (a prepared dataset directory or a conversations file)")
    return target
