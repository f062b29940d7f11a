"""`hstap capture`'s config (`CaptureConfig`), below the stage (`hstap.capture.stage`), the pieces every engine uses
(`hstap.capture.inputs`) and the engines, which all read it. The stage itself: `hstap.capture.stage`'s module
docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import LAYERS, absolute, at_least, layer_list, settle

ENGINES = ("hf", "sglang", "vllm", "vllm-import")  # --engine: `hstap.capture.stage.capture` reaches each by import
DTYPES = ("bf16", "fp8", "fp32")


@dataclass(frozen=True)
class CaptureConfig:
    target: str
    """Target model directory (HF format: config.json, safetensors weights, tokenizer)."""
    data: str
    """Prepared dataset directory (output of `hstap prepare`, made with the target's tokenizer)."""
    out: str
    """Store directory to create or resume (see hstap/store/format.py for the format)."""
    layers: str = field(default="", metadata=LAYERS)
    """Comma-separated canonical layer ids to tap (output of decoder layer i); empty = EAGLE-3's [1, N//2-1, N-4]."""
    dtype: str = "bf16"
    """Storage dtype: bf16, fp8 (float8_e4m3fn + one fp32 scale per token per layer, ~half the bytes) or fp32
    (exact)."""
    batch_tokens: int = 16384
    """Batch budget: samples are length-sorted and packed so that batch_size * longest <= this (a longer one runs
    alone)."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available). Under torchrun each rank uses cuda:LOCAL_RANK."""
    compute_dtype: str = "auto"
    """Dtype the target runs in: auto (fp32 on CPU, bf16 on CUDA), fp32 or bf16."""
    max_samples: int | None = None
    """Capture only the first N >= 1 samples of the prepared set (all by default)."""
    new: bool = False
    """Wipe an existing store at --out instead of resuming it (needed when target, layers or dtype changed)."""
    shard_tokens: int = 1 << 20
    """Close a shard after this many tokens (or shard_mb, whichever comes first). A kill loses only the open shard."""
    shard_mb: int = 1024
    """Close a shard once it holds this many MiB. An open shard is held in host memory until written, so this bounds
    the writer's memory ((K+1)*H*2 bytes/token in bf16: 32 KiB/token for an 8B target)."""
    queue_size: int = 4
    """Batches waiting for the writer thread before the GPU waits for storage."""
    engine: str = "hf"
    """hf (run the target in this process), sglang (through a running SGLang server with hstap's hook), vllm (vLLM's
    engine with hstap's connector: in this process, or a running server with --server) or vllm-import (convert files
    written by stock vLLM's extract_hidden_states)."""
    server: str | None = None
    """sglang / vllm engine: base URL of the server, e.g. http://127.0.0.1:30000 (vllm: without it, vLLM runs in this
    process)."""
    src: str | None = None
    """vllm-import engine: directory of vLLM extract_hidden_states output to import."""
    vllm_layers: str | None = field(default=None, metadata=LAYERS)
    """vllm-import engine: the vLLM layer ids of the captured states (input of layer j), comma-separated."""
    concurrency: int = 8
    """sglang / vllm --server: requests in flight."""
    allow_template_mismatch: bool = False
    """Capture data rendered with another chat template than the target's (refused by default: the drafter would
    learn from conversations laid out unlike the ones it will serve)."""

    def __post_init__(self):
        w = "capture"
        for name, allowed in (("dtype", DTYPES), ("engine", ENGINES), ("device", ("auto", "cpu", "cuda")),
                              ("compute_dtype", ("auto", "fp32", "bf16"))):
            v = getattr(self, name)
            if v not in allowed and not (name == "device" and isinstance(v, str) and v.startswith("cuda:")):
                raise HstapError(f"--{name.replace('_', '-')}: expected one of {', '.join(allowed)}, got {v!r}")
        # --max-samples 0 would write an empty store and succeed
        at_least(w, self, ("batch_tokens", "shard_tokens", "shard_mb", "queue_size", "concurrency", "max_samples"))
        if self.layers is None:
            settle(self, "layers", "")
        layer_list(w, self, "layers")
        layer_list(w, self, "vllm_layers")
        # Absolute paths, so that config.json replays the run from any working directory.
        absolute(self, "target", "data", "out", "src")
