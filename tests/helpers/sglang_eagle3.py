"""SGLang's EAGLE-3 draft model (`LlamaForCausalLMEagle3`, sglang 0.5.23 srt/models/llama_eagle3.py) re-implemented
from its source, for tests/export/test_export.py: its weight loader (tables read from the installed source) and its forward,
so an SGLang export is checked against what SGLang would load and compute, without a GPU or a server."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def sglang_source() -> str:
    import importlib.util
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    f = Path(list(spec.submodule_search_locations)[0]) / "srt" / "models" / "llama_eagle3.py"
    if not f.is_file():
        pytest.skip("sglang/srt/models/llama_eagle3.py not found")
    return f.read_text()


def _load_weights_tables(src: str) -> tuple[list, dict]:
    """stacked_params_mapping and legacy_name_map, read from the real LlamaForCausalLMEagle3.load_weights."""
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    tables = {t.targets[0].id: ast.literal_eval(t.value) for t in ast.walk(fn)
              if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name)
              and t.targets[0].id in ("stacked_params_mapping", "legacy_name_map")}
    return tables["stacked_params_mapping"], tables["legacy_name_map"]


def sglang_load(export_dir: Path, src: str) -> tuple[dict, dict, torch.Tensor]:
    """Replays LlamaForCausalLMEagle3.__init__ + load_weights (sglang 0.5.23 srt/models/llama_eagle3.py) on CPU tensors.

    Parameters of the SGLang module (constructor, L122-207 and L292-314): model.embed_tokens, model.fc (in =
    target_hidden_size * num_aux, num_aux from eagle_config ids, L151-167), model.layers.0.self_attn.{qkv_proj,o_proj},
    model.layers.0.mlp.{gate_up_proj,down_proj}, model.layers.0.{input_layernorm,hidden_norm,post_attention_layernorm},
    model.norm, lm_head (draft_vocab_size rows, untied, L303-314). load_weights (L325-378): legacy names
    (midlayer -> layers.0), d2t -> hot_token_id = d2t + arange (L350-353), t2d skipped, q/k/v -> qkv_proj shards and
    gate/up -> gate_up_proj shards (offsets of QKVParallelLinear._get_shard_offset_mapping and
    MergedColumnParallelLinear.weight_loader in srt/layers/linear.py, tp=1), else `name` or `model.{name}`; names
    matching no parameter are silently dropped by SGLang, so we collect them and the test asserts there are none.
    """
    stacked, legacy = _load_weights_tables(src)
    c = json.loads((export_dir / "config.json").read_text())
    H, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim", H // nh)
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    K = c.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    Ht = c.get("target_hidden_size", H)
    assert not c["tie_word_embeddings"] and c["draft_vocab_size"] is not None
    inter = c["intermediate_size"]
    params = {
        "model.embed_tokens.weight": torch.full((c["vocab_size"], H), float("nan")),
        "model.fc.weight": torch.full((H, Ht * K), float("nan")),
        "model.layers.0.self_attn.qkv_proj.weight": torch.full(((nh + 2 * nkv) * hd, 2 * H), float("nan")),
        "model.layers.0.self_attn.o_proj.weight": torch.full((H, nh * hd), float("nan")),
        "model.layers.0.mlp.gate_up_proj.weight": torch.full((2 * inter, H), float("nan")),
        "model.layers.0.mlp.down_proj.weight": torch.full((H, inter), float("nan")),
        **{f"model.layers.0.{n}.weight": torch.full((H,), float("nan"))
           for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
        "model.norm.weight": torch.full((H,), float("nan")),
        "lm_head.weight": torch.full((c["draft_vocab_size"], H), float("nan")),
    }
    qkv_off = {"q": (0, nh * hd), "k": (nh * hd, nkv * hd), "v": ((nh + nkv) * hd, nkv * hd)}
    loaded, dropped, hot = set(), [], None
    for name, w in load_file(str(export_dir / "model.safetensors")).items():
        for old, new in legacy.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, shard_id in stacked:
            if weight_name not in name:
                continue
            name = name.replace(weight_name, param_name)
            pn = f"model.{name}" if name not in params else name
            if pn in params:
                off, size = qkv_off[shard_id] if isinstance(shard_id, str) else (shard_id * inter, inter)
                assert w.shape == (size, params[pn].shape[1])
                params[pn][off:off + size] = w.float()
                loaded.add((pn, shard_id))
            else:
                dropped.append(name)
            break
        else:
            pn = name if name in params else f"model.{name}"
            if pn in params:
                assert params[pn].shape == w.shape, pn  # default_weight_loader asserts equal sizes
                params[pn] = w.float().clone()
                loaded.add((pn, None))
            else:
                dropped.append(name)
    return params, {"loaded": loaded, "dropped": dropped, "config": c}, hot


def _rmsnorm(x, w, eps, residual=None):
    """srt/layers/layernorm.py RMSNorm.forward_native (L828-877): optional fused residual add, fp32 normalisation."""
    x = x.float()
    if residual is not None:
        x = x + residual.float()
        residual = x
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return out if residual is None else (out, residual)


def sglang_forward(params: dict, c: dict, input_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor):
    """One sequence through SGLang's draft model, written from its forward code (no shared code with hstap.models.drafter).

    llama_eagle3.py LlamaModel.forward L217-269: embeds = embed_tokens(ids); fc when the hidden width differs from the
    embedding's (L237-247); layer 0 (LlamaDecoderLayer.forward L97-119): residual = hidden; hidden = hidden_norm(hidden);
    embeds = input_layernorm(embeds); cat([embeds, hidden]); self_attn; post_attention_layernorm(hidden, residual) (fused
    add); mlp; then norm(hidden, residual) (L263): normed output -> logits, pre-norm sum -> next step's hidden (aux).
    Attention: srt/models/llama.py LlamaAttention.forward_prepare_native (L243-247: qkv split [q, kv, kv], rotary_emb),
    scaling head_dim**-0.5, causal over the sequence, o_proj (L287). Rotary: srt/layers/rotary_embedding base.py
    _compute_inv_freq / _compute_cos_sin_cache (L233-266, neox style) and utils.apply_rotary_emb (L36-62). MLP:
    llama.py LlamaMLP.forward (L124-141) with SiluAndMul.forward_native (activation.py L141-143).
    """
    H, nh, nkv, eps = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    hd = c.get("head_dim", H // nh)
    rope = c.get("rope_parameters") or c.get("rope_scaling")  # llama.py LlamaDecoderLayer.__init__ L322-328
    base = rope.get("rope_theta", 10000) if c.get("rope_parameters") else c.get("rope_theta", 10000)
    assert rope.get("rope_type", "default") == "default"  # get_rope -> plain RotaryEmbedding
    P = lambda n: params[n]  # noqa: E731
    T = input_ids.shape[0]
    embeds = P("model.embed_tokens.weight")[input_ids]  # (T, H)
    hidden = aux @ P("model.fc.weight").T  # (T, H)
    residual = hidden
    hidden = _rmsnorm(hidden, P("model.layers.0.hidden_norm.weight"), eps)
    embeds = _rmsnorm(embeds, P("model.layers.0.input_layernorm.weight"), eps)
    x = torch.cat([embeds, hidden], dim=-1)  # (T, 2H)
    qkv = x @ P("model.layers.0.self_attn.qkv_proj.weight").T
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    freqs = torch.einsum("i,j -> ij", positions.float(), inv_freq)  # (T, hd/2)
    cos, sin = freqs.cos().unsqueeze(-2), freqs.sin().unsqueeze(-2)

    def rot(t, n):
        t = t.view(T, n, hd)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (T, n, hd)

    q, k, v = rot(q, nh), rot(k, nkv), v.view(T, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)  # (T, nh, hd)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * hd)
    hidden = attn @ P("model.layers.0.self_attn.o_proj.weight").T
    hidden, residual = _rmsnorm(hidden, P("model.layers.0.post_attention_layernorm.weight"), eps, residual)
    gate_up = hidden @ P("model.layers.0.mlp.gate_up_proj.weight").T
    d = gate_up.shape[-1] // 2
    hidden = (F.silu(gate_up[..., :d]) * gate_up[..., d:]) @ P("model.layers.0.mlp.down_proj.weight").T
    to_logits, to_aux = _rmsnorm(hidden, P("model.norm.weight"), eps, residual)
    return to_logits @ P("lm_head.weight").T, to_aux  # (T, Vd), (T, H)
