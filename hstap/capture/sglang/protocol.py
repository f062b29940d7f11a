"""What the `sglang` engine's three pieces agree on: the server-side hook (capture/sglang/hook.py), the plugin
(capture/sglang/plugin.py) and the driver in the hstap process (capture/sglang/driver.py) each import this module and
never each other.

- `ENV_LAYERS`: the environment variable (canonical layer ids) that makes the plugin turn on aux capture;
- `HOOK_FACTORY` and `hook_spec(...)`: the `--forward-hooks` entry that loads the hook, on the module names of
  `LOGITS_MODULES`;
- `EVENTS_DIR`: where in the store the hook writes the events (drops, errors) the driver reads, and the driver the end
  of its session.

Request ids, events and session ends are hstap/capture/session.py's, the same for every engine.
"""

from __future__ import annotations

import os

HOOK_FACTORY = "hstap.capture.sglang.hook:make_hook"
ENV_LAYERS = "HSTAP_CAPTURE_LAYERS"
EVENTS_DIR = "sglang-events"  # inside the store; the store's reader ignores other files
# Where SGLang's models keep their LogitsProcessor (`register_forward_hooks` matches these against named_modules(), one
# per model): at the top (Llama, Qwen, DeepseekV3ForCausalLM, ...) or in the language model of a multimodal wrapper
# (KimiK25ForConditionalGeneration: srt/models/kimi_k25.py builds `self.language_model = DeepseekV3ForCausalLM(...)`).
LOGITS_MODULES = ("logits_processor", "language_model.logits_processor")


def hook_spec(store: str, data: str | None, layers: list[int], name: str = "hstap", **extra) -> dict:
    """One `--forward-hooks` entry: `--forward-hooks '[<this as JSON>]'` (`data` None: tap mode only)."""
    cfg = {"store": os.path.abspath(store), "layers": [int(i) for i in layers], **extra}
    if data is not None:
        cfg["data"] = os.path.abspath(data)
    return {"name": name, "target_modules": list(LOGITS_MODULES), "hook_factory": HOOK_FACTORY, "config": cfg}
