"""`hstap eval`'s config (`EvalConfig`), below the modules that read it: the stage (`hstap.speculative.evaluate`, its
module docstring says what runs), its input checks (`hstap.speculative.inputs`), its report (`hstap.speculative.report`)
and the engines it measures beside hstap's decoder (`hstap.speculative.vllm`, `hstap.speculative.sglang`). Its `decode`
section (`Decoding`: the drafting shape and the sampling, `FLAT`: `--k`, `--temperature` as ever) is what the engines'
halves and the report take, with the paths they read, instead of the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError
from hstap.config import FLAT, absolute, at_least, settle
from hstap.data.reasoning import canonical_kwargs


@dataclass(frozen=True)
class Decoding:
    """What every decoder of an eval decodes and how: the drafting (a chain, or an EAGLE-2 tree) and the sampling
    (`hstap eval`'s flags of the same names)."""

    mode: str = field(default="chain", metadata={"choices": ["chain", "tree"]})
    """Drafting: a chain of --k tokens, or an EAGLE-2 dynamic tree (--topk, --depth, --tokens)."""
    k: int = 5
    """Chain length: draft tokens per verify forward (also the n-gram baseline's proposal length)."""
    topk: int = 8
    """Tree: children drafted per expanded node, and nodes expanded per level."""
    depth: int = 6
    """Tree: draft levels (the longest acceptable draft)."""
    tokens: int = 60
    """Tree: nodes verified per target forward, root included (SGLang's --speculative-num-draft-tokens)."""
    temperature: float = 0.0
    """0 = greedy (outputs must equal the target's); > 0 = lossless rejection sampling at this temperature."""
    max_new_tokens: int = 256
    """Generated tokens per prompt at most (generation also stops at eos / end of turn)."""
    seed: int = 0
    """Sampling seed (temperature > 0); prompt i of every method uses seed + i."""

    def __post_init__(self):
        w = "eval"
        at_least(w, self, ("k", "topk", "depth", "max_new_tokens"))
        at_least(w, self, ("tokens",), lo=2)
        if self.temperature < 0:
            raise HstapError(f"--temperature: must be >= 0, got {self.temperature}")
        if self.mode not in ("chain", "tree"):
            raise HstapError(f"--mode: expected one of chain, tree, got {self.mode!r}")

    def drafting(self) -> str:
        """The drafting as the report names it: `chain k=5`, `tree topk=8 depth=6 tokens=60`."""
        return f"chain k={self.k}" if self.mode == "chain" else \
            f"tree topk={self.topk} depth={self.depth} tokens={self.tokens}"


@dataclass(frozen=True)
class EvalConfig:
    target: str
    """Target model directory (HF format, with its tokenizer)."""
    data: str
    """Prompts: a prepared dataset directory (hstap prepare) or a conversations JSONL (.jsonl/.json, optionally .gz)."""
    out: str
    """Report directory (report.json, report.md, acceptance.png, config.json)."""
    drafter: str | None = None
    """Drafter: an hstap drafter dir, a training RUN (best/, else newest) or an SGLang/vLLM export; unset: baselines."""
    decode: Decoding = field(default_factory=Decoding, metadata=FLAT)
    """The drafting and the sampling (--mode, --k, --topk, --depth, --tokens, --temperature, --max-new-tokens,
    --seed)."""
    baseline: str = field(default="none", metadata={"choices": ["none", "ngram"]})
    """Extra baseline next to target-only decoding: n-gram prompt lookup."""
    num_prompts: int | None = None
    """Use the first N usable prompts of --data (unset = all)."""
    chat_template_kwargs: str | None = None
    """JSON object passed to the chat template when --data is a conversations file, as the server runs the target (a
    reasoning model's switch: '{"enable_thinking": false}' for Qwen3, '{"thinking": false}' for Kimi-K2.5), as
    `hstap generate` and `hstap prepare` take it; unset: the template's defaults. A prepared set was rendered by
    prepare: given here, it must be the one prepare recorded."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (cuda when available)."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "fp32", "bf16"]})
    """Compute dtype of target and drafter (auto: bf16 on CUDA, fp32 on CPU)."""
    tie_tol: float | None = None
    """Logit gap under which a greedy mismatch counts as a numerical near-tie (unset: 1e-3 in fp32, 0.5 in bf16)."""
    engine: str = field(default="auto", metadata={"choices": ["auto", "fast", "eager", "vllm", "sglang"]})
    """Decoder: fast (static KV caches, CUDA graphs: hstap.speculative.fast), eager (hstap.speculative.drivers), auto = fast on CUDA,
    eager on the CPU. Every method runs on the same one. vllm: hstap's (auto) decoder, and the drafter inside vLLM's own
    speculative decoding on the same prompts, with vLLM's counters (hstap.speculative.vllm; chain mode). sglang: the same
    with SGLang servers of the SGLang server venv (hstap.speculative.sglang; chain mode)."""
    sglang_python: str | None = None
    """--engine sglang: the SGLang server venv's python (unset: .venv-sglang/bin/python of the current directory or of
    hstap's source tree, else this Python; README.md command 2 makes that venv)."""
    kernels: str = field(default="standard", metadata={"choices": ["standard", "fused"]})
    """Fast engine: standard (the model's layers, SDPA) or fused (speculative/fast.py's FUSED: faster steps, long
    compiles)."""
    compile: bool = True
    """Fast engine: torch.compile each step before capturing it in a CUDA graph. --no-compile captures the steps as
    they are: seconds of set-up per method instead of a minute or more (a large target's compile), slower steps, the
    same tokens and tau (what a tau-only measurement over many processes wants)."""
    overwrite: bool = False
    """Replace the report in an --out that holds one (refused otherwise)."""

    def __post_init__(self):
        w = "eval"
        at_least(w, self, ("num_prompts",))
        if self.tie_tol is not None and self.tie_tol < 0:
            raise HstapError(f"--tie-tol: must be >= 0, got {self.tie_tol}")
        for name, choices in (("baseline", ("none", "ngram")),
                              ("dtype", ("auto", "fp32", "bf16")), ("engine", ("auto", "fast", "eager", "vllm", "sglang")),
                              ("kernels", ("standard", "fused"))):
            if getattr(self, name) not in choices:
                raise HstapError(f"--{name}: expected one of {', '.join(choices)}, got {getattr(self, name)!r}")
        absolute(self, "target", "data", "out", "drafter")
        settle(self, "chat_template_kwargs", canonical_kwargs(self.chat_template_kwargs,
                                                              "eval: --chat-template-kwargs"))
        if self.engine in ("vllm", "sglang") and (self.drafter is None or self.decode.mode != "chain"):
            raise HstapError(f"--engine {self.engine}: needs --drafter and --mode chain (hstap runs the engine's chain "
                             "drafting: the counts compare round by round)")
