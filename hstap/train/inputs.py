"""What a training run needs, resolved once, in one place, before anything is written or trained.

`resolve` goes through the inputs of `hstap train` in one order, each read once: the run directory (a trained run is
never overwritten; with --resume, its newest complete checkpoint and that checkpoint's trainer state, checked against
this run's settings), the target (its HF config, embedding and lm_head; a --data prepared set must be tokenized by its
tokenizer, `hstap.data.fits`), the source of the states (the store opened
once: every shard present at its recorded size, and at least one sample; or the live target with --online; with
--follow, the store claimed and waited for once the vocabulary is fixed), the aux layers, the draft vocabulary
(`resolve_vocab`: an explicit map, the prepared set's, the store's copy of it, or the store's token counts; a
--resume's must be the one its checkpoint was trained with, `checkpoint.check_vocab_map`), the pre-flight recompute
against the target (`preflight`), the samples' split (a training split that is not empty), and last, the costliest, every
shard hashed against its recorded checksum (`check_checksums`; --follow: each shard at the first slot that reads it,
`hstap.train.follow`). The cheap checks come first. What it returns (`RunInputs`) is all that `hstap.train.stage`
builds the drafter, the trainer and the batches from; RUN is written only after all of it, and after a --resume's
checkpoint is loaded into them.

The config is never changed: what `resolve` decides (ce chunk, draft vocabulary map, layers, resume point) is the run's
`hstap.train.plan.TrainPlan`, recorded as RUN/plan.json beside RUN/config.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hstap import dist as D
from hstap.common import HstapError
from hstap.artifacts.model_dir import load_config, target_head
from hstap.train import checkpoint
from hstap.config import flag_values
from hstap.train.config import TrainConfig, TrainInputs
from hstap.train.data import TrainData, auto_ce_chunk, build_data, source_layers
from hstap.artifacts.vocab_map import VocabMap
from hstap.train.plan import TrainPlan


@dataclass
class RunInputs:
    """Everything a run is built from (module docstring)."""

    plan: TrainPlan
    """What the run resolved (ce chunk, vocab map, layers, resume point, ...)."""
    hf_cfg: object
    """The target's HF config (shapes the drafter)."""
    embed: torch.Tensor
    """(V, H) the target's input embedding (copied into the drafter, frozen)."""
    head: torch.Tensor
    """(V, H) the target's lm_head (the target distributions; the drafter lm_head's init)."""
    data: TrainData
    """Sources, aux layers, vocab map, split."""
    state: dict
    """That checkpoint's trainer_state.json ({} for a fresh run)."""
    run_config: dict
    """trainer_state.json's "config" of this run: {"world_size": world, **the TrainConfig's flags}
    (`hstap.config.flag_values`: flat, every section's fields by their own names)."""
    release: Callable[[], None]
    """Undoes --consume's claim of the followed store (`hstap.store.consumer.claim_store`; a no-op without one): for a
    run refused before RUN is written, which leaves the store as it found it."""


def resolve(cfg: TrainConfig, rank: int, world: int, dev: torch.device, bf16: bool) -> RunInputs:
    """The run's inputs (module docstring), in the order they are checked; raises HstapError on the first bad one."""
    run = Path(cfg.out)
    done = checkpoint.complete(run)
    if done and not cfg.resume:  # no silent overwrite of a trained run
        raise HstapError(f"{run}: has checkpoints already; pass --resume to continue or choose another --out")
    ckpt = done[-1] if cfg.resume and done else None
    run_config = {"world_size": world, **flag_values(cfg)}
    # a resume against its checkpoint first, before anything (of RUN, of the followed store) is written
    state = checkpoint.read_state(ckpt, run_config) if ckpt else {}
    if ckpt and cfg.follow:
        from hstap.train.follow import check_resume, stream_settings
        check_resume(run, state, stream_settings(cfg.stream, cfg.hyper.epochs, cfg.consume))
    elif ckpt and "follow" in state:
        raise HstapError(f"{ckpt}/trainer_state.json: a --follow run; resume it with --follow")
    hf_cfg, inp = load_config(cfg.target), cfg.inputs
    if inp.data:  # --online's samples, or the vocab map's source: tokenized as the target tokenizes
        from hstap.data.fits import check_tokenizer
        from hstap.data.prepare import read_meta
        from hstap.artifacts.model_dir import target_fingerprint
        check_tokenizer(inp.data, read_meta(inp.data), target_fingerprint(cfg.target))
    V = int(hf_cfg.vocab_size)
    vocab, release = None, (lambda: None)
    if cfg.follow:  # the vocabulary is fixed before the store is claimed and waited for: it is not complete yet
        vocab = resolve_vocab(inp, None, V)
        from hstap.train.follow import open_followed_store
        release = open_followed_store(inp.store, cfg.stream.keep_shards, cfg.consume, cfg.resume, run, rank)
    try:
        plan, data, embed, head = _sources(cfg, rank, world, dev, bf16, hf_cfg, vocab, ckpt, state)
    except BaseException:
        release()  # a refused run leaves no active claim on the store
        raise
    return RunInputs(plan, hf_cfg, embed, head, data, state, run_config, release)


def _sources(cfg: TrainConfig, rank: int, world: int, dev: torch.device, bf16: bool, hf_cfg, vocab, ckpt, state):
    """`resolve`'s checks of the store (opened once), the layers, the vocabulary and the samples: (plan, data, embed,
    head)."""
    V, inp = int(hf_cfg.vocab_size), cfg.inputs
    store = None
    if not inp.online:
        from hstap.store.reader import open_store
        store = open_store(inp.store)
        if not cfg.follow:  # a followed store may still be empty, and its shards are checked as the stream takes them
            store.check(checksums=False)  # the cheap checks first: every shard there, at its recorded size
            if not len(store):
                raise HstapError(f"{inp.store}: the store holds no sample (nothing was captured into it); capture into "
                                 f"it first")
        elif cfg.stream.anchor_store:  # before RUN is written: a bad anchor leaves no run behind
            from hstap.train.follow import open_anchor
            open_anchor(cfg.stream.anchor_store, inp.store, store.header)
    layers, sel = source_layers(inp, hf_cfg, store)
    if vocab is None:
        vocab = resolve_vocab(inp, store, V)
    if ckpt is not None:
        checkpoint.check_vocab_map(ckpt, vocab)
    if store is not None:
        preflight(inp, cfg.target, cfg.follow, store, rank, dev)
    data = build_data(inp, cfg.target, cfg.hyper.batch_tokens, cfg.follow, store, layers, sel, vocab, rank, world, dev,
                      bf16)
    if store is not None and not cfg.follow:
        check_checksums(inp.store, [store] + ([data.eval_rows.src] if inp.eval_store else []), rank, world)
    embed, head = target_head(cfg.target)
    plan = TrainPlan(world=world, device=dev.type, bf16=bf16, ce_chunk=cfg.devices.ce_chunk or auto_ce_chunk(V),
                     vocab=vocab, layers=tuple(layers), store_indices=None if sel is None else tuple(sel), resume=ckpt,
                     resume_step=state.get("step", 0))
    return plan, data, embed, head


def _size_conflict(inputs: TrainInputs, n: int, V: int, src) -> str | None:
    """The error line when --draft-vocab asks for another size than the n-id map of src (None: no conflict)."""
    want = inputs.draft_vocab  # 0: the map's own size
    if not want or n == min(want, V):
        return None
    return (f"train: --draft-vocab {want}: the vocab map of {src} has {n} draft ids (give a map of {want} ids, or "
            f"leave --draft-vocab unset)")


def resolve_vocab(inputs: TrainInputs, store, V: int) -> VocabMap:
    """The draft vocabulary map (d2t (Vd,) long, t2d (V,) bool, where it came from): --vocab-map, else --data's, else
    the one capture copied into the store (the vocabulary chosen at prepare), else one built from the store's
    loss-masked token counts (--draft-vocab, 32000 when unset). A --draft-vocab that differs from the size of the
    prepared or stored map builds the top N from the store's counts instead (one printed line; never ignored); one that
    differs from an explicit --vocab-map's, or with no complete store to count (`store` None: --online, --follow), is an
    error."""
    from hstap.artifacts.vocab_map import build_vocab_map, load_store_vocab_map, load_vocab_map
    src = inputs.vocab_map or inputs.data
    stored = load_store_vocab_map(store.path, store.header) if not src and store is not None else None
    if src:
        d2t, t2d = load_vocab_map(src)
    elif stored is not None:
        d2t, t2d, p = stored
        src = f"{p} (the prepared set's, copied by capture)"
    else:
        d2t = None
    err = _size_conflict(inputs, d2t.numel(), V, src) if d2t is not None else None
    if err and (inputs.vocab_map or store is None):
        raise HstapError(err)
    if err:
        D.print0(f"hstap train: --draft-vocab {inputs.draft_vocab}: not the {d2t.numel()} ids of {src}: the top "
                 f"{min(inputs.draft_vocab, V)} of the store's loss-masked token counts instead")
        d2t = None
    if d2t is None:
        n = min(inputs.draft_vocab or 32000, V)
        d2t, t2d = (torch.from_numpy(a) for a in build_vocab_map(store.token_counts(V), n))
        src = f"{inputs.store} (the top {n} of its loss-masked token counts)"
    if t2d.numel() != V:
        raise HstapError(f"{src}: vocab map covers {t2d.numel()} ids, the target has {V}")
    return VocabMap(d2t.long(), t2d.bool(), str(src))


def preflight(inputs: TrainInputs, target: str, follow: bool, store, rank: int, dev: torch.device) -> None:
    """The store matches the target, on rank 0: its header's target fingerprints are the target's (unless
    --allow-other-variant), then `hstap.verify.stage.quick_check` recomputes two samples of the opened store (--follow,
    whose store may hold no sample yet: the fingerprints alone); a failure stops every rank."""
    err = None
    if rank == 0 and not inputs.skip_verify:
        from hstap.train.follow import check_store_target
        from hstap.verify.stage import quick_check
        try:
            if not inputs.allow_other_variant:
                check_store_target(inputs.store, target, require=follow)
            if not follow:
                rep = quick_check(inputs.store, target, samples=2, device=dev.type, store=store)
                if rep["loaded"]["skipped"]:  # a target too large to load whole: say what was not checked
                    D.print0(f"hstap train: pre-flight check: {next(n for n in rep['notes'] if 'loaded' in n)}")
        except HstapError as e:
            err = e
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not D.agree(err is None):
        raise err or HstapError(f"{inputs.store}: rank 0's pre-flight check failed (see its output)")


def check_checksums(store_path: str, stores: list, rank: int, world: int) -> None:
    """Every shard the run reads hashed once against its recorded checksum before the first step (`Store.check`; the
    ranks split the shards): a shuffled epoch touches every shard within its first steps, so its first read is now. A
    damaged shard on any rank stops every rank, with its file named by the rank that found it."""
    from hstap.store import reader

    err, done = None, []
    if reader.CHECK_CHECKSUMS:  # a full read of the store: say so before it starts
        gb = sum(int(e["bytes"]) for s in stores for e in s.manifest["shards"]) / 1e9
        D.print0(f"hstap train: checking the store's shards against their checksums ({gb:.3f} GB"
                 + (f", split over {world} ranks)" if world > 1 else ")"))
    try:
        done = [s.check(rank, world) for s in stores]
    except HstapError as e:
        err = e
    if not D.agree(err is None):
        raise err or HstapError(f"{store_path}: another rank found a damaged shard (see its output)")
    if done and done[0]["checksums"]:
        shards, gb, sec = sum(d["shards"] for d in done), sum(d["gb"] for d in done), sum(d["seconds"] for d in done)
        D.print0(f"hstap train: {shards} shard(s) intact: rank 0 hashed {gb:.3f} GB in {sec:.1f} s"
                 + (f" ({gb / sec:.2f} GB/s)" if sec > 0 else ""))
