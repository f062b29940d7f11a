"""The training data of `hstap train`: where the samples come from, which aux layers feed fc, the train/eval split, and
each batch's way to the model's inputs (the inputs themselves, the vocab map included, are resolved once by
`hstap.train.inputs`).

Sources: a store (offline: its aux and final states), or a prepared set + the live target in-process (online: the same
Target.capture as hstap capture). Splits: by a hash of the sample id (stable across stores, ranks and resumes), or a
separate eval store. `Feed` turns a CPU batch into device tensors, fc inputs, the target distributions and the counted
positions of every TTT step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hstap.batching import Rows, eval_batches
from hstap.common import HstapError, sha256_bytes
from hstap.models.target import Target
from hstap.train.config import TrainInputs
from hstap.artifacts.vocab_map import VocabMap
from hstap.train.ttt import plan_rows, target_distribution


@dataclass
class TrainData:
    layers: list[int]
    """The drafter's aux_layers ([] = the final state alone)."""
    sel: list[int] | None
    """Indices of those layers into the store's aux (None = feed `final`; online: [])."""
    d2t: torch.Tensor
    """(Vd,) draft id -> target id offset."""
    t2d: torch.Tensor
    """(V,) bool: target id is in the draft vocabulary."""
    meta: dict
    """Checkpoint metadata: where the states come from, the vocab map's hash and its source."""
    target: Target | None
    """The live target (online), else None."""
    train_rows: Rows
    """The training split."""
    train_lengths: list[int]
    """Its sample lengths."""
    eval_rows: Rows
    """The eval split."""
    eval_batches: list[tuple[list[int], bool]]
    """This rank's eval batches (`hstap.batching.eval_batches`)."""


def is_eval(sample_id: str, frac: float) -> bool:
    """Whether a sample belongs to the eval split: a hash of its id, so stable across stores, ranks and resumes."""
    return frac > 0 and int(sha256_bytes(sample_id)[:8], 16) / 2 ** 32 < frac


def held_back(sample_id: str, frac: float) -> bool:
    """Whether `hstap train --follow --holdout-frac frac` never trains on this sample: the same hash split as
    --eval-frac (`is_eval`), so that a gate can score drafters on the held-back part of recent traffic."""
    return is_eval(sample_id, frac)


def select_layers(spec: str, available: list[int] | None, num_layers: int) -> tuple[list[int], list[int] | None]:
    """--aux-layers -> (drafter aux_layers ([] = final state), indices into the store's aux (None = use `final`)).

    available: the store's layers, None online."""
    from hstap.layers import default_aux_layers, parse_layers
    spec = spec.strip()
    if spec == "final":
        return [], None
    if available is None:  # online
        return (default_aux_layers(num_layers) if not spec else parse_layers(spec, num_layers, "--aux-layers")), []
    if not spec:
        return list(available), list(range(len(available)))
    want = parse_layers(spec, num_layers, "--aux-layers")
    missing = [i for i in want if i not in available]
    if missing:
        raise HstapError(f"train: --aux-layers: {missing} not captured in the store (it has {available})")
    return want, [available.index(i) for i in want]


def auto_ce_chunk(target_vocab: int) -> int:
    """--ce-chunk 0: 16,384 rows when their target logits are at most 2^28 values, else 4,096 (Devices.ce_chunk)."""
    return 16384 if 16384 * target_vocab <= 1 << 28 else 4096


def source_layers(inputs: TrainInputs, hf_cfg, store) -> tuple[list[int], list[int] | None]:
    """(the drafter's aux_layers, indices into the store's aux) for --aux-layers, after the store's cheap checks
    against the target (hidden size); `store` None: online."""
    if store is not None and store.hidden_size != int(hf_cfg.hidden_size):
        raise HstapError(f"{inputs.store}: hidden_size {store.hidden_size} != the target's {hf_cfg.hidden_size}")
    return select_layers(inputs.aux_layers, store.layers if store is not None else None,
                         int(hf_cfg.num_hidden_layers))


def build_data(inputs: TrainInputs, target_dir: str, eval_tokens: int, follow: bool, store, layers: list[int],
               sel: list[int] | None, vocab: VocabMap, rank: int, world: int, dev: torch.device,
               bf16: bool) -> TrainData:
    """The sources (the opened store, or the prepared set and the live target with --online), provenance and splits,
    from the resolved layers and vocab map (`hstap.train.inputs.resolve`). eval_tokens: tokens per eval batch
    (--batch-tokens); follow: a followed store (its training split may still be empty)."""
    target = None
    if inputs.online:
        from hstap.data.prepare import load_prepared
        from hstap.artifacts.model_dir import load_target, target_fingerprint
        src = load_prepared(inputs.data)
        ids_all, lengths_all = list(src["id"]), [len(x) for x in src["input_ids"]]
        target, _ = load_target(target_dir, device=dev, dtype="bf16" if bf16 else "fp32")
        prov = {"target": target_fingerprint(target_dir), "layers": layers, "engine": {"name": "hf-online"}}
    else:
        src = store
        ids_all, lengths_all = list(store.ids), list(store.lengths)
        prov = {**store.header, "layers": layers, "captured_layers": store.layers, "path": str(store.path)}
    meta = {"store": prov, "vocab_map_sha256": vocab.sha256(), "vocab_map_source": vocab.source,
            "embedding": {"from": "target", "path": target_dir}}  # kept out of checkpoints (artifacts/drafter_dir.py)

    if inputs.eval_store:
        from hstap.store.reader import open_store
        esrc = open_store(inputs.eval_store)
        if esrc.layers != store.layers or esrc.hidden_size != store.hidden_size:
            raise HstapError(f"{inputs.eval_store}: layers/hidden_size differ from {inputs.store}")
        tr, ev, e_len = list(range(len(ids_all))), list(range(len(esrc))), list(esrc.lengths)
    else:
        esrc = src
        tr = [i for i, s in enumerate(ids_all) if not is_eval(s, inputs.eval_frac)]
        ev = [i for i, s in enumerate(ids_all) if is_eval(s, inputs.eval_frac)]
        e_len = [lengths_all[i] for i in ev]
    if not tr and not follow:  # before RUN is written (a followed store fills as it trains)
        src_path = inputs.data if inputs.online else inputs.store
        raise HstapError(f"train: the training split is empty: {len(ids_all)} sample(s) in {src_path}"
                         + (f", all held out by --eval-frac {inputs.eval_frac}" if ids_all else ""))
    return TrainData(layers=layers, sel=sel, d2t=vocab.d2t, t2d=vocab.t2d, meta=meta, target=target,
                     train_rows=Rows(src, tr, prepared=inputs.online), train_lengths=[lengths_all[i] for i in tr],
                     eval_rows=Rows(esrc, ev, prepared=inputs.online),
                     eval_batches=eval_batches(e_len, eval_tokens, rank, world))


class Feed:
    """A CPU batch -> its model inputs on the device, with the target's distributions: `__call__` returns (ids (B, T),
    fc inputs (B, T, K, Ht), target distributions (`hstap.train.ttt.target_distribution`), counted positions per TTT step,
    lengths (B,) on the CPU)."""

    def __init__(self, data: TrainData, head: torch.Tensor, dev: torch.device, cd: torch.dtype, ce_chunk: int,
                 ttt: int, pad_to: int = 1):
        """head (V, H): the target's lm_head; cd: the compute dtype (of the head matmul and of the distributions);
        pad_to: right-pad T to a multiple of this (CUDA: fewer distinct shapes, so fewer TTT masks and recompiles;
        right padding changes no counted position, `hstap.train.ttt`)."""
        self.target, self.layers, self.sel = data.target, data.layers, data.sel
        self.dev, self.cd, self.ce_chunk, self.ttt, self.pad_to = dev, cd, ce_chunk, ttt, pad_to
        self.head_w = head.to(dev, cd)  # (V, H)
        self.hot = (torch.arange(data.d2t.numel()) + data.d2t).to(dev)  # (Vd,)
        self.t2d = data.t2d.to(dev)  # (V,)

    def __call__(self, b: dict) -> tuple:
        dev, sel = self.dev, self.sel
        ids = b["input_ids"].to(dev, non_blocking=True)  # (B, T)
        lm, lengths = b["loss_mask"].to(dev, non_blocking=True), b["lengths"].to(dev, non_blocking=True)
        extra = -ids.shape[1] % self.pad_to
        if extra:
            ids, lm = F.pad(ids, (0, extra)), F.pad(lm, (0, extra))  # (B, T + extra)
        if self.target is not None:
            # right padding needs no mask
            aux, final, _ = self.target.capture(ids, self.layers)  # (B, T, K, H), (B, T, H)
        else:
            aux, final = b["aux"].to(dev, non_blocking=True), b["final"].to(dev, non_blocking=True)
            aux = aux if sel is None or sel == list(range(aux.shape[2])) else aux[:, :, sel]
            if extra:
                aux, final = F.pad(aux, (0, 0, 0, 0, 0, extra)), F.pad(final, (0, 0, 0, extra))  # (B, T + extra, .)
        tb = target_distribution(final, lm, lengths, self.head_w, self.hot, self.t2d, self.ce_chunk, self.cd)
        counted = plan_rows(tb, ids.shape[1], self.ttt)  # every step's rows now: no host sync in the forward
        return ids, (final.unsqueeze(2) if sel is None else aux), tb, counted, b["lengths"]
