"""`hstap prepare`'s config (`PrepareConfig`), a module of its own so that the command line reads and checks it before
numpy and torch load. What the stage does and writes: `hstap.data.prepare`'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import absolute, at_least, settle
from hstap.data.reasoning import canonical_kwargs


@dataclass(frozen=True)
class PrepareConfig:
    tokenizer: str
    """Directory with the target's HF fast tokenizer (usually the target model directory)."""
    data: list[str]
    """Conversation files (.jsonl, .json, .parquet; .jsonl.gz/.json.gz) or directories of them."""
    out: str
    """Output directory for the prepared set; refused if it exists."""
    max_len: int = 2048
    """Truncate each tokenized conversation to this many tokens (counted in meta.json)."""
    draft_vocab: int = 32000
    """Draft vocabulary size: the most frequent loss-masked tokens (clamped to the tokenizer's vocabulary)."""
    num_proc: int = 1
    """Worker processes for rendering and tokenization (output is identical for any value)."""
    chat_template: str | None = None
    """Jinja chat template file to use instead of the tokenizer's own."""
    on_error: str = field(default="fail", metadata={"choices": ["fail", "skip"]})
    """Bad records: 'fail' stops with one error naming file:line; 'skip' skips them and counts them in meta.json."""
    chat_template_kwargs: str | None = None
    """JSON object passed to the chat template, as the server that will serve the drafter passes it (a reasoning
    model's switch: '{"enable_thinking": false}' for Qwen3, '{"thinking": false}' for Kimi-K2.5); recorded in
    meta.json, and it must equal the kwargs `hstap generate` made the answers with (their <out>.config.json)."""

    def __post_init__(self):
        if isinstance(self.data, str):
            settle(self, "data", [self.data])
        if not self.data:
            raise HstapError("--data: give at least one file or directory")
        at_least("prepare", self, ("max_len", "draft_vocab", "num_proc"))
        if self.on_error not in ("fail", "skip"):
            raise HstapError(f"--on-error: expected 'fail' or 'skip', got {self.on_error!r}")
        # Absolute paths, so that config.json replays the run from any working directory.
        absolute(self, "tokenizer", "data", "out", "chat_template")
        settle(self, "chat_template_kwargs", canonical_kwargs(self.chat_template_kwargs))
