"""Test models for speculative decoding: a real-midlayer drafter with an oracle head, and context-function stubs.

`StubTarget` / `StubDrafter` (litgpt-style) return fixed logits chosen by a Python function of the *visible context*.
Their KV caches are real (`DynamicCache` / `DrafterCache`) and hold the token ids themselves, so the context each query
sees is decided by the same masks, positions, gathers and crops that a real model goes through: a wrong tree mask, a
wrong rollback or a wrong position changes their outputs (positions are asserted against the context length).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers import DynamicCache

from hstap.layers import fc_slots
from hstap.models.drafter import DrafterConfig, Eagle3Drafter


def load_tiny_target(path):
    """(Target, tokenizer) through artifacts/model_dir.py when it exists, else straight from transformers (fp32, CPU)."""
    try:
        from hstap.artifacts.model_dir import load_target
    except ImportError:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hstap.models.target import Target

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return Target(model), AutoTokenizer.from_pretrained(str(path))
    return load_target(str(path), device="cpu", dtype="fp32")


def random_prompts(V: int, n: int, length: int, seed: int) -> list[list[int]]:
    """n random prompts of `length` ids in [6, V) (above the special tokens), reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, V, (length,), generator=g).tolist() for _ in range(n)]


def random_drafter(target, aux_layers=(1, 2, 3), draft_vocab: int | None = None, seed: int = 0,
                   num_layers: int = 1) -> Eagle3Drafter:
    """A random-init EAGLE-3 drafter for `target`, with a draft vocabulary that is a random subset of the target's."""
    g = torch.Generator().manual_seed(seed)
    V = target.vocab_size
    Vd = draft_vocab or V
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=Vd, num_aux=fc_slots(aux_layers),
                                           aux_layers=list(aux_layers), num_layers=num_layers)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    hot = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    d.set_vocab_map(hot - torch.arange(Vd), t2d)
    d.init_from_target(target.embed_tokens.weight, target.lm_head.weight)
    return d.eval()


class OracleDrafter(Eagle3Drafter):
    """A real drafter (midlayer and KV cache run as usual) whose head proposes a known continuation `seq`.

    At drafter position t the head ranks seq[t+2] first, or second behind a decoy when t+2 is in `second` (so tree
    paths go through second children and the KV rollback must move entries)."""

    def __init__(self, cfg: DrafterConfig, seq: list[int], second=()):
        super().__init__(cfg)
        self.seq, self.second, self._pos = list(seq), set(second), 0

    def forward(self, input_ids, hidden, position_ids, cache=None, attn_mask=None):
        self._pos = int(position_ids[0, -1])  # every row of one call sits at the same position (extend: its last)
        return super().forward(input_ids, hidden, position_ids, cache, attn_mask)

    def compute_logits(self, h):
        i = self._pos + 2
        want = self.seq[i] if i < len(self.seq) else 0
        logits = torch.zeros(*h.shape[:-1], self.config.draft_vocab_size)
        logits[..., want] = 10.0
        if i in self.second:
            logits[..., (want + 1) % self.config.draft_vocab_size] = 11.0
        return logits


def oracle_drafter(target, seq, second=(), aux_layers=(1, 2, 3), num_layers: int = 1) -> OracleDrafter:
    V = target.vocab_size
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=V, num_aux=len(aux_layers),
                                           aux_layers=list(aux_layers), num_layers=num_layers)
    torch.manual_seed(0)
    d = OracleDrafter(cfg, seq, second)
    d.init_from_target(target.embed_tokens.weight)
    return d.eval()


def _contexts(seq: list[int], past: int, T: int, mask) -> list[list[int]]:
    """The ids each of the T new queries may see: causal when mask is None, else the mask's allowed columns."""
    if mask is None:
        return [seq[:past + i + 1] for i in range(T)]
    m = mask[0, 0] == 0 if mask.dim() == 4 else mask  # 4-D additive (target) or 2-D bool (drafter)
    return [[s for s, ok in zip(seq, row) if ok] for row in m.tolist()]


class StubTarget:
    """Target whose next-token logits are `fn(context ids) -> (V,)`; aux states are the logits repeated K times."""

    def __init__(self, fn, vocab_size: int, num_layers: int = 4):
        self.fn, self.vocab_size, self.hidden_size, self.num_layers = fn, vocab_size, vocab_size, num_layers
        self.config = SimpleNamespace(_attn_implementation="sdpa", sliding_window=None)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def capture(self, input_ids, layers, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False):
        T = input_ids.shape[1]
        cache = past_key_values if past_key_values is not None else DynamicCache()
        past = cache.get_seq_length()
        kv = input_ids.to(torch.float32).view(1, 1, T, 1)
        keys, _ = cache.update(kv, kv, 0)
        ctxs = _contexts(keys.view(-1).long().tolist(), past, T, attention_mask)
        if position_ids is not None:
            assert position_ids[0].tolist() == [len(c) - 1 for c in ctxs], "position ids disagree with the mask"
        final = torch.stack([torch.as_tensor(self.fn(c), dtype=torch.float32) for c in ctxs])[None]  # (1, T, V)
        aux = final.unsqueeze(2).repeat(1, 1, len(layers), 1)  # (1, T, K, V)
        return aux, final, (cache if use_cache else None)

    def logits(self, final):
        return final


class StubDrafter(nn.Module):
    """Drafter whose logits are `fn(visible ids) -> (V,)`; drafter position t sees ids x[1..t+1] (draft-extend)."""

    def __init__(self, fn, vocab_size: int, aux_layers=(0,)):
        super().__init__()
        self.fn = fn
        self.config = SimpleNamespace(aux_layers=list(aux_layers), vocab_size=vocab_size, draft_vocab_size=vocab_size,
                                      num_aux=fc_slots(aux_layers))
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long))

    def project(self, aux):
        return aux.flatten(2)[..., :1]  # (1, T, 1): unused by this stub

    def forward(self, input_ids, hidden, position_ids, cache=None, attn_mask=None):
        T = input_ids.shape[1]
        kv = input_ids.to(torch.float32).view(1, 1, T, 1)
        past = len(cache)
        k, _ = cache.append(kv, kv)
        ctxs = _contexts(k.view(-1).long().tolist(), past, T, attn_mask)
        assert position_ids[0].tolist() == [len(c) - 1 for c in ctxs], "drafter positions disagree with its context"
        return torch.stack([torch.as_tensor(self.fn(c), dtype=torch.float32) for c in ctxs])[None]  # (1, T, V)

    def compute_logits(self, h):
        return h


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled."""
    stat, dof, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for cell, p in probs.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat, dof = stat + (o - e) ** 2 / e, dof + 1
    if pool_e > 0:
        stat, dof = stat + (pool_o - pool_e) ** 2 / pool_e, dof + 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
