"""The gate of `hstap serve-loop`'s drafter updates: a candidate drafter is loaded into the server only when it drafts
better than the drafter being served on the same held-back recent traffic, and each load is then checked against what
the server itself reports.

- Held back: the trainer (`hstap train --follow --holdout-frac F`) never trains on a sample whose id falls in the hash
  split F (`hstap.train.data.is_eval`, the split --eval-frac uses). `HeldBack` copies the newest such samples of the
  tapped store into memory as their shards are committed (the trainer deletes shards it consumed, so they are read
  at once and kept here, at most --gate-samples of them, the oldest dropped first). Neither the served drafter nor
  any candidate has trained on them.
- Score: `score_drafter` is the training run's own evaluation (`hstap.train.ttt.TTTModel` with evaluate=True, then
  `replay_chain`): chain decoding with --k drafts replayed on the target's own states and outputs, as tokens per
  target forward (sim tau, the bonus token included; what `hstap train` reports as sim_tau). The candidate is loaded
  when its sim tau is strictly higher than the served drafter's on the same samples, and at least
  --gate-min-samples are held back; otherwise it is refused and serving goes on unchanged.
- Check: `reload_check` compares vLLM's own per-request acceptance of the answers that started after a load with
  that of the answers just before it. A load that left the server drafting from other weights than the gate scored
  (old weights, empty or zeroed ones: vLLM#52479 reports a reload after a sleep/wake cycle that silently kept
  nothing) shows up there as acceptance falling below --rollback-ratio of the one before; the updater then loads
  the previous drafter back (a rollback) and never offers that checkpoint again.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hstap.common import HstapError


class HeldBack:
    """The newest `keep` held-back samples of a store that grows and shrinks (see the module docstring)."""

    def __init__(self, store: Path, frac: float, keep: int):
        self.store, self.frac, self.keep = store, frac, keep
        self.samples: list[dict] = []  # oldest first; tensors copied out of their shards
        self.seen: set[str] = set()  # shard files already scanned (each is committed once, never rewritten)
        self.missed = 0  # held-back samples whose shard was consumed before it could be read

    def refresh(self) -> None:
        """Copy the held-back samples of shards committed since the last call."""
        from hstap.store.manifest import load_manifest, load_parts, union_entries
        from hstap.store.reader import Store
        from hstap.train.data import is_eval

        if self.frac <= 0 or not (self.store / "manifest.json").is_file():
            return
        try:
            manifest = load_manifest(self.store)
            entries = union_entries(manifest, load_parts(self.store))[0]
        except (HstapError, OSError, ValueError):
            return  # a part being replaced while read: the next call sees it
        header = {k: v for k, v in manifest.items() if k != "shards"}
        for e in sorted((e for e in entries if e["file"] not in self.seen), key=lambda e: (e["rank"], e["seq"])):
            self.seen.add(e["file"])
            want = [j for j, sid in enumerate(e["ids"]) if is_eval(sid, self.frac)]
            if not want:
                continue
            try:
                view = Store(self.store, header | {"shards": []}, [e], [])
                got = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in view[j].items() if k != "side"}
                       for j in want]  # side branches: never scored (the gate judges drafting on the accepted text)
            except HstapError:  # consumed (deleted) by the trainer before it was read
                self.missed += len(want)
                continue
            self.samples = (self.samples + got)[-self.keep:]

    def ids(self) -> list[str]:
        return [s["id"] for s in self.samples]


def score_drafter(drafter_dir: Path, samples: list[dict], layers: list[int], embed: torch.Tensor,
                  head: torch.Tensor, k: int, batch_tokens: int = 4096) -> dict:
    """{"sim_tau", "samples", "positions"} of the hstap drafter in `drafter_dir` on `samples` (store samples whose aux
    states are of the store's `layers`): chain decoding of `k` drafts replayed on them, CPU fp32 (module docstring).
    `embed`, `head` (V, H): the target's embedding (kept out of checkpoints) and lm_head."""
    from hstap.artifacts.drafter_dir import load_drafter
    from hstap.batching import collate, pack_by_tokens
    from hstap.train.data import Feed, TrainData, auto_ce_chunk
    from hstap.train.ttt import TTTModel, replay_chain

    drafter, _ = load_drafter(drafter_dir, embed=embed)
    aux = list(drafter.config.aux_layers)
    if any(a not in layers for a in aux):
        raise HstapError(f"{drafter_dir}: drafts from layers {aux}, the store holds {layers}")
    sel = [layers.index(a) for a in aux]
    ce_chunk = auto_ce_chunk(head.shape[0])
    data = TrainData(layers=aux, sel=sel, d2t=drafter.d2t.cpu(), t2d=drafter.t2d.cpu(), meta={}, target=None,
                     train_rows=None, train_lengths=[], eval_rows=None, eval_batches=[])
    feed = Feed(data, head.float(), torch.device("cpu"), torch.float32, ce_chunk, k)
    model = TTTModel(drafter, ttt=k, attn="sdpa", ce_chunk=ce_chunk)
    tokens = rounds = positions = 0
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    with torch.no_grad():
        for idx in pack_by_tokens(lengths, batch_tokens):
            b = collate([{**samples[i], "aux": samples[i]["aux"].float(), "final": samples[i]["final"].float()}
                         for i in idx])
            ids, feats, tb, _, _ = feed(b)
            _, sim, runs = model(ids, feats, tb, evaluate=True)
            t, r = replay_chain(runs, b["loss_mask"], b["lengths"], k)
            tokens, rounds, positions = tokens + int(t[-1]), rounds + int(r[-1]), positions + int(sim[0])
    return {"sim_tau": tokens / rounds if rounds else 0.0, "samples": len(samples), "positions": positions}


def reload_check(before: list[dict], after: list[dict], ratio: float) -> dict:
    """Whether the server drafts with what was loaded: vLLM's acceptance over `after` (answers that started after the
    load) against `before` (the answers just before it); ok unless it fell below `ratio` of it, or the server
    proposed no draft token at all after the load."""
    from hstap.serve_loop.requests import acceptance

    a, b = acceptance(after)[0], acceptance(before)[0]
    drafted = sum(r.get("num_draft_tokens", 0) for r in after)
    ok = drafted > 0 and a >= ratio * b
    return {"answers": len(after), "acceptance": a, "before": b, "before_answers": len(before),
            "drafted": drafted, "ok": ok}
