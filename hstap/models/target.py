"""The target LLM as hstap sees it: a HF causal LM whose chosen decoder-layer outputs are tapped with forward hooks.

`Target.capture` runs the base model (not `lm_head`: capture never needs vocabulary logits) and returns the outputs of
the requested decoder layers, stacked as aux (B, T, K, H), plus the final-norm output (B, T, H). Hooks keep only the K
requested layers alive instead of all N+1 that `output_hidden_states` would hold. The same call serves prefill capture
(no cache), online training, and speculative decoding (with a KV cache, a custom 4-D mask and explicit positions).

Works for any HF decoder with the usual `model.layers` / `model.norm` / `model.embed_tokens` layout (Llama, Qwen2/3,
Mistral, DeepseekV3, ...). Layer ids are canonical (`hstap.layers`): id i is the output of decoder layer i.

Single-device model code: no I/O, no ranks, no logging (loading lives in `hstap/artifacts/model_dir.py`).
"""

from __future__ import annotations

import torch
from torch import nn


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class Target:
    def __init__(self, model: nn.Module):
        self.model = model
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.base = base
        self.layers = base.layers
        self.norm = base.norm
        self.embed_tokens = base.embed_tokens
        self.lm_head = model.get_output_embeddings()
        cfg = model.config
        self.config = cfg
        self.num_layers = len(self.layers)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.model_type = cfg.model_type

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, layers: list[int], attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False):
        """input_ids (B, T) -> aux (B, T, K, H), final (B, T, H), past_key_values (when use_cache).

        For right-padded batches pass no mask: causal attention already keeps every real token from seeing the padding
        after it, and the padded rows are dropped by the caller.
        """
        grabbed: dict[int, torch.Tensor] = {}
        handles = [self.layers[i].register_forward_hook(_grabber(grabbed, i)) for i in layers]
        try:
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache)
        finally:
            for h in handles:
                h.remove()
        final = out.last_hidden_state  # (B, T, H): output of the final norm
        aux = torch.stack([grabbed[i] for i in layers], dim=2) if layers else final.new_zeros(*final.shape[:2], 0,
                                                                                              final.shape[-1])  # (B, T, K, H)
        return aux, final, (out.past_key_values if use_cache else None)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """Final-norm states (..., H) -> vocabulary logits (..., V)."""
        return self.lm_head(final)


def _grabber(store: dict, i: int):
    def hook(module, inputs, output):
        store[i] = _first(output)  # (B, T, H) residual stream after layer i

    return hook
