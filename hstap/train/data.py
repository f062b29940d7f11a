"""The training data of `hstap train`: where the samples come from, which aux layers feed fc, the draft vocabulary, the
train/eval split, and each batch's way to the model's inputs.

Sources: a store (offline: its aux and final states), or a prepared set + the live target in-process (online: the same
Target.capture as hstap capture). Splits: by a hash of the sample id (stable across stores, ranks and resumes), or a
separate eval store. `Feed` turns a CPU batch into device tensors, fc inputs, the target distributions and the counted
positions of every TTT step.

`cfg` below is the stage's `hstap.train.stage.TrainConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hstap import dist as D
from hstap.batching import Rows, eval_batches
from hstap.common import HstapError, sha256_bytes
from hstap.models.target import Target
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


def select_layers(spec: str, available: list[int] | None, num_layers: int) -> tuple[list[int], list[int] | None]:
    """--aux-layers -> (drafter aux_layers ([] = final state), indices into the store's aux (None = use `final`)).

    available: the store's layers, None online."""
    from hstap.layers import default_aux_layers, parse_layers
    spec = spec.strip()
    if spec == "final":
        return [], None
    if available is None:  # online
        return (default_aux_layers(num_layers) if not spec else parse_layers(spec, num_layers)), []
    if not spec:
        return list(available), list(range(len(available)))
    want = parse_layers(spec, num_layers)
    missing = [i for i in want if i not in available]
    if missing:
        raise HstapError(f"train: --aux-layers: {missing} not captured in the store (it has {available})")
    return want, [available.index(i) for i in want]


def vocab_size_conflict(cfg, n: int, V: int, src) -> str | None:
    """The error line when --draft-vocab asks for another size than the n-id map of src (None: no conflict)."""
    want = cfg.draft_vocab  # 0: the map's own size
    if not want or n == min(want, V):
        return None
    return (f"train: --draft-vocab {want}: the vocab map of {src} has {n} draft ids (give a map of {want} ids, or "
            f"leave --draft-vocab unset)")


def follow_vocab_map(cfg) -> None:
    """--follow's map (--vocab-map or --data's) read and checked against --draft-vocab before the store is claimed:
    a followed store is not complete, so its counts cannot decide the vocabulary."""
    from hstap.data.vocab import load_vocab_map
    d2t, t2d = load_vocab_map(cfg.vocab_map or cfg.data)
    err = vocab_size_conflict(cfg, d2t.numel(), t2d.numel(), cfg.vocab_map or cfg.data)
    if err:
        raise HstapError(err)


def _vocab_map(cfg, store, V: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """--vocab-map, else --data's, else the one capture copied into the store (the vocabulary chosen at prepare),
    else one built from the store's loss-masked token counts (--draft-vocab, 32000 when unset). A --draft-vocab that
    differs from the size of the prepared or stored map builds the top N from the store's counts instead (one printed
    line; never ignored); one that differs from an explicit --vocab-map's, or with no complete store to count
    (--online, --follow), is an error."""
    from hstap.data.vocab import build_vocab_map, load_store_vocab_map, load_vocab_map
    src = cfg.vocab_map or cfg.data
    stored = load_store_vocab_map(store.path, store.header) if not src and store is not None else None
    if src:
        d2t, t2d = load_vocab_map(src)
    elif stored is not None:
        d2t, t2d, p = stored
        src = f"{p} (the prepared set's, copied by capture)"
    else:
        d2t = None
    err = vocab_size_conflict(cfg, d2t.numel(), V, src) if d2t is not None else None
    if err and (cfg.vocab_map or store is None or cfg.follow):
        raise HstapError(err)
    if err:
        D.print0(f"hstap train: --draft-vocab {cfg.draft_vocab}: not the {d2t.numel()} ids of {src}: the top "
                 f"{min(cfg.draft_vocab, V)} of the store's loss-masked token counts instead")
        d2t = None
    if d2t is None:
        n = min(cfg.draft_vocab or 32000, V)
        d2t, t2d = (torch.from_numpy(a) for a in build_vocab_map(store.token_counts(V), n))
        src = f"{cfg.store} (the top {n} of its loss-masked token counts)"
    if t2d.numel() != V:
        raise HstapError(f"{src}: vocab map covers {t2d.numel()} ids, the target has {V}")
    return d2t.long(), t2d.bool(), str(src)


def preflight(cfg, rank: int, dev: torch.device) -> None:
    """hstap.verify.quick_check (the store matches the target) on rank 0; its failure stops every rank."""
    err = None
    if rank == 0 and not cfg.skip_verify:
        from hstap.train.follow import check_store_target
        from hstap.verify import quick_check
        try:
            if cfg.follow:  # the store may hold no sample yet: its header's target fingerprints
                check_store_target(cfg.store, cfg.target)
            else:
                quick_check(cfg.store, cfg.target, samples=2, device=dev.type)
        except HstapError as e:
            err = e
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not D.agree(err is None):
        raise err or HstapError(f"{cfg.store}: rank 0's pre-flight check failed (see its output)")


def auto_ce_chunk(target_vocab: int) -> int:
    """--ce-chunk 0: 16,384 rows when their target logits are at most 2^28 values, else 4,096 (TrainConfig.ce_chunk)."""
    return 16384 if 16384 * target_vocab <= 1 << 28 else 4096


def build_data(cfg, hf_cfg, rank: int, world: int, dev: torch.device, bf16: bool) -> TrainData:
    """Open the sources, select the layers, load or derive the vocab map and split the samples (`hf_cfg`: the
    target's HF config)."""
    V = int(hf_cfg.vocab_size)
    target = store = None
    if cfg.online:
        from hstap.data.prepare import load_prepared
        from hstap.model_dir import load_target, target_fingerprint
        src = load_prepared(cfg.data)
        ids_all, lengths_all = list(src["id"]), [len(x) for x in src["input_ids"]]
        target, _ = load_target(cfg.target, device=dev, dtype="bf16" if bf16 else "fp32")
        layers, sel = select_layers(cfg.aux_layers, None, int(hf_cfg.num_hidden_layers))
        prov = {"target": target_fingerprint(cfg.target), "layers": layers, "engine": {"name": "hf-online"}}
    else:
        from hstap.store.reader import open_store
        src = store = open_store(cfg.store)
        ids_all, lengths_all = list(store.ids), list(store.lengths)
        if store.hidden_size != int(hf_cfg.hidden_size):
            raise HstapError(f"{cfg.store}: hidden_size {store.hidden_size} != the target's {hf_cfg.hidden_size}")
        layers, sel = select_layers(cfg.aux_layers, store.layers, int(hf_cfg.num_hidden_layers))
        prov = {**store.header, "layers": layers, "captured_layers": store.layers, "path": str(store.path)}
        preflight(cfg, rank, dev)
    d2t, t2d, vocab_src = _vocab_map(cfg, store, V)
    from hstap.export.drafter_dir import vocab_map_sha256
    meta = {"store": prov, "vocab_map_sha256": vocab_map_sha256(d2t, t2d), "vocab_map_source": vocab_src}

    if cfg.eval_store:
        from hstap.store.reader import open_store
        esrc = open_store(cfg.eval_store)
        if esrc.layers != store.layers or esrc.hidden_size != store.hidden_size:
            raise HstapError(f"{cfg.eval_store}: layers/hidden_size differ from {cfg.store}")
        tr, ev, e_len = list(range(len(ids_all))), list(range(len(esrc))), list(esrc.lengths)
    else:
        esrc = src
        tr = [i for i, s in enumerate(ids_all) if not is_eval(s, cfg.eval_frac)]
        ev = [i for i, s in enumerate(ids_all) if is_eval(s, cfg.eval_frac)]
        e_len = [lengths_all[i] for i in ev]
    return TrainData(layers=layers, sel=sel, d2t=d2t, t2d=t2d, meta=meta, target=target,
                     train_rows=Rows(src, tr, prepared=cfg.online), train_lengths=[lengths_all[i] for i in tr],
                     eval_rows=Rows(esrc, ev, prepared=cfg.online),
                     eval_batches=eval_batches(e_len, cfg.batch_tokens, rank, world))


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
