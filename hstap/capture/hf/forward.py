"""The embedded engine's batched forward: many samples through the target at once, their real rows out.

Capture is plain batched prefill. Samples are sorted by length and packed so that B * max_len <= batch_tokens,
right-padded, and run with causal attention and no mask: causality already keeps every real token from seeing the
padding after it, so the real rows equal those of the sample run alone (tests/capture/test_hf.py checks it against
`output_hidden_states`). Hooks (`Target.capture`) keep only the K tapped layers instead of all N+1 hidden states;
padding rows are dropped on the device before anything is copied (`demux`), so nothing padded is ever stored.

    from hstap.capture.hf.forward import capture_batch
    from hstap.artifacts.model_dir import load_target
    target, tok = load_target("models/Llama-3.1-8B-Instruct", device="cuda", dtype="bf16")
    [(aux, final)] = capture_batch(target, [ids], layers=[1, 15, 28])  # (T, K, H), (T, H)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hstap.batching import pack_by_tokens
from hstap.common import HstapError
from hstap.models.target import Target


def right_pad(seqs: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad with 0 -> (input_ids (B, T), rows (S,) flat indices b*T+t of the real tokens, or None when every
    sample has T tokens), both on `device`."""
    lens = [int(s.shape[0]) for s in seqs]
    B, T = len(seqs), max(lens)
    ids = torch.zeros(B, T, dtype=torch.long)  # (B, T); the pad id is irrelevant: causal attention hides it
    for b, s in enumerate(seqs):
        ids[b, : lens[b]] = s
    rows = None
    if sum(lens) < B * T:
        rows = torch.cat([torch.arange(L, dtype=torch.long) + b * T for b, L in enumerate(lens)])  # (S,)
    if device.type == "cuda":  # pinned + non_blocking: the host does not wait for the GPU to drain before each batch
        ids = ids.pin_memory().to(device, non_blocking=True)
        rows = rows.pin_memory().to(device, non_blocking=True) if rows is not None else None
    return ids, rows


def demux(aux: torch.Tensor, final: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, K, H), (B, T, H) -> the real rows, sample after sample: (S, K, H), (S, H). Padding rows are dropped on
    the device before anything is copied; a batch without padding (rows None) is only reshaped (no copy)."""
    B, T, K, H = aux.shape
    aux, final = aux.reshape(B * T, K, H), final.reshape(B * T, H)
    if rows is None:
        return aux, final
    return aux.index_select(0, rows), final.index_select(0, rows)


def forward_packed(target: Target, seqs: Sequence[torch.Tensor | Sequence[int]], layers: list[int]):
    """One right-padded batch -> (aux (S, K, H), final (S, H), lengths) with S = sum(lengths): real rows only, sample
    after sample, in the target's dtype and on its device."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if any(s.shape[0] == 0 for s in seqs):
        raise HstapError("capture: a sample has no tokens")
    ids, rows = right_pad(seqs, target.device)
    aux, final, _ = target.capture(ids, layers)  # (B, T, K, H), (B, T, H)
    aux, final = demux(aux, final, rows)  # (S, K, H), (S, H)
    return aux, final, [int(s.shape[0]) for s in seqs]


@torch.no_grad()
def capture_batch(target: Target, samples: Sequence[torch.Tensor | Sequence[int]], layers: list[int],
                  batch_tokens: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synchronous capture for online training: per sample (aux (T, K, H), final (T, H)) on the target's device and
    dtype, in input order. With batch_tokens, the samples are split into length-sorted batches like offline capture."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in samples]
    groups = pack_by_tokens([s.shape[0] for s in seqs], batch_tokens) if batch_tokens else [list(range(len(seqs)))]
    out: list = [None] * len(seqs)
    for g in groups:
        if not g:
            continue
        aux, final, lens = forward_packed(target, [seqs[i] for i in g], layers)  # (S, K, H), (S, H)
        for i, a, f in zip(g, aux.split(lens), final.split(lens)):
            out[i] = (a, f)  # (T, K, H), (T, H) views of the packed batch
    return out

