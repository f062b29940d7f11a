"""A QuaRot-style rotation of a Llama target (the test of verify's "a rotation never passes"): the RMSNorm scales
folded into the Linears that read the normed states, then the residual stream turned by a random orthogonal Q
(every state h becomes h Q). The rotated model computes the same logits; every hidden state is in another basis."""

from __future__ import annotations

from pathlib import Path

import torch


def rotate_llama(src: Path, dst: Path, seed: int = 0) -> torch.Tensor:
    """Save the rotated copy of the Llama at `src` (with its tokenizer files) to `dst`; returns Q (H, H)."""
    import shutil

    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    H = m.config.hidden_size
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    q = q.float()  # (H, H) orthogonal

    def reads(lin, g):  # a Linear reading norm(h) * g: now reads norm(h Q)
        lin.weight.copy_((lin.weight * g[None]) @ q)

    with torch.no_grad():
        base = m.model
        base.embed_tokens.weight.copy_(base.embed_tokens.weight @ q)
        for layer in base.layers:
            a, f = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj):
                reads(lin, layer.input_layernorm.weight)
            for lin in (f.gate_proj, f.up_proj):
                reads(lin, layer.post_attention_layernorm.weight)
            a.o_proj.weight.copy_(q.t() @ a.o_proj.weight)  # writes into the residual stream: rotated too
            f.down_proj.weight.copy_(q.t() @ f.down_proj.weight)
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        reads(m.lm_head, base.norm.weight)
        base.norm.weight.fill_(1.0)
    m.save_pretrained(str(dst))
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, dst / f.name)
    return q
