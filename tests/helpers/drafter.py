"""A tiny drafter with weights far from their init, a target head whose argmaxes mostly (not all) land in the draft
vocabulary, and a right-padded batch: the inputs of the drafter and training-time-test tests."""

from __future__ import annotations

import math

import torch

from hstap.models.drafter import DrafterConfig, Eagle3Drafter

V, VD, H, KA = 24, 6, 16, 2


def tiny_setup(seed=0, B=2, T=10, lengths=(10, 7), num_layers=1):
    """-> (drafter, target head W (V, H), hot ids (VD,), t2d (V,), ids (B, T), loss_mask (B, T), lengths (B,),
    aux (B, T, KA, H), final (B, T, H))."""
    g = torch.Generator().manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                        vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, num_aux=KA, rope_theta=500.0,
                        num_layers=num_layers)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():  # norms away from 1 so that every weight matters; a larger init so outputs differ per token
        for n, p in d.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1 else torch.randn(p.shape, generator=g)
                    / math.sqrt(p.shape[-1]) * (1.0 if "embed" in n else 2.0))
    hot = torch.tensor([1, 4, 5, 9, 16, 20])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    d.set_vocab_map(hot - torch.arange(VD), t2d)
    W = torch.randn(V, H, generator=g)  # target lm_head
    W[hot] *= 2.5  # most, not all, argmaxes land in the draft vocabulary
    ids = torch.randint(0, V, (B, T), generator=g)
    lm = (torch.rand(B, T, generator=g) > 0.25).long()
    L = torch.tensor(lengths)
    for b in range(B):
        ids[b, L[b]:], lm[b, L[b]:] = 0, 0
    aux = torch.randn(B, T, KA, H, generator=g)
    final = torch.randn(B, T, H, generator=g)
    return d, W, hot, t2d, ids, lm, L, aux, final
