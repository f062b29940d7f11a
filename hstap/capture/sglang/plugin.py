"""The SGLang plugin: turn on EAGLE-3 aux capture of chosen layers in a target served without a draft model.

`plugin()` is the `sglang.srt.plugins` entry point (pyproject.toml); SGLang's `load_plugins()` calls it in every
process. It is a no-op unless `HSTAP_CAPTURE_LAYERS` (canonical layer ids, comma-separated) is set; then it hooks the
step that configures aux capture (before CUDA-graph capture; SGLang >= 0.5.11), or `ModelRunner.load_model` on
versions without that step, and calls the model's `set_eagle3_layers_to_capture` with the SGLang ids of those layers
(`hstap.layers.to_sglang`: the +1 rule). The variable's name is capture/sglang/protocol.py's; the capture hook itself
is in capture/sglang/hook.py.
"""

from __future__ import annotations

import logging
import os

from hstap.capture.sglang.protocol import ENV_LAYERS
from hstap.common import HstapError
from hstap.layers import check_sglang_capturable, parse_ids, to_sglang

log = logging.getLogger("hstap.sglang")


def capture_layers_from_env() -> list[int] | None:
    """The canonical layer ids in HSTAP_CAPTURE_LAYERS, None when it is unset or empty."""
    spec = os.environ.get(ENV_LAYERS, "").strip()
    if not spec:
        return None
    ids = parse_ids(spec, ENV_LAYERS)
    if not ids or ids != sorted(set(ids)) or ids[0] < 0:
        raise HstapError(f"{ENV_LAYERS}={spec!r}: expected strictly increasing non-negative layer ids")
    return ids


def set_capture_layers(model, layers: list[int]) -> list[int] | None:
    """`model.set_eagle3_layers_to_capture(SGLang ids of canonical layers)`; returns the ids (None: no-op)."""
    setter = getattr(model, "set_eagle3_layers_to_capture", None)
    if setter is None:
        return None  # a draft model or a model without EAGLE-3 support: nothing to do here
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    model_type = getattr(text, "model_type", "llama")
    if isinstance(getattr(text, "num_hidden_layers", None), int):  # the server stops at start-up, saying why
        check_sglang_capturable(layers, text.num_hidden_layers, ENV_LAYERS)
    ids = to_sglang(layers, model_type)
    setter(ids)
    log.info("hstap: %s captures canonical layers %s (SGLang ids %s)", type(model).__name__, layers, ids)
    return ids


def _around_configure(original, *args, **kwargs):
    """AROUND hook on `configure_aux_hidden_state_capture` (runs before CUDA-graph capture in SGLang >= 0.5.11)."""
    out = original(*args, **kwargs)
    layers = capture_layers_from_env()
    model = kwargs.get("model", args[0] if args else None)
    if layers is not None and model is not None:
        if kwargs.get("eagle_use_aux_hidden_state") and kwargs.get("eagle_aux_hidden_state_layer_ids") is not None:
            log.warning("hstap: the server also configures EAGLE-3 aux capture; %s=%s takes precedence",
                        ENV_LAYERS, layers)
        set_capture_layers(model, layers)
    return out


def _after_load_model(result, runner, *args, **kwargs):
    """AFTER hook on `ModelRunner.load_model` (SGLang versions without configure_aux_hidden_state_capture)."""
    layers = capture_layers_from_env()
    if layers is not None and not getattr(runner, "is_draft_worker", False):
        set_capture_layers(runner.model, layers)
    return None


def plugin() -> None:
    """`sglang.srt.plugins` entry point (pyproject.toml). A no-op unless HSTAP_CAPTURE_LAYERS is set."""
    if capture_layers_from_env() is None:
        return
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        importlib.import_module("sglang.srt.model_executor.model_runner_components.attention_backend_setup")
        HookRegistry.register("sglang.srt.model_executor.model_runner_components.attention_backend_setup."
                              "configure_aux_hidden_state_capture", _around_configure, HookType.AROUND)
    except ImportError:
        HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model", _after_load_model,
                              HookType.AFTER)
