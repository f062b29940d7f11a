"""The EAGLE-3 drafter: one Llama decoder layer over (token embedding, fused target hidden states), and its
training-time test (TTT).

Layout and names match SGLang's `LlamaForCausalLMEagle3` (and vLLM's `Eagle3LlamaForCausalLM`), so export is a rename at
most:

    h_in  = fc(cat(aux_low, aux_mid, aux_high))            # (B, T, H)   step 0; later TTT steps feed back h_out
    x     = cat(input_layernorm(embed(ids)), hidden_norm(h_in))   # (B, T, 2H)  q/k/v take 2H inputs
    r     = self_attn(x) + h_in                            # residual comes from the fc output, not from x
    h_out = mlp(post_attention_layernorm(r)) + r           # pre-norm output: what decoding and TTT feed back
    logits = lm_head(norm(h_out))                          # (B, T, draft_vocab)

Alignment (SGLang's draft-extend): the drafter at position t sees embed(x[t+1]) and the target's aux state at t, and
predicts x[t+2]; its rotary position is t.

Attention runs over a key/value cache that holds earlier positions (decoding) or earlier training-time-test steps
(training). The mask decides what each query sees: `None` = causal over cache + new tokens, a bool tensor (exact, any
device), or a flex_attention `BlockMask` (compiled on CUDA; eager, forward-only on CPU). `ttt_mask` / `ttt_block_mask`
build the training-time-test pattern: step 0 is causal, and at step k a query also sees the keys of steps 1..k at its
own position only (the "diagonal").

Training-time test (`TTTModel`, one module forward per batch so DDP/FSDP can wrap it). Step k = 0..K-1 at position t:
input token x[t+1+k]; hidden input fc(aux[t]) at k = 0, else the step k-1 output h_out at t; rotary position t+k (what
decoding uses for the k-th draft token, and SpecForge's `position_ids + lck`); target distribution softmax over the
draft vocabulary of the target's logits at t+1+k (the frozen target lm_head applied to `final[t+1+k]`, columns of the
hot ids); predicted token x[t+2+k]. A (step, position) is counted when loss_mask[t+2+k] == 1, t+2+k < length and the
target's full-vocabulary argmax at t+1+k lies in the draft vocabulary. Loss = sum_k decay^k * mean over counted
positions of the soft cross-entropy -sum p_target log softmax(draft logits).

Right padding needs no mask of its own: a counted query (t+2+k < length) only sees step-0 keys at s <= t and diagonal
keys at t, all of which were built from real tokens.

Single-device model code: no I/O, no ranks, no logging.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


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
    """Number of captured aux layers K fused by fc."""
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

    @classmethod
    def from_target_config(cls, cfg, draft_vocab_size: int, num_aux: int, aux_layers=(),
                           **overrides) -> "DrafterConfig":
        """Derive the drafter's shape from a target's HF config (any Llama-like layout); `overrides` win."""
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
        if not rope and getattr(cfg, "rope_scaling", None):
            rope = dict(cfg.rope_scaling)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        H = cfg.hidden_size
        heads = cfg.num_attention_heads
        kw = dict(
            hidden_size=H, num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or H // heads,
            intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab_size,
            target_hidden_size=H, num_aux=num_aux, rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
            rope_theta=float(theta), rope_scaling=rope or None,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048),
            hidden_act=getattr(cfg, "hidden_act", "silu"), target_model_type=getattr(cfg, "model_type", "llama"),
            aux_layers=list(aux_layers),
        )
        if getattr(cfg, "model_type", "") in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
            # MLA targets: give the drafter a plain GQA layer of the same width (what SGLang's Llama drafter runs).
            kw["head_dim"] = 128 if H % 128 == 0 else H // heads
            kw["num_attention_heads"] = H // kw["head_dim"]
            kw["num_key_value_heads"] = (max(1, kw["num_attention_heads"] // 8) if H % 128 == 0
                                         else kw["num_attention_heads"])
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
    """Keys/values of earlier positions (decoding) or earlier TTT steps (training): (B, n_kv, S, hd) each."""

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

    def select(self, keep: torch.Tensor) -> None:
        """Keep the cache slots `keep` (1-D long tensor), in that order (tree decoding keeps an accepted path)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, keep], self.v[:, :, keep]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)

    def qkv(self, x, cos, sin):
        """x (B, T, 2H) -> rotated q (B, nh, T, hd), rotated k and v (B, nkv, T, hd)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

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

    def forward(self, x, cos, sin, cache: DrafterCache | None, mask) -> torch.Tensor:
        return self.o_proj(self.attend(*self.qkv(x, cos, sin), cache, mask))


_FLEX: dict = {}
FLEX_RECOMPILE_LIMIT = 64  # graphs of the compiled flex_attention region (dynamo's default, 8, is too few for TTT)


def _flex(cuda: bool):
    """flex_attention: compiled on CUDA (the fused kernel); eager on CPU (forward only there; checks the mask).

    On CUDA every call must reach the compiled kernel. Dynamo compiles one graph per guard set and, past its recompile
    limit (default 8 per code object, shared by every torch.compile(flex_attention) in the process), silently runs the
    function eagerly: the unfused flex_attention that materialises the (T, (k+1)T) scores ("flex_attention called
    without torch.compile()"). TTT needs more than 8 graphs: the first shape static, then dynamic; sizes 0/1 are always
    specialised, so a batch of one sample and a BlockMask with one q or kv block (T <= 128) each get their own; and the
    grad mode splits them all again, so `TTTModel(evaluate=True)` under no_grad (train's evaluation, which runs last)
    hit the limit. Hence a region of our own (a wrapper, so its cache is not shared), a budget of FLEX_RECOMPILE_LIMIT
    (the specialisations are bounded, ~2^4), and fullgraph=True: where torch.compile takes a per-call recompile_limit,
    running out then raises (FailOnRecompileLimitHit) instead of falling back to the unfused kernel."""
    if cuda not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        if cuda:
            def region(*a, **kw):  # its own code object: its own graph cache and recompile budget
                return flex_attention(*a, **kw)
            import inspect
            if "recompile_limit" in inspect.signature(torch.compile).parameters:  # per-region limit (torch 2.13)
                opts = {"recompile_limit": FLEX_RECOMPILE_LIMIT}
            else:  # older torch: only the process-wide limit exists
                cfg = torch._dynamo.config
                name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
                setattr(cfg, name, max(getattr(cfg, name), FLEX_RECOMPILE_LIMIT))
                opts = {}
            # dynamic=None: recompiles once with dynamic shapes, not per T
            _FLEX[cuda] = torch.compile(region, fullgraph=True, **opts)
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

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Midlayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    # pre/post hold everything but the cache and the attention kernel: pure tensor functions that torch.compile fuses
    # (train --compile replaces them on the instance), while the cache bookkeeping stays in plain Python.
    def pre(self, emb, hidden, cos, sin):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        return self.self_attn.qkv(x, cos, sin)

    def post(self, attn, hidden):
        r = self.self_attn.o_proj(attn) + hidden  # (B, T, H)
        return self.mlp(self.post_attention_layernorm(r)) + r  # (B, T, H) pre-norm

    def forward(self, emb, hidden, cos, sin, cache, mask):
        q, k, v = self.pre(emb, hidden, cos, sin)
        return self.post(self.self_attn.attend(q, k, v, cache, mask), hidden)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(max(cfg.num_aux, 1) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Midlayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = _make_rotary(cfg)

    # --- pieces used by training and decoding -------------------------------------------------------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Fuse captured target states: (B, T, K*Ht) or (B, T, K, Ht) -> (B, T, H)."""
        if aux.dim() == 4:
            aux = aux.flatten(-2)  # (B, T, K*Ht)
        return self.fc(aux.to(self.fc.weight.dtype))

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary(x, position_ids)  # cos, sin: (B, T, hd)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: DrafterCache | None = None, attn_mask=None) -> torch.Tensor:
        """One midlayer pass. input_ids (B, T) target ids; hidden (B, T, H); returns h_out (B, T, H), pre-norm."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        cos, sin = self.rope(hidden, position_ids)
        return self.midlayer(emb, hidden, cos, sin, cache, attn_mask)

    def compute_logits(self, h_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h_out))  # (B, T, Vd)

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


def _make_rotary(cfg: DrafterConfig) -> nn.Module:
    # HF's rotary module gives inv_freq identical to the target's for every rope_type (default, llama3, yarn, ...).
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    max_pos = max(cfg.max_position_embeddings, int(rope.get("original_max_position_embeddings", 0)) + 1)
    lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                     num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=max_pos, rope_parameters=rope)
    return LlamaRotaryEmbedding(lc)


# --- training-time-test masks ------------------------------------------------------------------------------------
def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Exact TTT mask for SDPA: (T, (step+1)*T) bool, True = may attend.

    Keys are laid out step-major: [step-0 keys 0..T-1, step-1 keys 0..T-1, ...]. Step-0 keys are causal; keys of steps
    1..step are visible only at the query's own position. With right padding no real query ever sees a padded key
    (causality), so no length mask is needed.
    """
    q = torch.arange(T, device=device)
    kv = torch.arange((step + 1) * T, device=device)
    kstep, kpos = kv // T, kv % T
    return ((kstep[None] == 0) & (kpos[None] <= q[:, None])) | ((kstep[None] > 0) & (kpos[None] == q[:, None]))


def ttt_block_mask(T: int, step: int, device="cuda"):
    """The same pattern as `ttt_mask` as a flex_attention BlockMask (sparse: only diagonal blocks of steps >= 1).

    T enters the mask function as a captured tensor, not a Python int, so a compiled flex_attention does not specialise
    (and recompile) on every sequence length."""
    from torch.nn.attention.flex_attention import create_block_mask

    period = torch.tensor(T, dtype=torch.int32, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        kstep, kpos = kv_idx // period, kv_idx % period
        return ((kstep == 0) & (kpos <= q_idx)) | ((kstep > 0) & (kpos == q_idx))

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=(step + 1) * T, device=device)


# --- training-time test ------------------------------------------------------------------------------------------
@torch.no_grad()
def target_distribution(final: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, head_weight: torch.Tensor,
                        hot: torch.Tensor, t2d: torch.Tensor, chunk: int = 4096, p_dtype=torch.float32) -> dict:
    """The target's next-token distributions over the draft vocabulary, only where some TTT step can count them.

    final (B, T, H) target final-norm states; loss_mask (B, T); lengths (B,); head_weight (V, H) the frozen target
    lm_head (its dtype is the matmul dtype); hot (Vd,) target ids of the draft vocabulary; t2d (V,) bool.
    Position s is a candidate when loss_mask[s+1] == 1 and s+1 < length (its target predicts a trained token).
    Returns {"s": (R,) flat indices b*T+s of the candidates, "p": (R, Vd) softmax of the hot columns of the target
    logits, "tgt": (R,) their argmax (a draft index), "inv": (R,) full-vocabulary argmax lies in the draft vocabulary}.
    Chunked over rows so that the (rows, V) logits never exist for the whole batch.
    """
    B, T, H = final.shape
    dev = final.device
    nxt = F.pad(loss_mask[:, 1:], (0, 1))  # (B, T): loss_mask[s+1]
    cand = (nxt == 1) & (torch.arange(T, device=dev)[None] + 1 < lengths.to(dev)[:, None])  # (B, T)
    s = cand.flatten().nonzero().squeeze(1)  # (R,)
    x = final.reshape(B * T, H).index_select(0, s)  # (R, H)
    R, Vd = s.numel(), hot.numel()
    p = torch.empty(R, Vd, dtype=p_dtype, device=dev)  # (R, Vd)
    tgt = torch.empty(R, dtype=torch.long, device=dev)  # (R,)
    inv = torch.empty(R, dtype=torch.bool, device=dev)  # (R,)
    for a in range(0, R, chunk):
        z = x[a:a + chunk].to(head_weight.dtype) @ head_weight.t()  # (n, V)
        inv[a:a + chunk] = t2d[z.argmax(-1)]
        zh = z.index_select(1, hot).float()  # (n, Vd)
        p[a:a + chunk] = torch.softmax(zh, -1).to(p_dtype)
        tgt[a:a + chunk] = zh.argmax(-1)
    return {"s": s, "p": p, "tgt": tgt, "inv": inv}


def _ce_core(z: torch.Tensor, p: torch.Tensor):
    """z (n, Vd) fp32 draft logits, p (n, Vd) target probabilities -> loss (n,), d loss / d z (n, Vd), argmax (n,).

    loss = -sum p log softmax(z) = lse * sum(p) - sum(p z); written with sum(p) so a bf16-rounded p stays exact."""
    lse = torch.logsumexp(z, -1, keepdim=True)  # (n, 1)
    psum = p.sum(-1, keepdim=True)  # (n, 1)
    loss = (lse * psum - (p * z).sum(-1, keepdim=True)).squeeze(-1)  # (n,)
    return loss, torch.exp(z - lse) * psum - p, z.argmax(-1)


class _SoftCE(torch.autograd.Function):
    """Sum over rows of the soft cross-entropy of lm_head(x) against p, chunked: the (rows, Vd) logits exist one chunk
    at a time and the gradients of x and of the weight are computed in the forward (what is kept is (rows, H) +
    (Vd, H)), so no logits are saved for backward."""

    @staticmethod
    def forward(ctx, x, weight, p, chunk, cd, core):
        wc = weight.to(cd)  # (Vd, H)
        n = x.shape[0]
        gx = torch.empty_like(x)  # (n, H)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (Vd, H)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        pred = torch.empty(n, dtype=torch.long, device=x.device)  # (n,)
        for a in range(0, n, chunk):
            xc = x[a:a + chunk].to(cd)  # (c, H)
            loss, dz, top = core((xc @ wc.t()).float(), p[a:a + chunk].float())  # (c,), (c, Vd), (c,)
            total += loss.sum()
            pred[a:a + chunk] = top
            dz = dz.to(cd)
            gx[a:a + chunk] = dz @ wc
            gw += (dz.t() @ xc).float()
        ctx.save_for_backward(gx, gw)
        ctx.w_dtype = weight.dtype
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, g_total, g_pred):
        gx, gw = ctx.saved_tensors
        return gx * g_total.to(gx.dtype), (gw * g_total).to(ctx.w_dtype), None, None, None, None


def soft_ce(x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, chunk: int = 4096, compute_dtype=None, core=None):
    """x (n, H) normed drafter states, weight (Vd, H) drafter lm_head, p (n, Vd) -> (sum of losses (), argmax (n,))."""
    return _SoftCE.apply(x, weight, p, chunk, compute_dtype or x.dtype, core or _ce_core)


@torch.no_grad()
def _ce_rows(x, weight, p, chunk, cd):
    """Per-row soft cross-entropy and argmax without gradients (evaluation)."""
    wc = weight.to(cd)
    loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)  # (n,)
    pred = torch.empty(x.shape[0], dtype=torch.long, device=x.device)  # (n,)
    for a in range(0, x.shape[0], chunk):
        z = (x[a:a + chunk].to(cd) @ wc.t()).float()  # (c, Vd)
        lse = torch.logsumexp(z, -1)
        pc = p[a:a + chunk].float()
        loss[a:a + chunk] = lse * pc.sum(-1) - (pc * z).sum(-1)
        pred[a:a + chunk] = z.argmax(-1)
    return loss, pred


def step_rows(tb: dict, T: int, k: int, counted_only: bool = True):
    """Rows of TTT step k: (rows_t (n,) flat query indices b*T+t, rows_c (n,) indices into tb's candidate rows).

    Step k at t reads the target at s = t+1+k, so t = s-1-k must stay in the same sequence: s % T >= 1+k."""
    keep = (tb["s"] % T) >= 1 + k  # (R,)
    if counted_only:
        keep &= tb["inv"]
    rows_c = keep.nonzero().squeeze(1)  # (n,)
    return tb["s"][rows_c] - (1 + k), rows_c


class TTTModel(nn.Module):
    """The training-time test of a drafter over one batch as a single forward (the module DDP/FSDP wrap).

    attn: "sdpa" (exact bool mask, any device), "flex" (BlockMask; compiled on CUDA), "causal" (approximate: each step
    attends causally to its own keys only, no cache; a cheaper baseline, not the EAGLE-3 objective)."""

    def __init__(self, drafter: Eagle3Drafter, ttt: int = 7, decay: float = 0.8, attn: str = "sdpa",
                 ce_chunk: int = 4096, compile: bool = False):
        super().__init__()
        if attn not in ("sdpa", "flex", "causal"):
            raise ValueError(f"attn: expected sdpa, flex or causal, got {attn!r}")
        self.drafter, self.ttt, self.decay, self.attn, self.ce_chunk = drafter, ttt, decay, attn, ce_chunk
        self._masks: dict = {}
        self._core = _ce_core
        if compile:
            mid = drafter.midlayer
            mid.pre = torch.compile(mid.pre)  # norms + q/k/v + RoPE fused
            mid.post = torch.compile(mid.post)  # o_proj + residual + norm + SwiGLU MLP + residual fused
            self._core = torch.compile(_ce_core, dynamic=True)  # one pass over the (chunk, Vd) logits

    def _mask(self, T: int, k: int, device):
        if self.attn == "causal":
            return None
        key = (T, k, str(device))
        m = self._masks.get(key)
        if m is None:
            if len(self._masks) >= 128:  # batches of many different lengths: keep memory bounded
                self._masks.clear()
            m = self._masks[key] = (ttt_block_mask if self.attn == "flex" else ttt_mask)(T, k, device=device)
        return m

    def forward(self, input_ids: torch.Tensor, feats: torch.Tensor, tb: dict, denom: torch.Tensor | None = None,
                scale: float = 1.0, evaluate: bool = False):
        """input_ids (B, T); feats (B, T, K, Ht) fc inputs; tb from `target_distribution`.

        Training: returns (loss, stats) with loss = scale * sum_k decay^k * sum(CE_k) / denom[k] (denom (K,) = counted
        positions of step k over the whole global batch, so that partial batches on several ranks or micro-steps add
        up to the global mean) and stats (K, 3) = [sum CE_k, correct_k, counted_k] of this batch (no grad).
        evaluate=True (no grad): returns (stats, sim (K+1,), runs (B, T)) where stats is as above, sim = [positions
        where every step is countable (loss_mask and length only), positions where steps 0..k are all correct, for each
        k] and runs[b, t] = how many leading steps are correct at t (0..K; a step that cannot be counted there ends the
        run); a step whose target argmax lies outside the draft vocabulary counts as wrong (it cannot be proposed)."""
        d = self.drafter
        B, T = input_ids.shape
        dev = input_ids.device
        hidden = d.project(feats)  # (B, T, H)
        cd = torch.get_autocast_dtype("cuda") if hidden.is_cuda and torch.is_autocast_enabled("cuda") else hidden.dtype
        cache = None if self.attn == "causal" else DrafterCache()
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        stats = torch.zeros(self.ttt, 3, dtype=torch.float64, device=dev)  # (K, 3)
        countable = torch.ones(B * T, dtype=torch.bool, device=dev)  # (B*T,) evaluate: countable at every step
        prefix = []  # evaluate: (B*T,) bool per step, steps 0..k all correct
        for k in range(self.ttt):
            ids = F.pad(input_ids[:, 1 + k:], (0, 1 + k))  # (B, T): x[t+1+k], 0 past the end
            pos = (torch.arange(T, device=dev) + k).expand(B, T)  # (B, T): draft step k sits at t+k
            h = d(ids, hidden, pos, cache, self._mask(T, k, dev))  # (B, T, H)
            rows_t, rows_c = step_rows(tb, T, k, counted_only=not evaluate)
            x = d.norm(h.reshape(B * T, -1).index_select(0, rows_t))  # (n, H)
            p, tgt = tb["p"].index_select(0, rows_c), tb["tgt"].index_select(0, rows_c)  # (n, Vd), (n,)
            if evaluate:
                ce, pred = _ce_rows(x, d.lm_head.weight, p, self.ce_chunk, cd)  # (n,), (n,)
                inv = tb["inv"].index_select(0, rows_c)  # (n,)
                ok = (pred == tgt) & inv
                stats[k] = torch.stack([(ce * inv).sum().double(), ok.sum().double(), inv.sum().double()])
                here = torch.zeros(B * T, dtype=torch.bool, device=dev)  # (B*T,)
                countable &= here.index_fill(0, rows_t, True)
                right = here.index_put((rows_t,), ok)  # (B*T,)
                prefix.append(right if k == 0 else prefix[-1] & right)
            else:
                ce, pred = soft_ce(x, d.lm_head.weight, p, self.ce_chunk, cd, self._core)
                loss = loss + (scale * self.decay ** k) * ce / denom[k].clamp_min(1)
                stats[k] = torch.stack([ce.detach().double(), (pred == tgt).sum().double(),
                                        torch.tensor(float(rows_c.numel()), dtype=torch.float64, device=dev)])
            hidden = h
        if not evaluate:
            return loss, stats
        sim = torch.stack([countable.sum()] + [(pk & countable).sum() for pk in prefix]).double()  # (K+1,)
        runs = torch.stack(prefix).sum(0).view(B, T)  # (B, T): leading correct steps
        return stats, sim, runs


def replay_chain(runs: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, max_k: int):
    """Greedy chain decoding replayed on teacher-forced runs -> (tokens (max_k,), rounds (max_k,)) for k = 1..max_k.

    Each answer (maximal span [P, E) of loss_mask = 1) is decoded as `speculate.py` would: x[P] comes from the
    prefill; a round at drafter position t (first t = P-1) accepts a = min(k, runs[t]) drafts plus one target token,
    producing x[t+2 .. t+2+a], and the next round starts at t + a + 1. On the target's own greedy outputs (`hstap
    generate`) this is what decoding does, round for round, so tokens / rounds predicts the measured tau; unlike the
    mean of prod acc_cond it keeps the fact that rounds start right after a rejection, where drafting is harder."""
    r, m = runs.cpu().numpy(), loss_mask.cpu().numpy().astype(bool)
    tokens, rounds = np.zeros(max_k, dtype=np.int64), np.zeros(max_k, dtype=np.int64)
    for b, n in enumerate(lengths.tolist()):
        mb = m[b, :n]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mb.astype(np.int8), [0]])))  # span starts, ends
        for P, E in zip(edges[::2], edges[1::2]):
            if P == 0:
                continue  # no prompt token before the answer: nothing to decode from
            for k in range(1, max_k + 1):
                t = P - 1
                while t + 2 < E:
                    a = min(k, int(r[b, t]))
                    tokens[k - 1] += min(a + 1, E - (t + 2))
                    rounds[k - 1] += 1
                    t += a + 1
    return tokens, rounds


def ttt_flops(cfg: DrafterConfig, lengths: torch.Tensor, counted: list[float], rows: float, ttt: int,
              exact_attn: bool = True) -> float:
    """Model FLOPs of one training batch (useful work only): lengths (B,) real tokens, counted[k] rows of TTT step k,
    rows = rows of the target head (`target_distribution` candidates). With N = sum(lengths):
    fc 4*N*K*Ht*H (forward + weight gradient; its input needs none) + 6*ttt*N*P_mid (q,k,v,o,gate,up,down weights)
    + 6*sum_k counted_k*H*Vd (the drafter lm_head runs on counted rows only) + 12*nh*hd*sum_k sum_t (t+1+k)
    (attention QK^T and PV: 4 FLOPs per query, key and dim forward, 8 backward; keys of the exact TTT mask, t+1 for
    the causal-only approximation) + 2*rows*H*V (target lm_head, forward only)."""
    H, hd, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    L = lengths.double().cpu()
    N = float(L.sum())
    p_mid = 2 * H * (nh + 2 * cfg.num_key_value_heads) * hd + nh * hd * H + 3 * H * cfg.intermediate_size
    f = 4 * N * max(1, cfg.num_aux) * cfg.target_hidden_size * H + 6 * ttt * N * p_mid
    f += 6 * sum(counted) * H * cfg.draft_vocab_size + 2 * rows * H * cfg.vocab_size
    keys = float((L * (L + 1) / 2).sum())  # sum over tokens of (t+1)
    return f + 12 * nh * hd * sum(keys + (k * N if exact_attn else 0.0) for k in range(ttt))
