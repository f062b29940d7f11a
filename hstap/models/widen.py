"""Function-preserving widening of a Llama-family target and of its EAGLE-3 drafter: the same next-token function at a
bigger model's cost (model code: state dicts in, state dicts out; no I/O).

Why: a small trained target is launch-bound on a GPU, so its speedups say little about serving a real model. Widened to
the Llama-3.1-8B shape (`LLAMA_8B`: hidden 4096, 32 layers, 32/8 heads of 128, intermediate 14336) it costs what an 8B
model costs per step (the same GEMM shapes and bytes) and keeps the small target's greedy outputs, its hidden states
(zero-padded) and hence a drafter's acceptance.

How, with H -> H' (and the rest likewise), every new weight entry 0 unless said:
- the residual stream keeps the original H components and 0 in the others: embedding rows padded with zeros; every
  projection that writes the stream (o_proj, down_proj) writes only the first H rows;
- RMSNorm: mean(x^2) is now over H' components of which H are non-zero, so the weights are scaled by sqrt(H/H') and
  `rms_norm_eps` by H/H': x * rsqrt(sum/H' + eps H/H') * w sqrt(H/H') = x * rsqrt(sum/H + eps) * w, exactly;
- attention: original query head h of kv group g = h // r (r heads per group) becomes wide head g r' + h % r (r' >= r),
  kv head g stays g; head_dim d -> d' = f d keeps RoPE's frequencies when original dim i of each half goes to wide dim
  f i of the same half (frequency theta^(-2i/d) = theta^(-2fi/d')); queries are scaled by sqrt(d'/d) to undo the softmax
  scale 1/sqrt(d') (so q.k / sqrt(d') is the original q.k / sqrt(d)). Unused heads have zero q, k, v and o columns;
- MLP: the first I units are the original's, the rest have zero gate, up and down weights (silu(0) * 0 = 0);
- layers: the original layers sit at wide positions chosen so that the wide target's default EAGLE-3 taps
  ([1, N'/2-1, N'-4]) read the states the drafter was trained on (`layer_positions`); the layers in between have all
  weights zero, so each adds exactly 0 to the residual stream (and costs a full layer).
- the drafter: fc reads each captured state's first H components (the rest are 0) and writes the first H rows; its
  q/k/v read cat(embedding, hidden) at columns [0, H) and [H', H' + H); norms, heads and MLP as the target's; of
  speculators' variants (`hstap.models.drafter.SPECULATORS_FLAGS`) input_norm is rescaled as a norm over K*H' inputs
  and the other two need nothing more.
- tied embeddings (SmolLM2): lm_head is the padded embedding, so widening either gives the same wide matrix; the wide
  config keeps `tie_word_embeddings`, and the wide model one copy. Its cost is an 8B's but for the vocabulary: the
  head reads V x H' (SmolLM2: 49,152 rows, Llama-3.1-8B: 128,256; bench_wide.py reports the weight bytes).

Exact in real arithmetic: in fp32 the greedy outputs equal the original's (tests/models/test_widen.py); in bf16 the
rescaled norms round differently and a near-tie can flip (bench_wide.py reports the agreement).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hstap.common import HstapError


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder shape to widen to."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


LLAMA_8B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
ROPE_TYPES = ("default", "llama3")  # both act on each frequency alone, so a kept frequency keeps its value


def _src_shape(cfg) -> Shape:
    heads = cfg.num_attention_heads
    return Shape(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
                 kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                 head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                 intermediate=cfg.intermediate_size)


def check_widening(src: Shape, dst: Shape, rope_type: str = "default") -> None:
    """HstapError unless `dst` can hold `src` function-preservingly."""
    problems = []
    for name in ("hidden", "layers", "kv_heads", "intermediate"):
        if getattr(dst, name) < getattr(src, name):
            problems.append(f"{name} {getattr(dst, name)} < {getattr(src, name)}")
    if dst.head_dim % src.head_dim or dst.head_dim < src.head_dim:
        problems.append(f"head_dim {dst.head_dim} is not a multiple of {src.head_dim}")
    if src.heads % src.kv_heads or dst.heads % dst.kv_heads or dst.heads // dst.kv_heads < src.heads // src.kv_heads:
        problems.append(f"{dst.heads}/{dst.kv_heads} heads cannot hold {src.heads}/{src.kv_heads} (query heads per kv "
                        "head must not shrink)")
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_type {rope_type!r} (only {', '.join(ROPE_TYPES)} keep their frequencies)")
    if problems:
        raise HstapError("widen: " + "; ".join(problems))


def dim_index(d: int, d_wide: int) -> torch.Tensor:
    """(d,) wide position of each original head dim: dim i of each rotary half goes to f i of the same half."""
    f, half = d_wide // d, d // 2
    i = torch.arange(d)
    return torch.where(i < half, f * i, d_wide // 2 + f * (i - half))


def head_rows(src: Shape, dst: Shape, kv: bool) -> torch.Tensor:
    """(n_heads * d,) rows of the wide q (kv=False) or k/v (kv=True) projection that the original rows go to."""
    di = dim_index(src.head_dim, dst.head_dim)  # (d,)
    if kv:
        heads = torch.arange(src.kv_heads)
    else:
        r, r_w = src.heads // src.kv_heads, dst.heads // dst.kv_heads
        h = torch.arange(src.heads)
        heads = (h // r) * r_w + h % r
    return (heads[:, None] * dst.head_dim + di[None, :]).flatten()


def _place(w: torch.Tensor, shape: tuple[int, int], rows=None, cols=None) -> torch.Tensor:
    """A zero (out', in') matrix holding w at rows x cols (default: the first ones)."""
    out = torch.zeros(shape, dtype=w.dtype, device=w.device)
    rows = torch.arange(w.shape[0], device=w.device) if rows is None else rows.to(w.device)
    cols = torch.arange(w.shape[1], device=w.device) if cols is None else cols.to(w.device)
    out[rows[:, None], cols[None, :]] = w
    return out


def _norm(w: torch.Tensor, H: int, H_wide: int) -> torch.Tensor:
    out = torch.zeros(H_wide, dtype=w.dtype, device=w.device)
    out[:H] = w * math.sqrt(H / H_wide)
    return out


def widen_attention_mlp(p: dict, src: Shape, dst: Shape, in_cols: torch.Tensor | None = None,
                        in_width: int | None = None) -> dict:
    """One decoder layer's q/k/v/o and gate/up/down (keys `self_attn.q_proj.weight` ...): `in_cols` (q/k/v input
    columns, default the first ones of `in_width` = H')."""
    Hw = dst.hidden
    in_width = in_width or Hw
    q_rows, kv_rows = head_rows(src, dst, kv=False), head_rows(src, dst, kv=True)
    q_scale = math.sqrt(dst.head_dim / src.head_dim)
    a = "self_attn."
    return {
        a + "q_proj.weight": _place(p[a + "q_proj.weight"] * q_scale, (dst.heads * dst.head_dim, in_width), q_rows, in_cols),
        a + "k_proj.weight": _place(p[a + "k_proj.weight"], (dst.kv_heads * dst.head_dim, in_width), kv_rows, in_cols),
        a + "v_proj.weight": _place(p[a + "v_proj.weight"], (dst.kv_heads * dst.head_dim, in_width), kv_rows, in_cols),
        a + "o_proj.weight": _place(p[a + "o_proj.weight"], (Hw, dst.heads * dst.head_dim), None, q_rows),
        "mlp.gate_proj.weight": _place(p["mlp.gate_proj.weight"], (dst.intermediate, Hw)),
        "mlp.up_proj.weight": _place(p["mlp.up_proj.weight"], (dst.intermediate, Hw)),
        "mlp.down_proj.weight": _place(p["mlp.down_proj.weight"], (Hw, dst.intermediate)),
    }


def layer_positions(num_layers: int, wide_layers: int, aux: list[int], wide_aux: list[int]) -> list[int]:
    """Wide position of each original layer: aux[k] at wide_aux[k] (so the state after wide layer wide_aux[k] is the
    state after original layer aux[k]), the last layer last, the others right after their predecessor."""
    if len(aux) != len(wide_aux) or list(aux) != sorted(aux) or list(wide_aux) != sorted(wide_aux):
        raise HstapError(f"widen: aux layers {aux} and wide aux layers {wide_aux} must be increasing and as many")
    pos: list[int | None] = [None] * num_layers
    for a, w in zip(aux, wide_aux):
        pos[a] = w
    if pos[-1] is None:
        pos[-1] = wide_layers - 1
    prev = -1
    for i in range(num_layers):  # the others right after their predecessor
        if pos[i] is None:
            pos[i] = prev + 1
        prev = pos[i]
    if any(b <= a for a, b in zip(pos, pos[1:])) or pos[0] < 0 or pos[-1] != wide_layers - 1:
        raise HstapError(f"widen: cannot place {num_layers} layers (taps {aux}) in {wide_layers} (taps {wide_aux})")
    return pos


def widen_target(state: dict, cfg, dst: Shape, aux: list[int], wide_aux: list[int]) -> tuple[dict, dict]:
    """(wide state dict, wide config fields) of a HF Llama-family causal LM (`state` = model.state_dict(), `cfg` its
    config): the config fields to override are hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size and rms_norm_eps."""
    src = _src_shape(cfg)
    rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}).get("rope_type", "default")
    check_widening(src, dst, rope)
    H, Hw = src.hidden, dst.hidden
    pos = layer_positions(src.layers, dst.layers, aux, wide_aux)
    out = {"model.embed_tokens.weight": _place(state["model.embed_tokens.weight"],
                                                (state["model.embed_tokens.weight"].shape[0], Hw)),
           "model.norm.weight": _norm(state["model.norm.weight"], H, Hw)}
    if "lm_head.weight" in state:
        out["lm_head.weight"] = _place(state["lm_head.weight"], (state["lm_head.weight"].shape[0], Hw))
    ref = state["model.layers.0.self_attn.q_proj.weight"]
    for j in range(dst.layers):
        pre = f"model.layers.{j}."
        if j in pos:
            i = pos.index(j)
            p = {k[len(f"model.layers.{i}."):]: v for k, v in state.items() if k.startswith(f"model.layers.{i}.")}
            out.update({pre + k: v for k, v in widen_attention_mlp(p, src, dst).items()})
            out[pre + "input_layernorm.weight"] = _norm(p["input_layernorm.weight"], H, Hw)
            out[pre + "post_attention_layernorm.weight"] = _norm(p["post_attention_layernorm.weight"], H, Hw)
        else:  # a layer that adds exactly 0: every weight zero (it still costs a full layer's GEMMs)
            z = lambda *s: torch.zeros(s, dtype=ref.dtype, device=ref.device)  # noqa: E731
            out.update({pre + "self_attn.q_proj.weight": z(dst.heads * dst.head_dim, Hw),
                        pre + "self_attn.k_proj.weight": z(dst.kv_heads * dst.head_dim, Hw),
                        pre + "self_attn.v_proj.weight": z(dst.kv_heads * dst.head_dim, Hw),
                        pre + "self_attn.o_proj.weight": z(Hw, dst.heads * dst.head_dim),
                        pre + "mlp.gate_proj.weight": z(dst.intermediate, Hw),
                        pre + "mlp.up_proj.weight": z(dst.intermediate, Hw),
                        pre + "mlp.down_proj.weight": z(Hw, dst.intermediate),
                        pre + "input_layernorm.weight": torch.ones(Hw, dtype=ref.dtype, device=ref.device),
                        pre + "post_attention_layernorm.weight": torch.ones(Hw, dtype=ref.dtype, device=ref.device)})
    fields = {"hidden_size": Hw, "num_hidden_layers": dst.layers, "num_attention_heads": dst.heads,
              "num_key_value_heads": dst.kv_heads, "head_dim": dst.head_dim, "intermediate_size": dst.intermediate,
              "rms_norm_eps": float(cfg.rms_norm_eps) * H / Hw}
    return out, fields


def widen_drafter(state: dict, dcfg, dst: Shape, wide_aux: list[int]):
    """(wide state dict, wide DrafterConfig) of a one-layer hstap EAGLE-3 drafter (`Eagle3Drafter.state_dict()` and its
    DrafterConfig) for the target widened to `dst` (whose taps are `wide_aux`). The drafter keeps its own depth."""
    if dcfg.num_layers != 1:
        raise HstapError(f"widen: a {dcfg.num_layers}-layer drafter (only one-layer drafters are widened)")
    if dcfg.target_hidden_size != dcfg.hidden_size:
        raise HstapError("widen: the drafter's width differs from the target's")
    src = Shape(dcfg.hidden_size, 1, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim,
                dcfg.intermediate_size)
    d_dst = dataclasses.replace(dst, layers=1)
    check_widening(src, d_dst, (dcfg.rope_scaling or {}).get("rope_type", "default"))
    H, Hw, K = src.hidden, dst.hidden, dcfg.num_aux
    fc_cols = (torch.arange(K)[:, None] * Hw + torch.arange(H)[None, :]).flatten()  # (K*H,)
    in_cols = torch.cat([torch.arange(H), Hw + torch.arange(H)])  # cat(embedding, hidden)
    mid = {k[len("midlayer."):]: v for k, v in state.items() if k.startswith("midlayer.")}
    out = {"embed_tokens.weight": _place(state["embed_tokens.weight"], (dcfg.vocab_size, Hw)),
           "fc.weight": _place(state["fc.weight"], (Hw, K * Hw), None, fc_cols),
           "norm.weight": _norm(state["norm.weight"], H, Hw),
           "lm_head.weight": _place(state["lm_head.weight"], (dcfg.draft_vocab_size, Hw)),
           "d2t": state["d2t"], "t2d": state["t2d"]}
    if dcfg.norm_before_fc:  # speculators' input_norm over the K*H' fc inputs, K*H of them non-zero: as every norm
        w = state["input_norm.weight"]
        out["input_norm.weight"] = torch.zeros(K * Hw, dtype=w.dtype, device=w.device).index_copy(
            0, fc_cols.to(w.device), w * math.sqrt(H / Hw))
    out.update({"midlayer." + k: v for k, v in widen_attention_mlp(mid, src, d_dst, in_cols, 2 * Hw).items()})
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{n}.weight"] = _norm(mid[f"{n}.weight"], H, Hw)
    wide = dataclasses.replace(dcfg, hidden_size=Hw, num_attention_heads=dst.heads, num_key_value_heads=dst.kv_heads,
                               head_dim=dst.head_dim, intermediate_size=dst.intermediate, target_hidden_size=Hw,
                               rms_norm_eps=dcfg.rms_norm_eps * H / Hw, aux_layers=list(wide_aux))
    return out, wide
