"""What `hstap eval` checks before it loads a model or decodes a token: that its inputs belong together.

- the report directory: new, empty, or an earlier eval's (`hstap.artifacts.outputs`: never a directory of the user's files, nor
  one of the inputs); one that holds a report (report.json) is replaced only with --overwrite;
- the target: a complete model directory (config, weights; `hstap.artifacts.model_dir.target_fingerprint`);
- the drafter against the target (`hstap.export.fit.check_drafter_target`: vocabulary, hidden size, tapped layers, the
  tokenizer it was trained with), for an hstap drafter, a training RUN and an SGLang or vLLM export alike;
- the engine of --engine vllm / sglang: installed where it runs (`check_engine`);
- prepared prompts against the target's tokenizer (`hstap.data.fits.check_tokenizer`, as capture checks them): ids of
  another tokenizer would be decoded as another vocabulary's text, and every figure would be about noise; and a
  --chat-template-kwargs against the one prepare rendered them with (`check_template_kwargs`).

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
    from hstap.artifacts.model_dir import target_fingerprint
    from hstap.artifacts.outputs import check_not_input, check_out_dir

    out = Path(cfg.out)
    check_not_input(out, [("--target", cfg.target), ("--drafter", cfg.drafter), ("--data", cfg.data)])
    check_out_dir(out, "eval", None)
    if (out / "report.json").exists() and not cfg.overwrite:
        raise HstapError(f"{out}: --out: holds a report already (report.json); pass --overwrite to replace it, or "
                         f"choose another --out")
    check_engine(cfg)
    target = target_fingerprint(cfg.target)
    if cfg.drafter is not None:
        check_drafter_target(cfg.drafter, target)
    data = Path(cfg.data)
    if data.is_dir():
        meta = read_meta(data)
        check_tokenizer(str(data), meta, target)
        if cfg.chat_template_kwargs:  # the prompts were rendered by prepare: with its kwargs, or refused
            from hstap.data.fits import check_template_kwargs
            from hstap.data.reasoning import template_kwargs
            check_template_kwargs(f"{data / 'meta.json'} (hstap prepare)", meta.get("chat_template_kwargs") or {},
                                  template_kwargs(cfg.chat_template_kwargs))
    elif not data.is_file():
        raise HstapError(f"{data}: --data: not found (a prepared dataset directory or a conversations file)")
    return target


def check_engine(cfg) -> None:
    """--engine vllm / sglang: the engine is there (vLLM importable here, SGLang in the server venv's python), checked
    before the local runs: without it the eval would fail only after them, with an export on disk."""
    if cfg.engine == "vllm":
        from hstap.device import auto_device, auto_dtype
        from hstap.engines.vllm import check_quantized_dtype, require_vllm
        require_vllm("--engine vllm")
        device = auto_device(cfg.device).partition(":")[0]
        check_quantized_dtype(cfg.target, auto_dtype(cfg.dtype, device), device)
    elif cfg.engine == "sglang":
        from hstap.engines.sglang import require_sglang, server_python
        require_sglang(server_python(cfg.sglang_python))
