"""`hstap generate`'s config (`GenerateConfig`), below the two modules that read it: the data stage's generate
(`hstap.data.generate`, its module docstring says what runs) and the capture stage's composition of it
(`hstap.capture.tap.generate`, `--capture`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import LAYERS, absolute, at_least, layer_list, settle
from hstap.data.reasoning import canonical_kwargs


@dataclass(frozen=True)
class GenerateConfig:
    data: list[str]
    """Input conversation files (JSON/JSONL, optionally .gz), as `hstap prepare` reads them."""
    out: str
    """Output JSONL file (appended record by record; rerunning resumes). The run config goes to `<out>.config.json`."""
    target: str | None = None
    """Target model directory for the embedded engine (give this or --server)."""
    server: str | None = None
    """Base URL of an OpenAI-compatible server (SGLang, vLLM, hstap serve), e.g. http://127.0.0.1:30000."""
    model: str | None = None
    """Model name sent to the server (default: the first model listed by /v1/models)."""
    max_new_tokens: int = 512
    """Most tokens generated per assistant turn."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = all)."""
    seed: int = 0
    """Base seed; each turn samples with a seed derived from (seed, conversation id, turn index)."""
    batch_size: int = 8
    """Embedded engine: conversations decoded together (continuous batching: each holds a KV row of --max-len
    tokens across its turns, and a finished one hands its row to the next)."""
    max_len: int = 4096
    """Embedded engine: most tokens of one conversation (prompts and answers); an answer is cut where it would pass
    it, the turns whose prompt no longer fits are dropped, and a conversation whose first prompt does not fit is left
    out (both counted). KV memory: batch_size x max_len tokens."""
    concurrency: int = 8
    """Server engine: conversations in flight at once."""
    device: str = "cpu"
    """Embedded engine: torch device (cpu, cuda, cuda:1, auto)."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "fp32", "bf16"]})
    """Embedded engine: compute dtype (auto = bf16 on GPU, fp32 on CPU)."""
    max_samples: int | None = None
    """Use only the first N input conversations (counting those already in the output)."""
    retries: int = 5
    """Server engine: retries of a request after a connection error, HTTP 5xx or 429, before the run stops."""
    backoff: float = 1.0
    """Server engine: seconds before the first retry; doubles on each retry (at most 60 s)."""
    timeout: float = 600.0
    """Server engine: seconds to wait for one response."""
    on_error: str = field(default="fail", metadata={"choices": ["fail", "skip"]})
    """A malformed input record or a request the server rejects (HTTP 4xx other than 429): stop, or skip it."""
    new: bool = False
    """Discard an existing output file and start over instead of resuming."""
    capture: str | None = None
    """Embedded engine: also store the hidden states the target computes while it answers, in this store directory
    (hstap/capture/tap.py: each conversation's last answer, prompt + generated tokens, one pass instead of generate
    then capture)."""
    layers: str = field(default="", metadata=LAYERS)
    """--capture: canonical layer ids to tap (as `hstap capture --layers`; empty = EAGLE-3's [1, N//2-1, N-4])."""
    capture_dtype: str = field(default="bf16", metadata={"choices": ["bf16", "fp8", "fp32"]})
    """--capture: storage dtype (as `hstap capture --dtype`)."""
    prefix_cache: bool = True
    """Embedded engine: keep each conversation's KV cache across its turns and prefill only what a turn adds (cost
    linear in the turns); false prefills the whole history at every turn (quadratic; the reference path). Same
    answers either way."""
    chat_template_kwargs: str | None = None
    """JSON object passed to the chat template with every turn, as the server will run the target (a reasoning
    model's switch: '{"enable_thinking": false}' for Qwen3, '{"thinking": false}' for Kimi-K2.5): sent as the
    request's chat_template_kwargs, or given to the embedded engine's template. Give `hstap prepare` the same."""

    def __post_init__(self):
        w = "generate"
        if isinstance(self.data, str):
            settle(self, "data", [self.data])
        if not self.data:
            raise HstapError("generate: data: give at least one input file")
        if (self.target is None) == (self.server is None):
            raise HstapError("generate: give exactly one of --target (embedded engine) or --server "
                             "(OpenAI-compatible URL)")
        if self.server is not None and not self.server.startswith(("http://", "https://")):
            raise HstapError(f"generate: server: {self.server!r} is not an http(s) URL")
        at_least(w, self, ("max_new_tokens", "batch_size", "concurrency"))
        at_least(w, self, ("retries", "max_samples"), lo=0)
        at_least(w, self, ("max_len",), lo=2)
        if self.temperature < 0:
            raise HstapError(f"generate: temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise HstapError(f"generate: top_p: must be in (0, 1], got {self.top_p}")
        if self.backoff < 0 or self.timeout <= 0:
            raise HstapError("generate: backoff must be >= 0 and timeout > 0")
        layer_list(w, self, "layers")
        # Absolute paths, so that `<out>.config.json` replays from anywhere and a resume compares like with like.
        absolute(self, "data", "out", "target")
        settle(self, "chat_template_kwargs", canonical_kwargs(self.chat_template_kwargs, "generate: chat_template_kwargs"))
        if self.out in self.data:
            raise HstapError(f"generate: out: {self.out} is also an input file")
        if self.layers and self.capture is None:
            raise HstapError(f"generate: --layers {self.layers}: taps layers into a --capture store; without "
                             f"--capture nothing is tapped (give --capture STORE, or leave --layers out)")
        if self.capture is not None:
            if self.server is not None:
                raise HstapError("generate: --capture needs the embedded engine (--target); a server's traffic is "
                                 "captured by its own engine (docs/engines.md: the vLLM connector's tap mode)")
            absolute(self, "capture")
