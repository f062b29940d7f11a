"""The EAGLE-3 drafter: one Llama decoder layer over (token embedding, fused target hidden states).

Layout and names match SGLang's `LlamaForCausalLMEagle3` (and vLLM's `Eagle3LlamaForCausalLM`), so export is a rename at
most:

    h_in  = fc(cat(aux_low, aux_mid, aux_high))            # (B, T, H)   step 0; later TTT steps feed back h_out
    x     = cat(input_layernorm(embed(ids)), hidden_norm(h_in))   # (B, T, 2H)  q/k/v take 2H inputs
    r     = self_attn(x) + h_in                            # residual comes from the fc output, not from x
    h_out = mlp(post_attention_layernorm(r)) + r           # pre-norm output: what decoding and TTT feed back
    logits = lm_head(norm(h_out))                          # (B, T, draft_vocab)

speculators' eagle3 variants (its trainer's defaults; vLLM runs them), read from its checkpoints and never trained by
`hstap train` (`SPECULATORS_FLAGS`, all off = the layout above): norm_before_fc (h_in = fc(input_norm(aux))),
norm_before_residual (r = self_attn(x) + hidden_norm(h_in)), norm_output (forward returns norm(h_out): decoding and TTT
feed that back, and lm_head reads it as it is).

Alignment (SGLang's draft-extend): the drafter at position t sees embed(x[t+1]) and the target's aux state at t, and
predicts x[t+2]; its rotary position is t.

Attention runs over a key/value cache that holds earlier positions (decoding) or earlier training-time-test steps
(training, `hstap.train.ttt`). The mask decides what each query sees: `None` = causal over cache + new tokens, a bool tensor
(exact, any device), or a flex_attention `BlockMask` (compiled on CUDA; eager, forward only on CPU). The training-time
test's masks, objective and wrapper live in `hstap.train.ttt`.

One forward, its kernels a strategy (as the target's layers take theirs, hstap.models.lean_target): `forward`, `project`
and `compute_logits` take `kernels`, which decides how the rotary cos/sin, the products (fc, q/k/v, o_proj, gate/up,
down_proj, lm_head) and the attention are computed; the layer structure, the norms, the residuals and speculators'
variants stay here. `ModuleKernels` (the default, what training and the reference decoders run) calls the modules as
they are; hstap.models.lean_drafter.FusedKernels computes the same function with fewer kernels for the fast decoder.

Single-device model code: no I/O, no ranks, no logging.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hstap.common import HstapError
from hstap.layers import is_deepseek
from hstap.models.compiled import compile_region, guard_flex_compile
from hstap.models.rotary import rotary_module, rotate


def parse_rope(cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a target or drafter config: a HF config object or a config.json dict.

    transformers >= 5 keeps both in `rope_parameters`; older configs have `rope_theta` and `rope_scaling` apart.
    rope_scaling comes back without rope_theta, and None for default RoPE."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    rope = dict(get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None)
    if not rope and get("rope_scaling"):
        rope = dict(get("rope_scaling"))
        scaling_theta = rope.pop("rope_theta", None)
        theta = theta or scaling_theta
    theta = theta or get("rope_theta") or 10000.0
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    return float(theta), rope or None


SPECULATORS_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
"""DrafterConfig's switches for speculators' eagle3 variants (module docstring); all off in what `hstap train` makes."""


@dataclass
class DrafterConfig:
    hidden_size: int
    """Drafter width H (equal to the target's embedding width, since the drafter reuses the target's embedding)."""
    num_attention_heads: int
    """Query heads of the midlayer."""
    num_key_value_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Per-head width."""
    intermediate_size: int
    """MLP width."""
    vocab_size: int
    """Target vocabulary size V (embedding rows, t2d length)."""
    draft_vocab_size: int
    """Draft vocabulary size (lm_head rows, d2t length)."""
    target_hidden_size: int
    """Width of one captured target hidden state (fc takes num_aux * target_hidden_size inputs)."""
    num_aux: int = 3
    """States fused by fc (its slot count, >= 1): the aux layers K, or 1 for the final state alone
    (`hstap.layers.fc_slots`)."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict | None = None
    """RoPE scaling parameters as in HF `rope_parameters` minus rope_theta (None = default RoPE)."""
    max_position_embeddings: int = 2048
    """Longest position the drafter is configured for."""
    hidden_act: str = "silu"
    """MLP activation (SiLU-gated, as Llama)."""
    target_model_type: str = "llama"
    """The target's HF model_type (decides the SGLang layer-id convention at export)."""
    aux_layers: list[int] = field(default_factory=list)
    """Canonical ids of the target layers fused by fc, in order (empty for a final-state-only EAGLE-1-style drafter)."""
    num_layers: int = 1
    """Decoder layers: layer 0 is the EAGLE-3 midlayer (q/k/v over 2H inputs), layers 1.. plain Llama layers on H."""
    norm_before_fc: bool = False
    """RMSNorm (`input_norm`) over fc's K*Ht inputs before fc (speculators' and vLLM's `norm_before_fc`)."""
    norm_before_residual: bool = False
    """The midlayer's residual is hidden_norm(h_in) instead of h_in (speculators' and vLLM's `norm_before_residual`)."""
    norm_output: bool = False
    """forward returns norm(h_out), which is fed back and which lm_head reads as it is (speculators' `norm_output`)."""

    def __post_init__(self):
        if self.num_aux < 1:
            raise HstapError(f"DrafterConfig: num_aux is fc's slot count and must be >= 1 (hstap.layers.fc_slots), "
                             f"got {self.num_aux}")
        if self.num_layers < 1:
            raise HstapError(f"DrafterConfig: num_layers must be >= 1, got {self.num_layers}")

    @classmethod
    def from_target_config(cls, cfg, draft_vocab_size: int, num_aux: int, aux_layers=(),
                           **overrides) -> "DrafterConfig":
        """Derive the drafter's shape from a target's HF config (any Llama-like layout); `overrides` win."""
        theta, scaling = parse_rope(cfg)
        H = cfg.hidden_size
        heads = cfg.num_attention_heads
        kw = dict(
            hidden_size=H, num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or H // heads,
            intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab_size,
            target_hidden_size=H, num_aux=num_aux, rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048),
            hidden_act=getattr(cfg, "hidden_act", "silu"), target_model_type=getattr(cfg, "model_type", "llama"),
            aux_layers=list(aux_layers),
        )
        if is_deepseek(getattr(cfg, "model_type", "")):
            # MLA targets: give the drafter a plain GQA layer of the same width (what SGLang's Llama drafter runs).
            kw["head_dim"] = 128 if H % 128 == 0 else H // heads
            kw["num_attention_heads"] = H // kw["head_dim"]
            kw["num_key_value_heads"] = (max(1, kw["num_attention_heads"] // 8) if H % 128 == 0
                                         else kw["num_attention_heads"])
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        """The config as JSON-ready dict; num_layers only when > 1, so one-layer drafter.json files stay as they were."""
        d = dataclasses.asdict(self)
        if d["num_layers"] == 1:
            del d["num_layers"]
        for k in SPECULATORS_FLAGS:  # likewise: off (hstap's layout) is left out
            if not d[k]:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DrafterCache:
    """Keys/values of earlier positions (decoding) or earlier TTT steps (training): (B, n_kv, S, hd) each.

    The cache protocol of one decoder layer: append(k, v) -> the full keys and values, crop(n), len() = positions. A
    one-layer drafter takes one DrafterCache; a deeper one (num_layers > 1) takes a `LayerCaches`, one per layer."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep the first n positions (roll back rejected draft tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class LayerCaches:
    """One DrafterCache per decoder layer of a deeper drafter, with DrafterCache's len() and crop(n) over all of them
    (decoding and draft trees handle it as one cache). `.layers[i]` is layer i's."""

    def __init__(self, n: int):
        self.layers = [DrafterCache() for _ in range(n)]

    def __len__(self) -> int:
        return len(self.layers[0])

    def crop(self, n: int) -> None:
        for c in self.layers:
            c.crop(n)


def new_drafter_cache(drafter):
    """An empty cache for `drafter`: a DrafterCache for one layer (what every one-layer call site passes), else a
    LayerCaches of config.num_layers."""
    n = getattr(drafter.config, "num_layers", 1)
    return DrafterCache() if n == 1 else LayerCaches(n)


class ModuleKernels:
    """The drafter's kernels as its modules compute them: HF's rotary module, one Linear call per product, SDPA (or
    flex_attention for a BlockMask) with grouped heads over the layer's DrafterCache (`Attention.attend`). The default
    strategy of the one forward (module docstring); stateless, one instance serves every drafter and layer."""

    def rope(self, drafter, hidden: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = drafter.rope(hidden, position_ids)  # (B, T, hd) each
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd): broadcast over heads

    def mask(self, mask, groups: int):
        """The mask as `attend` takes it, made once per forward (groups: query heads per kv head)."""
        return mask

    def layer(self, i: int) -> "ModuleKernels":
        """The kernels of decoder layer i (0: the midlayer)."""
        return self

    def linear(self, x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        return module(x)

    def qkv(self, attn: "Attention", x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, T, in) -> q (B, T, nh*hd), k and v (B, T, nkv*hd), before the rotation."""
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    def gate_up(self, mlp: "MLP", x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mlp.gate_proj(x), mlp.up_proj(x)  # (B, T, I) each

    def attend(self, attn: "Attention", q, k, v, cache, mask) -> torch.Tensor:
        return attn.attend(q, k, v, cache, mask)  # (B, T, nh*hd)


MODULES = ModuleKernels()


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, in_features: int | None = None):
        """in_features: q/k/v input width (default 2H: the midlayer's cat(embedding, hidden))."""
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        inp = in_features or 2 * H
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(inp, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(inp, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(inp, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)

    def qkv(self, x, cos, sin, kernels: ModuleKernels = MODULES):
        """x (B, T, in_features), cos/sin (B, 1, T, hd) -> rotated q (B, nh, T, hd), rotated k and v (B, nkv, T, hd)."""
        B, T, _ = x.shape
        q, k, v = kernels.qkv(self, x)
        q = q.view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        return (*rotate(q, k, cos, sin), v)

    def attend(self, q, k, v, cache: DrafterCache | None, mask) -> torch.Tensor:
        """Attention over cache + new keys -> (B, T, nh*hd), before o_proj."""
        B, _, T, _ = q.shape
        past = 0 if cache is None else len(cache)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nkv, past+T, hd)
        if mask is not None and not isinstance(mask, torch.Tensor):  # flex_attention BlockMask
            out = _flex(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        else:
            if mask is None and past > 0:  # causal over cache + new tokens: query i sits at slot past+i
                mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                 enable_gqa=self.n_kv != self.n_heads)  # (B, nh, T, hd)
        return out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd)


FLEX_KERNEL_OPTIONS: dict = {"FORCE_USE_FLEX_ATTENTION": True}
"""kernel_options of every compiled flex_attention call: the main Triton kernel always, never inductor's decoding one.

Inductor lowers a call whose batch and head counts are static and whose query is shorter than 128 to its flex-decoding
kernel, with BLOCK_M = next_power_of_2(Q_LEN * query heads per kv head); past 128 (the BlockMask's query block) it
filters out every config: NoValidChoicesError (query (7, 4, 79, 16) with 2 query heads per kv head: BLOCK_M 256).
Which calls see a static batch depends on the order of shapes in the process (dynamo compiles the first shape static,
and a batch of one sample always), so a resumed run, which starts on another batch, hit it where the uninterrupted
run did not. TTT queries are whole sequences, not decoding steps: the main kernel serves every shape the same way."""


FLEX_DYNAMIC = None
"""torch.compile's `dynamic` for the flex region: None (dynamo's default: the first shape static, recompiled with dynamic
shapes once another comes); benchmarks/research/repro_flex.py tries True too."""


_FLEX: dict = {}


def _flex(cuda: bool):
    """flex_attention: compiled on CUDA (the fused kernel); eager on CPU (forward only there; checks the mask).

    On CUDA every call must reach the compiled kernel. Dynamo compiles one graph per guard set and, past its recompile
    limit (default 8 per code object, shared by every torch.compile(flex_attention) in the process), silently runs the
    function eagerly: the unfused flex_attention that materialises the (T, (k+1)T) scores ("flex_attention called
    without torch.compile()"). TTT needs more than 8 graphs: the first shape static, then dynamic; sizes 0/1 are always
    specialised, so a batch of one sample and a BlockMask with one q or kv block (T <= 128) each get their own; and the
    grad mode splits them all again, so `TTTModel(evaluate=True)` under no_grad (train's evaluation, which runs last)
    hit the limit. Hence a region of our own (a wrapper, so its cache is not shared), a budget of RECOMPILE_LIMIT
    (the specialisations are bounded, ~2^4; `compile_region`), and fullgraph=True. FLEX_KERNEL_OPTIONS picks the kernel.
    A compile failure raises `hstap.models.compiled.FlexCompileError`; the backward is compiled with the forward where
    torch allows it, so that a failure of either surfaces at the forward call, before any gradient exists."""
    if cuda not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        if cuda:
            def region(*a, **kw):  # its own code object: its own graph cache and recompile budget
                return flex_attention(*a, kernel_options=dict(FLEX_KERNEL_OPTIONS), **kw)
            # dynamic=None: recompiles once with dynamic shapes, not per T
            _FLEX[cuda] = guard_flex_compile(compile_region(region, fullgraph=True, dynamic=FLEX_DYNAMIC))
        else:
            def eager(*a, **kw):
                with warnings.catch_warnings():  # "flex_attention called without torch.compile" is the point here
                    warnings.simplefilter("ignore")
                    return flex_attention(*a, **kw)
            _FLEX[cuda] = eager
    return _FLEX[cuda]


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, kernels: ModuleKernels = MODULES):
        gate, up = kernels.gate_up(self, x)  # (B, T, I) each
        return kernels.linear(F.silu(gate) * up, self.down_proj)


class Midlayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    # pre/post hold everything but the cache and the attention kernel: pure tensor functions that torch.compile fuses
    # (train --compile replaces them on the instance), while the cache bookkeeping stays in plain Python.
    def pre(self, emb, hidden, cos, sin, kernels: ModuleKernels = MODULES):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        return self.self_attn.qkv(x, cos, sin, kernels)

    def post(self, attn, hidden, kernels: ModuleKernels = MODULES):
        r = kernels.linear(attn, self.self_attn.o_proj) + hidden  # (B, T, H)
        return self.mlp(self.post_attention_layernorm(r), kernels) + r  # (B, T, H) pre-norm

    def forward(self, emb, hidden, cos, sin, cache, mask, kernels: ModuleKernels = MODULES):
        """emb, hidden (B, T, H), cos/sin (B, 1, T, hd) -> h_out (B, T, H), pre-norm; kernels: this layer's."""
        q, k, v = self.pre(emb, hidden, cos, sin, kernels)
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden  # (B, T, H)
        return self.post(kernels.attend(self.self_attn, q, k, v, cache, mask), residual, kernels)


class DecoderLayer(nn.Module):
    """Layer i >= 1 of a deeper drafter: a plain pre-norm Llama decoder layer on H, as vLLM's Eagle3 `layers.i` (and
    speculators' HF LlamaDecoderLayer) run it: r = h + attn(input_layernorm(h)); out = r + mlp(norm(r))."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_features=cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def pre(self, hidden, cos, sin, kernels: ModuleKernels = MODULES):
        return self.self_attn.qkv(self.input_layernorm(hidden), cos, sin, kernels)

    post = Midlayer.post  # the same o_proj + residual + MLP half: the residual is this layer's input

    def forward(self, hidden, cos, sin, cache, mask, kernels: ModuleKernels = MODULES):
        q, k, v = self.pre(hidden, cos, sin, kernels)
        return self.post(kernels.attend(self.self_attn, q, k, v, cache, mask), hidden, kernels)


class Eagle3Drafter(nn.Module):
    """fc + the midlayer (+ num_layers - 1 DecoderLayers, `layers.1` ...) + norm + lm_head.

    Caches: forward takes one DrafterCache for a one-layer drafter (or None), a `LayerCaches` for a deeper one (each
    layer attends over its own keys, with the same mask); `new_drafter_cache` makes the right one."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.norm_before_fc:  # registered only then: hstap's own state dict stays as it was
            self.input_norm = RMSNorm(cfg.num_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.midlayer = Midlayer(cfg)
        if cfg.num_layers > 1:  # not registered at all for one layer: its state dict stays as it was
            self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in range(1, cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = rotary_module(cfg)

    # --- pieces used by training and decoding -------------------------------------------------------------------
    def project(self, aux: torch.Tensor, kernels: ModuleKernels = MODULES) -> torch.Tensor:
        """Fuse captured target states: (B, T, K*Ht) or (B, T, K, Ht) -> (B, T, H)."""
        if aux.dim() == 4:
            aux = aux.flatten(-2)  # (B, T, K*Ht)
        aux = aux.to(self.fc.weight.dtype)
        return kernels.linear(self.input_norm(aux) if self.config.norm_before_fc else aux, self.fc)

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary(x, position_ids)  # cos, sin: (B, T, hd)

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers in order: the midlayer, then layers 1..num_layers-1."""
        return [self.midlayer] + (list(self.layers.values()) if self.config.num_layers > 1 else [])

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: DrafterCache | LayerCaches | None = None, attn_mask=None,
                kernels: ModuleKernels = MODULES) -> torch.Tensor:
        """One pass through the layers. input_ids (B, T) target ids; hidden (B, T, H); returns h_out (B, T, H), the
        last layer's pre-norm output (normed: norm_output). Every layer sits at the same rotary positions and uses the
        same mask. kernels: how the products, the rotary and the attention are computed (module docstring)."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        cos, sin = kernels.rope(self, hidden, position_ids)  # (B, 1, T, hd) each
        mask = kernels.mask(attn_mask, self.config.num_attention_heads // self.config.num_key_value_heads)
        n = self.config.num_layers
        if n == 1:
            h = self.midlayer(emb, hidden, cos, sin, cache, mask, kernels.layer(0))  # (B, T, H)
        else:
            if cache is not None and not (isinstance(cache, LayerCaches) and len(cache.layers) == n):
                raise ValueError(f"a {n}-layer drafter takes a LayerCaches({n}) (new_drafter_cache), got {type(cache)}")
            caches = cache.layers if cache is not None else [None] * n
            h = self.midlayer(emb, hidden, cos, sin, caches[0], mask, kernels.layer(0))
            for i, (layer, c) in enumerate(zip(self.layers.values(), caches[1:]), 1):
                h = layer(h, cos, sin, c, mask, kernels.layer(i))  # (B, T, H)
        return self.norm(h) if self.config.norm_output else h

    def head_input(self, h_out: torch.Tensor) -> torch.Tensor:
        """What lm_head reads of a forward's output: norm(h_out), or h_out itself when forward normed it already."""
        return h_out if self.config.norm_output else self.norm(h_out)

    def compute_logits(self, h_out: torch.Tensor, kernels: ModuleKernels = MODULES) -> torch.Tensor:
        return kernels.linear(self.head_input(h_out), self.lm_head)  # (B, T, Vd)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (SGLang's hot_token_id = arange + d2t)."""
        return ids + self.d2t[ids]

    @torch.no_grad()
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> None:
        """Copy the target's embedding (frozen) and, optionally, its lm_head rows of the draft vocabulary."""
        self.embed_tokens.weight.copy_(embed_weight)
        if lm_head_weight is not None:
            hot = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t  # (Vd,)
            self.lm_head.weight.copy_(lm_head_weight[hot.to(lm_head_weight.device)])
