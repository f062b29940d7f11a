"""hstap verify: is a store intact, and does it hold what the target computes, at the layers it claims?

Three modes (exit status 2 with a one-line reason on failure; the per-layer table is printed first):

    hstap verify --store S                        checksums, manifest consistency, token counts, NaN/Inf (Store.verify)
    hstap verify --store S --target DIR           recompute --samples samples with the embedded HF engine and compare
    hstap verify --a S1 --b S2                    two captures of the same data (engines, dtypes, fp8 vs bf16), by id

Metrics and pass/fail tolerances (by the coarsest stored dtype and the compute dtypes involved) are `hstap/verify/parity.py`'s.

Layer-offset detection (recompute mode): one forward pass per sample keeps every decoder layer's output (hooks on all
layers, `Target.capture`), plus the embeddings and the final-norm output. Each stored layer is matched to the candidate
with the smallest relative L2 error (scale-sensitive, so a missing final norm is told apart even when the norm's weight
is all ones); a layer that fails its tolerance is reported as e.g. "stored layer 2 matches output of layer 3 (off by
+1)", and a bad final as "final matches pre-norm output of the last layer: missing final norm". `quick_check` (called by
train before training unless --skip-verify) raises with that message, so a mismatched store never trains silently.

MoE targets (DeepSeek-V3 / Kimi-K2 routers) with a bf16 computation involved: each compared sample also runs in the
other precision, and a row that breaks the tolerance at a token near a routing tie is counted as a routing flip instead
of failing (`hstap.verify.routing` has the rule); each slot's report row carries `routing` (tokens near a tie, flips,
their share), and more than `routing.MAX_FLIP_SHARE` flips fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hstap
from hstap.common import HstapError, atomic_write_json
from hstap.artifacts.outputs import check_not_input, check_out_file
from hstap.layers import EMBEDDINGS, last_layer, reference_ids, reference_index
from hstap.verify.config import VerifyConfig
from hstap.verify.parity import (NOISE_FACTOR, compute_class, finish_stats, layer_stats, merge_stats, noise_limit,
                                 row_breaks, tolerance, violations)
from hstap.verify.routing import MAX_FLIP_SHARE, near_tie, recorded, routers
from hstap.verify.twin import Twin


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _pick(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n) (first and last included): multi-rank stores get every rank sampled."""
    if k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


# ---------------------------------------------------------------------------------------------------------------------
# modes


def check_integrity(path: str) -> dict:
    from hstap.store.reader import open_store

    s = open_store(path)
    problems = s.verify()
    return {"mode": "integrity", "store": str(path), "samples": len(s), "tokens": sum(s.lengths),
            "shards": len(s.manifest["shards"]), "dtype": s.dtype, "layers": s.layers, "problems": problems,
            "ok": not problems}


def _label(j: int, n: int) -> str:
    if j == EMBEDDINGS:
        return "the embeddings (input of layer 0)"
    if j == n:
        return "the final-norm output"
    return f"output of layer {j}"


def _open_checked(store_path: str, target_dir: str, device: str, compute_dtype: str, target, store=None,
                  load_gb: float | None = None) -> tuple:
    """(store, target, the store's engine block, notes, load plan or None): the store opened and the target loaded
    unless given (whole, or the layers the check needs: `hstap.verify.partial`), and checked to be the one the store
    can come from (hidden size, layer range); a differing or missing fingerprint is only noted."""
    from hstap.artifacts.model_dir import load_config, target_fingerprint
    from hstap.store.reader import open_store
    from hstap.verify.partial import load_for_check

    s = store if store is not None else open_store(store_path)
    tok = plan = None
    if target is None:
        target, tok, plan = load_for_check(target_dir, list(s.layers), device, compute_dtype,
                                           (s.manifest.get("engine") or {}).get("compute_dtype"), load_gb)
    N, H = (plan.total if plan is not None else target.num_layers), target.hidden_size
    where = str(store_path)
    if s.hidden_size != H:
        raise HstapError(f"{where}: hidden_size {s.hidden_size} != {H} of {target_dir}: the store was captured from "
                         "another target")
    if any(not 0 <= L < N for L in s.layers):
        raise HstapError(f"{where}: layers {s.layers} do not exist in the {N}-layer target {target_dir}: another target")
    engine = s.manifest.get("engine") or {}
    notes: list[str] = []
    try:
        fp = target_fingerprint(target_dir, tokenizer=tok)  # the tokenizer read once
        st = s.manifest.get("target") or {}
        differs = [k for k in ("config_sha256", "weights_fingerprint") if st.get(k) and st.get(k) != fp.get(k)]
        if differs:
            notes.append(f"target fingerprint differs from the store's ({', '.join(differs)})")
    except HstapError as e:
        notes.append(f"no fingerprint: {e}")
    if plan is not None and not plan.whole:
        notes.append(plan.note())
    return s, target, engine, notes, plan


@dataclass
class _Sums:
    """A recomputation's running sums over the compared samples, per stored slot (K aux + final) and reference state
    (C = len(reference_ids(N)))."""

    acc: list[dict | None]
    """Per stored slot: merged `layer_stats` against the state it claims to be."""
    err: torch.Tensor
    """(K+1, C) summed squared error per (stored slot, reference state)."""
    ref2: torch.Tensor
    """(K+1, C) summed squared norm of the reference state."""
    cosmin: torch.Tensor
    """(K+1, C) smallest per-token cosine."""
    votes: list[list[int]] = field(default_factory=list)
    """Per compared sample: best reference index of each stored slot."""
    tokens: int = 0
    """Tokens compared."""
    flips: list[int] | None = None
    """MoE targets with a bf16 computation involved: per stored slot, rows excused as routing flips (near a routing
    tie and breaking the tolerance: `hstap.verify.routing`); None when routing is not checked."""
    near: list[int] | None = None
    """Per stored slot: tokens near a routing tie at some MoE layer up to the slot's."""
    noise: torch.Tensor | None = None
    """(K+1, 2) with a twin: per stored slot, the summed squared distance of the twin's state from the recomputation's
    and the recomputation's squared norm, over the rows not near a routing tie (the bf16 noise floor's parts)."""


def _accumulate(s, target, picked: list[int], claimed: list[int], max_tokens: int, problems: list[str], tol: dict,
                twin=None, cols: list[int] | None = None) -> _Sums:
    """One forward per picked sample keeping every reference state; each stored slot compared with all of them.
    `twin` (a `hstap.verify.twin.Twin`): the noise floor is summed, and on a MoE target the rows near a routing tie that
    break `tol` are left out of the slot's metrics and counted instead. `cols`: the stored aux columns compared, and
    no final (a target loaded in part); None: every aux column and the final."""
    N, C = target.num_layers, len(reference_ids(target.num_layers))
    slots = len(claimed)
    sums = _Sums(acc=[None] * slots, err=torch.zeros(slots, C, dtype=torch.float64),
                 ref2=torch.zeros(slots, C, dtype=torch.float64), cosmin=torch.ones(slots, C, dtype=torch.float64))
    gates = routers(target) if twin is not None else {}
    if twin is not None:
        sums.noise = torch.zeros(slots, 2, dtype=torch.float64)
        if gates:
            sums.flips, sums.near = [0] * slots, [0] * slots
    for i in picked:
        smp = s[i]
        T = min(int(smp["input_ids"].shape[0]), max_tokens)
        ids = smp["input_ids"][:T].to(target.device)[None]  # (1, T)
        stored = (torch.cat([smp["aux"][:T], smp["final"][:T, None]], dim=1) if cols is None
                  else smp["aux"][:T, cols]).to(target.device).float()  # (T, K+1, H), or (T, K', H) in part
        if not _finite(stored):
            problems.append(f"sample {smp['id']!r}: stored hidden states hold NaN/Inf")
            continue
        with recorded(gates) as got:
            aux_all, final, _ = target.capture(ids, list(range(N)))  # (1, T, N, H), (1, T, H)
        emb = target.embed_tokens(ids)  # (1, T, H)
        # (T, C, H) in reference_ids order: embeddings, every layer's output, the final-norm output
        refs = torch.cat([emb[0, :, None], aux_all[0], final[0, :, None]], dim=1).float()
        if not _finite(refs):
            problems.append(f"sample {smp['id']!r}: the recomputation itself produced NaN/Inf "
                            f"(compute dtype {target.dtype})")
            continue
        sums.tokens += T
        rr = refs.pow(2).sum(-1)  # (T, C) squared norms of every candidate
        dots = torch.einsum("tkh,tch->tkc", stored, refs)  # (T, K+1, C): one batched matmul for all pairs
        xx = stored.pow(2).sum(-1)  # (T, K+1)
        # |x - r|^2 = |x|^2 - 2 x.r + |r|^2: cancels to ~1e-7 |x|^2 for an exact match, far below any mismatch (>1e-2)
        e = (xx[:, :, None] - 2 * dots + rr[:, None]).clamp_min(0).sum(0).double().cpu()  # (K+1, C)
        sums.err += e
        sums.ref2 += rr.sum(0).double().cpu()[None]
        rel = e / rr.sum(0).double().cpu()[None].clamp_min(1e-300)  # (K+1, C)
        sums.votes.append(rel.argmin(1).tolist())  # this sample's best
        cos = dots / (xx.sqrt()[:, :, None] * rr.sqrt()[:, None]).clamp_min(1e-30)  # (T, K+1, C)
        sums.cosmin = torch.minimum(sums.cosmin, cos.amin(0).double().cpu())
        near = twin_refs = None
        if twin is not None:
            twin_refs, twin_got = twin.states(ids)  # (T, C, H)
            twin_refs = twin_refs.to(refs.device)
            if gates:
                near = near_tie(gates, got, twin.gates, twin_got, claimed).to(stored.device)  # (T, K+1)
        for k in range(slots):
            x, r = stored[:, k], refs[:, reference_index(claimed[k])]  # (T, H), (T, H)
            if twin_refs is not None:
                calm = ~near[:, k] if near is not None else torch.ones(T, dtype=torch.bool, device=r.device)  # (T,)
                tw = twin_refs[:, reference_index(claimed[k])]  # (T, H)
                sums.noise[k, 0] += float((tw - r)[calm].double().pow(2).sum())
                sums.noise[k, 1] += float(r[calm].double().pow(2).sum())
            if near is not None:
                excused = near[:, k] & row_breaks(x, r, tol)  # (T,)
                sums.near[k] += int(near[:, k].sum())
                sums.flips[k] += int(excused.sum())
                x, r = x[~excused], r[~excused]
            if x.shape[0]:
                sums.acc[k] = merge_stats(sums.acc[k], layer_stats(x, r, ulps=s.dtype != "fp8"))
    return sums


def _verdicts(sums: _Sums, claimed: list[int], N: int, tol: dict, problems: list[str], dtype: str,
              whole: bool = True) -> list[dict]:
    """Per stored slot: its metrics, the reference state it matches best, and what is wrong (appended to problems).
    `whole`: the target was loaded whole (else its last reference state is no final-norm output and is left out)."""
    cand = reference_ids(N)
    K = len(claimed) - 1 if whole else len(claimed)  # the final's slot index (none in part)
    rel_l2 = (sums.err / sums.ref2.clamp_min(1e-300)).sqrt()  # (K+1, C)
    if not whole:
        rel_l2[:, -1] = float("inf")
    layers = []
    for k in range(len(claimed)):
        if sums.acc[k] is None:  # every row excused: no metric left, only the flip count below
            sums.acc[k] = {"cos_min": float("nan"), "cos_sum": 0.0, "tokens": 0, "rel_max": float("inf"),
                           "l2_err": float("inf"), "l2_ref": 1.0}
        m = finish_stats(sums.acc[k])
        name = "final" if k == K else f"layer {claimed[k]}"
        best = int(rel_l2[k].argmin())
        bj = cand[best]
        row = {"name": name, "layer": None if k == K else claimed[k], **m, "best_match": _label(bj, N),
               "best_rel_l2": float(rel_l2[k, best]), "best_cos_min": float(sums.cosmin[k, best]),
               "best_per_sample": [_label(cand[v[k]], N) for v in sums.votes]}
        bad = violations(m, tol)
        if sums.noise is not None and float(sums.noise[k, 1]) > 0:
            floor = math.sqrt(float(sums.noise[k, 0]) / float(sums.noise[k, 1]))
            row["noise_floor"], row["noise_limit"] = floor, noise_limit(floor, dtype)
            if not m["rel_l2"] <= row["noise_limit"]:
                bad.append(f"relative L2 error {m['rel_l2']:.3g} > {row['noise_limit']:.3g} ({NOISE_FACTOR:g} x the "
                           f"bf16 noise floor {floor:.3g} measured in both precisions, with {dtype} storage)")
        if sums.flips is not None:
            row["routing"] = {"tokens_near_tie": sums.near[k], "flips": sums.flips[k],
                              "flip_share": sums.flips[k] / max(sums.tokens, 1)}
            if sums.flips[k] > MAX_FLIP_SHARE * sums.tokens:
                bad.append(f"{sums.flips[k]} of {sums.tokens} rows differ at a routing tie "
                           f"({sums.flips[k] / sums.tokens:.1%} > {MAX_FLIP_SHARE:.0%}: more than routing flips)")
        if bj != claimed[k] and float(rel_l2[k, best]) < 0.5 * m["rel_l2"]:
            bad.append(f"{_label(bj, N)} matches better (relative L2 error {float(rel_l2[k, best]):.3g} "
                       f"vs {m['rel_l2']:.3g})")
        row["ok"] = not bad
        if bad:
            best_ok = bj != claimed[k] and float(sums.cosmin[k, best]) >= tol["cos_min"]
            if bj == claimed[k] and "noise_limit" in row and m["rel_l2"] > row["noise_limit"]:
                msg = (f"{name}: the target's state as another variant of the model computes it: relative L2 error "
                       f"{m['rel_l2']:.3g} = {m['rel_l2'] / row['noise_floor']:.1f}x the bf16 noise floor (limit "
                       f"{row['noise_limit'] / row['noise_floor']:.1f}x): another quantization or the full-precision "
                       "original of the target, or arithmetic its engines do not do")
            elif k == K:
                if best_ok and bj == last_layer(N):
                    msg = "final matches pre-norm output of the last layer: missing final norm"
                elif best_ok:
                    msg = f"final matches {_label(bj, N)}, not the final-norm output"
                else:
                    msg = f"final matches no target state ({'; '.join(bad)}; closest: {_label(bj, N)})"
            elif best_ok:
                row["offset"] = bj - claimed[k]
                msg = f"stored layer {claimed[k]} matches {_label(bj, N)}" + (
                    f" (off by {bj - claimed[k]:+d})" if 0 <= bj < N else "")
            else:
                msg = (f"stored layer {claimed[k]} matches no target layer ({'; '.join(bad)}; closest: {_label(bj, N)}): "
                       "a different target, different inputs or corrupt data")
            row["problem"] = msg
            problems.append(msg)
        layers.append(row)
    return layers


@torch.no_grad()
def recompute(store_path: str, target_dir: str, samples: int = 4, device: str = "cpu", compute_dtype: str = "auto",
              max_tokens: int = 1024, target=None, store=None, load_gb: float | None = None) -> dict:
    """Recompute `samples` samples of the store with the target; per-layer metrics, offsets and problems (see above).

    `target`: an already loaded hstap Target (its device/dtype are used) to skip loading; `store`: the store at
    `store_path` already opened (`hstap.store.reader.open_store`); `load_gb`: the memory budget of a target too large
    to load whole (`hstap.verify.partial`; default half the device's free memory)."""
    s, target, engine, notes, plan = _open_checked(store_path, target_dir, device, compute_dtype, target, store, load_gb)
    N = target.num_layers
    whole = plan is None or plan.whole
    compute = compute_class(engine.get("compute_dtype"), str(target.dtype))
    tol_name, tol = tolerance([s.dtype], compute)
    cols = None if whole else [i for i, L in enumerate(s.layers) if L < N]
    # stored aux slots, then `final` (the final-norm output, id N in reference_ids) when the target is loaded whole
    claimed = list(s.layers) + [N] if whole else [s.layers[i] for i in cols]
    problems: list[str] = []
    picked = _pick(len(s), samples)
    twin = None
    if compute == "bf16" and (plan is None or plan.twin):
        from hstap.artifacts.quantization import quantization_of
        from hstap.verify.twin import served_activations

        quant = quantization_of(target_dir)
        twin = Twin(target, served_activations(quant, engine), quant)
    sums = _accumulate(s, target, picked, claimed, max_tokens, problems, tol, twin, cols)
    base = {"mode": "recompute", "store": str(store_path), "target": str(target_dir), "dtype": s.dtype,
            "layers_claimed": s.layers, "samples": [s.ids[i] for i in picked], "tokens": sums.tokens,
            "compute": {"store": engine.get("compute_dtype"), "recompute": str(target.dtype).replace("torch.", ""),
                        "device": str(target.device),
                        "served_activations": twin.activations if twin is not None else None},
            "tolerance_class": tol_name, "tolerance": tol, "notes": notes,
            "loaded": {"layers": N, "of": plan.total if plan else N, "skipped": plan.skipped if plan else []}}
    if sums.tokens == 0:
        return {**base, "metrics": [], "problems": problems or ["no sample could be compared"], "ok": False}
    layers = _verdicts(sums, claimed, N, tol, problems, s.dtype, whole)
    return {**base, "metrics": layers, "problems": problems, "ok": not problems}


def compare_stores(a: str, b: str, samples: int | None = None) -> dict:
    """Compare two captures of the same samples, layer by layer (b is the reference); matches samples by id."""
    from hstap.store.reader import open_store

    sa, sb = open_store(a), open_store(b)
    if sa.hidden_size != sb.hidden_size:
        raise HstapError(f"{a}: hidden_size {sa.hidden_size} != {sb.hidden_size} of {b}: not the same target")
    common_layers = [L for L in sa.layers if L in sb.layers]
    if not common_layers:
        raise HstapError(f"{a}: layers {sa.layers} and {b}: layers {sb.layers} have no layer in common")
    ids_b = set(sb.ids)
    common = [i for i in sa.ids if i in ids_b]
    only_a = [i for i in sa.ids if i not in ids_b]
    ids_a = set(sa.ids)
    only_b = [i for i in sb.ids if i not in ids_a]
    if not common:
        raise HstapError(f"{a} and {b} share no sample id ({len(sa)} and {len(sb)} samples): not captures of the "
                         "same data")
    picked = [common[j] for j in _pick(len(common), samples)] if samples else common
    compute = compute_class((sa.manifest.get("engine") or {}).get("compute_dtype"),
                             (sb.manifest.get("engine") or {}).get("compute_dtype"))
    tol_name, tol = tolerance([sa.dtype, sb.dtype], compute)
    ulps = "fp8" not in (sa.dtype, sb.dtype)
    slots = [(f"layer {L}", sa.layers.index(L), sb.layers.index(L)) for L in common_layers] + [("final", None, None)]
    acc: list[dict | None] = [None] * len(slots)
    problems: list[str] = []
    tokens = 0
    for sid in picked:
        xa, xb = sa[sa.index_of(sid)], sb[sb.index_of(sid)]
        if not torch.equal(xa["input_ids"], xb["input_ids"]):
            na, nb = len(xa["input_ids"]), len(xb["input_ids"])
            n = min(na, nb)
            diff = (xa["input_ids"][:n] != xb["input_ids"][:n]).nonzero()
            at = int(diff[0]) if len(diff) else n
            problems.append(f"sample {sid!r}: input_ids differ from token {at} on ({na} vs {nb} tokens): "
                            "different tokenization or data")
            continue
        for name, x in (("a", xa), ("b", xb)):
            if not (_finite(x["aux"]) and _finite(x["final"])):
                problems.append(f"sample {sid!r}: store {name} holds NaN/Inf")
        tokens += int(xa["input_ids"].shape[0])
        for j, (_, ka, kb) in enumerate(slots):
            u, v = (xa["final"], xb["final"]) if ka is None else (xa["aux"][:, ka], xb["aux"][:, kb])
            acc[j] = merge_stats(acc[j], layer_stats(u, v, ulps=ulps))
    metrics = []
    for j, (name, ka, _) in enumerate(slots):
        if acc[j] is None:
            continue
        m = finish_stats(acc[j])
        bad = violations(m, tol)
        row = {"name": name, **m, "ok": not bad}
        if bad:
            row["problem"] = f"{name}: {'; '.join(bad)}"
            problems.append(row["problem"])
        metrics.append(row)
    if tokens == 0 and not problems:
        problems.append("no sample could be compared")
    return {"mode": "compare", "a": str(a), "b": str(b), "dtypes": [sa.dtype, sb.dtype], "layers": common_layers,
            "only_in_a_layers": [L for L in sa.layers if L not in sb.layers],
            "only_in_b_layers": [L for L in sb.layers if L not in sa.layers],
            "compared": len(picked), "tokens": tokens, "missing_in_b": only_a, "missing_in_a": only_b,
            "tolerance_class": tol_name, "tolerance": tol, "metrics": metrics, "problems": problems, "ok": not problems}


# ---------------------------------------------------------------------------------------------------------------------
# entry points


def _print(rep: dict) -> None:
    if rep["mode"] == "integrity":
        print(f"{rep['store']}: {rep['samples']} samples, {rep['tokens']} tokens, {rep['shards']} shards, "
              f"{rep['dtype']}, layers {rep['layers']}: " + ("OK" if rep["ok"] else f"{len(rep['problems'])} problems"))
        for p in rep["problems"]:
            print(f"  {p}")
        return
    if rep["mode"] == "recompute":
        print(f"{rep['store']} vs {rep['target']}: {len(rep['samples'])} samples, {rep['tokens']} tokens, "
              f"tolerance: {rep['tolerance_class']} {rep['tolerance']}")
    else:
        print(f"{rep['a']} vs {rep['b']} (reference): {rep['compared']} samples, {rep['tokens']} tokens, "
              f"tolerance: {rep['tolerance_class']} {rep['tolerance']}")
        for side, ids in (("b", rep["missing_in_b"]), ("a", rep["missing_in_a"])):
            if ids:
                print(f"  {len(ids)} ids missing in {side}: {ids[:5]}{' ...' if len(ids) > 5 else ''}")
    print(f"  {'slot':10s} {'cos_min':>10s} {'cos_mean':>10s} {'rel_max':>9s} {'rel_l2':>9s} {'x floor':>7s} "
          f"{'flips':>5s} {'ulp_p99':>8s} {'ulp_max':>9s}  match")
    for m in rep["metrics"]:
        p99, umax = (f"{m['ulp_p99']:8.3g}", f"{m['ulp_max']:9.3g}") if "ulp_p99" in m else (f"{'-':>8s}", f"{'-':>9s}")
        floor = f"{m['rel_l2'] / m['noise_floor']:7.2f}" if m.get("noise_floor") else f"{'-':>7s}"
        flips = f"{m['routing']['flips']:5d}" if "routing" in m else f"{'-':>5s}"
        print(f"  {m['name']:10s} {m['cos_min']:10.6f} {m['cos_mean']:10.6f} {m['rel_max']:9.3g} {m['rel_l2']:9.3g} "
              f"{floor} {flips} {p99} {umax}  {'ok' if m['ok'] else 'FAIL'}"
              f"{'  ' + m['best_match'] if 'best_match' in m else ''}")
    for n in rep.get("notes", []):
        print(f"  note: {n}")
    for p in rep["problems"]:
        print(f"  problem: {p}")
    print(f"verdict: {verdict(rep)}")


def verdict(rep: dict) -> str:
    """One line: what a recompute or comparison report says, with its deciding number."""
    if not rep["ok"]:
        n = len(rep["problems"])
        return f"FAIL: {rep['problems'][0]}" + (f" (+{n - 1} more)" if n > 1 else "")
    rows = rep["metrics"]
    floored = [m for m in rows if m.get("noise_floor")]
    if floored:
        w = max(floored, key=lambda m: m["rel_l2"] / m["noise_limit"])
        worst = (f"worst {w['name']}: relative L2 error {w['rel_l2']:.3g} = {w['rel_l2'] / w['noise_floor']:.2f}x the "
                 f"bf16 noise floor (limit {w['noise_limit'] / w['noise_floor']:.2f}x)")
    else:
        w = min(rows, key=lambda m: m["cos_min"])
        worst = f"worst {w['name']}: cosine {w['cos_min']:.6f}, relative L2 error {w['rel_l2']:.3g}"
    flips = sum(m["routing"]["flips"] for m in rows[-1:] if "routing" in m)
    skipped = (rep.get("loaded") or {}).get("skipped") or []
    return (f"OK: the states are the target's ({rep['tolerance_class']}; {worst})"
            + (f"; {flips} routing flips counted" if flips else "")
            + (f"; not checked: {', '.join(skipped)}" if skipped else ""))


def _fail(rep: dict, what: str) -> None:
    n = len(rep["problems"])
    raise HstapError(f"{what}: {rep['problems'][0]}" + (f" (+{n - 1} more problems)" if n > 1 else ""))


def verify(cfg: VerifyConfig) -> dict:
    """Run the chosen check, print the report, write it as JSON with --report; HstapError on failure."""
    if cfg.report:  # before any work: only an earlier report of verify is replaced, and only when asked
        check_not_input(cfg.report, [("--store", cfg.store), ("--target", cfg.target), ("--a", cfg.a), ("--b", cfg.b)],
                        "--report")
        check_out_file(cfg.report, "verify", cfg.overwrite, "--report")
    if cfg.a is not None:
        rep = compare_stores(cfg.a, cfg.b, cfg.samples)
        what = f"{cfg.a} vs {cfg.b}"
    elif cfg.target is not None:
        rep = recompute(cfg.store, cfg.target, cfg.samples or 4, cfg.device, cfg.compute_dtype, cfg.max_tokens,
                        load_gb=cfg.load_gb)
        what = f"{cfg.store} vs {cfg.target}"
    else:
        rep = check_integrity(cfg.store)
        what = str(cfg.store)
    _print(rep)
    if cfg.report:
        Path(cfg.report).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cfg.report, {"stage": "verify", "hstap_version": hstap.__version__, **rep})
    if not rep["ok"]:
        _fail(rep, what)
    return rep


def quick_check(store_path: str, target_dir: str, samples: int = 2, device: str = "cpu", target=None,
                store=None) -> dict:
    """Train's pre-flight: recompute a few samples; HstapError (naming the offset or problem) if the store does not
    match the target. `target`, `store`: already loaded / opened (as `recompute` takes them)."""
    rep = recompute(store_path, target_dir, samples=samples, device=device, max_tokens=256, target=target, store=store)
    if not rep["ok"]:
        _fail(rep, f"{store_path} does not match {target_dir} (hstap verify --store S --target DIR for details; "
                   "--skip-verify to train anyway)")
    return rep
