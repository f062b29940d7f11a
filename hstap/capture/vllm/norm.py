"""The final state of vLLM's captures: vLLM's last slot (id N) is the last decoder layer's output *before* the final
norm; a store's `final` is the final-norm output. These apply the target's final RMSNorm exactly as HF's LlamaRMSNorm
does (what `--engine hf` stores): `x` in fp32, `x * rsqrt(mean(x^2) + eps)`, cast back to the input's dtype, times the
weight in that dtype. The weight is read from the target's safetensors and `rms_norm_eps` from its config.json
(Gemma-style `(1 + w)` norms are refused).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hstap.common import HstapError

NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight", "norm.weight")
OFFSET_NORM_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")  # RMSNorm with (1 + weight): not this formula


def load_final_norm(target: str | Path) -> tuple[torch.Tensor, float, str]:
    """(final norm weight (H,) float32, rms_norm_eps, the key read) from the target's safetensors and config.json."""
    from safetensors import safe_open

    p = Path(target)
    cfg = json.loads((p / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    mtype = text.get("model_type") or cfg.get("model_type")
    if mtype in OFFSET_NORM_TYPES:
        raise HstapError(f"{p / 'config.json'}: model_type {mtype!r} uses a (1 + weight) RMSNorm; hstap applies "
                         "only the Llama-style final norm to vLLM's states")
    eps = text.get("rms_norm_eps", cfg.get("rms_norm_eps"))
    if eps is None:
        raise HstapError(f"{p / 'config.json'}: rms_norm_eps: missing (needed to apply the final norm)")
    index = p / "model.safetensors.index.json"
    files = sorted(p.glob("*.safetensors"))
    if index.is_file():
        wm = json.loads(index.read_text()).get("weight_map", {})
        for k in NORM_KEYS:
            if k in wm:
                files = [p / wm[k]]
                break
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            keys = set(h.keys())
            for k in NORM_KEYS:
                if k in keys:
                    return h.get_tensor(k).to(torch.float32), float(eps), k
    raise HstapError(f"{p}: no final norm weight ({' / '.join(NORM_KEYS)}) in the target's safetensors")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, H) -> (T, H) in x's dtype: the final RMSNorm as HF computes it (statistics in fp32, product in x's dtype)."""
    h = x.to(torch.float32)  # (T, H)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * h.to(x.dtype)
