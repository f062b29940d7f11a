"""Parity of two captures of the same hidden states: per-layer error metrics and the tolerances they are held to.

Used by `hstap verify` (a store against a recomputation, or two stores) and by the engine parity tests.

Metrics, per stored layer and for `final`, over every compared token ("reference" = the recomputation, or store --b):
- `cos_min` / `cos_mean`: cosine similarity of the stored and reference vectors of each token (min / mean over tokens).
- `rel_max`: max over tokens of max_i |x_i - r_i| / max_i |r_i|: the error relative to the token's largest component
  (elementwise relative errors are meaningless for components near zero).
- `ulp_max` / `ulp_p99`: |x - r| / ulp_bf16(|r|) per element, where ulp_bf16(r) = 2^(floor(log2 |r|) - 7) is the spacing
  of bf16 numbers at the reference value's magnitude (2^-133 below bf16's smallest normal). `ulp_p99` is the 99th
  percentile of one sample, the worst sample reported. Rounding an exact value to bf16 costs <= 0.5 ulp.

Pass/fail tolerances, by the coarsest stored dtype and by whether any computation involved (the capture engine's
`compute_dtype`, the recomputation's `--compute-dtype`) ran in bf16/fp16. Calibrated on the reference target
(../shared/reference/target-tiny, 8 layers, H=384) and the test targets on CPU (see tests/test_verify.py); observed
values in brackets (worst layer of the reference target), limits chosen with margin but far from what a wrong or
shifted layer gives (adjacent layers of the reference target: cos_min 0.54-0.74, rel_max > 1; of the random test
targets, whose residual stream is dominated by the embedding: cos_min 0.97, rel_max 0.21):

| store | compute | cos_min >= | rel_max <= | ulp_p99 <= | observed [cos_min, rel_max, ulp_p99] |
|---|---|---|---|---|---|
| fp32 | fp32 | 0.99999 | 1e-4 | 1 | near-exact (batched capture vs one-sample recompute) [1.0, 1.1e-6, 0.002] |
| bf16 | fp32 | 0.9999 | 0.01 | 1 | rounding to bf16 only [0.999998, 0.0038, 0.495] |
| fp32 or bf16 | bf16 | 0.995 | 0.1 | - | bf16 arithmetic through the layers [0.99967, 0.026, 139] |
| fp8 | fp32 | 0.998 | 0.07 | - | e4m3 with per-token scales: rel <= 16/448 [0.99952, 0.0357, -] |
| fp8 | bf16 | 0.99 | 0.12 | - | [0.99926, 0.052, -] |

ulps are gated only when nothing but rounding separates the two (fp32 compute, fp32/bf16 store): bf16 arithmetic and
fp8's per-token scales make errors proportional to the token's norm, so components far below it show huge ulp errors
by construction (reported, not gated); cosine and rel_max bound what matters there. Independently of the tolerances, a
stored slot fails when another target state matches it at less than half its relative L2 error: on the random test
targets, adjacent layers are close enough (cos_min 0.97) that only this rule and rel_max tell a bf16 shift apart.

The noise floor (whenever a bf16 computation is involved): the table's bf16 limits are wide enough to admit another
variant of the target (block-FP8 weights against their bf16 original: cos_min 0.995-0.999, rel_max 0.05-0.12), so
each slot is also held to `noise_limit`: its relative L2 error may be at most NOISE_FACTOR x the distance between the
recomputation and its twin (hstap.verify.twin: the same checkpoint in the other precision, rounding where the serving
engine rounds), combined with the store's own rounding (STORAGE_RMS). Measured on the reference target
(benchmarks/RESULTS.md, "verify's distances"): the served variant's own states land at 0.94-1.0x the floor (vLLM's and
hf's, INT4 and FP8), the full-precision original's at 4.4-4.9x (FP8) and 19-21x (INT4), another quantization's at
5.6-21x.
"""

from __future__ import annotations

import math

import torch

# (store dtype class, compute class) -> limits; None = not checked. See the table in the module docstring.
TOLERANCES: dict[tuple[str, str], dict[str, float | None]] = {
    ("fp32", "fp32"): {"cos_min": 0.99999, "rel_max": 1e-4, "ulp_p99": 1.0},
    ("bf16", "fp32"): {"cos_min": 0.9999, "rel_max": 0.01, "ulp_p99": 1.0},
    ("fp32", "bf16"): {"cos_min": 0.995, "rel_max": 0.1, "ulp_p99": None},
    ("bf16", "bf16"): {"cos_min": 0.995, "rel_max": 0.1, "ulp_p99": None},
    ("fp8", "fp32"): {"cos_min": 0.998, "rel_max": 0.07, "ulp_p99": None},
    ("fp8", "bf16"): {"cos_min": 0.99, "rel_max": 0.12, "ulp_p99": None},
}
RANK = {"fp32": 0, "bf16": 1, "fp8": 2}


NOISE_FACTOR = 2.5
"""How far above the measured noise floor a store computed in bf16 may land (`noise_limit`). Why 2.5: another engine's
bf16 kernels round at the same points (bf16 activations between ops, fp32 accumulation, weights dequantized to bf16),
in another order, so their distance from fp32 is of the floor's size, not the same numbers; the nearest wrong variant
measured, DeepSeek-V3-style block FP8 weights against their bf16 original, lands at 4-5x the floor (benchmarks/RESULTS.md,
"verify's distances")."""

STORAGE_RMS = {"fp32": 0.0, "bf16": 2.0 ** -7 / math.sqrt(12), "fp8": 2.0 ** -3 / math.sqrt(12)}
"""Relative RMS error of rounding to the store's dtype (spacing / sqrt(12) of a uniform rounding error: 7 fraction
bits for bf16, 3 for e4m3 at its per-token scale): added to the noise floor in quadrature, as independent errors."""


def noise_limit(floor: float, dtype: str) -> float:
    """The largest relative L2 error a slot of a store of `dtype` computed in bf16 may have: NOISE_FACTOR x the
    measured bf16 noise floor of the slot (twin, hstap.verify.twin) combined with the store's own rounding."""
    return NOISE_FACTOR * math.sqrt(floor ** 2 + STORAGE_RMS[dtype] ** 2)


def ulp_bf16(r: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |r|: 2^(floor(log2 |r|) - 7), with 2^-133 below the smallest normal 2^-126."""
    _, e = torch.frexp(r.abs().float().clamp_min(2.0 ** -126))  # |r| = m * 2^e, m in [0.5, 1): floor(log2|r|) = e - 1
    return torch.ldexp(torch.ones_like(r, dtype=torch.float32), e - 8)


def _cos(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per-token cosine (T,) of (T, H) tensors, in float64; two zero vectors count as identical."""
    x, r = x.double(), r.double()
    nx, nr = x.norm(dim=-1), r.norm(dim=-1)
    cos = (x * r).sum(-1) / (nx * nr).clamp_min(1e-300)
    return torch.where((nx == 0) & (nr == 0), torch.ones_like(cos), cos)


def layer_stats(x: torch.Tensor, r: torch.Tensor, ulps: bool = True) -> dict:
    """Metrics of one sample's stored (T, H) `x` against the reference (T, H) `r` (see the module docstring)."""
    x, r = x.float(), r.float()
    cos = _cos(x, r)  # (T,)
    d = (x - r).abs()  # (T, H)
    rmax = r.abs().amax(-1)  # (T,)
    dmax = d.amax(-1)  # (T,)
    rel = torch.where(rmax > 0, dmax / rmax.clamp_min(1e-30), torch.where(dmax > 0, math.inf, 0.0))  # (T,)
    out = {"cos_min": float(cos.min()), "cos_sum": float(cos.sum()), "tokens": int(x.shape[0]),
           "rel_max": float(rel.max()), "l2_err": float(d.double().pow(2).sum()), "l2_ref": float(r.double().pow(2).sum())}
    if ulps:
        u = (d / ulp_bf16(r)).flatten()  # (T*H,)
        k = max(1, math.ceil(0.99 * u.numel()))
        out |= {"ulp_max": float(u.max()), "ulp_p99": float(torch.kthvalue(u.cpu(), k).values)}
    return out


def merge_stats(acc: dict | None, s: dict) -> dict:
    if acc is None:
        return dict(s)
    out = {"cos_min": min(acc["cos_min"], s["cos_min"]), "cos_sum": acc["cos_sum"] + s["cos_sum"],
           "tokens": acc["tokens"] + s["tokens"], "rel_max": max(acc["rel_max"], s["rel_max"]),
           "l2_err": acc["l2_err"] + s["l2_err"], "l2_ref": acc["l2_ref"] + s["l2_ref"]}
    if "ulp_max" in s:
        out |= {"ulp_max": max(acc["ulp_max"], s["ulp_max"]), "ulp_p99": max(acc["ulp_p99"], s["ulp_p99"])}
    return out


def finish_stats(acc: dict) -> dict:
    rel_l2 = math.sqrt(acc["l2_err"] / acc["l2_ref"]) if acc["l2_ref"] > 0 else (0.0 if acc["l2_err"] == 0 else math.inf)
    out = {"cos_min": acc["cos_min"], "cos_mean": acc["cos_sum"] / max(acc["tokens"], 1), "rel_max": acc["rel_max"],
           "rel_l2": rel_l2}
    if "ulp_max" in acc:
        out |= {"ulp_max": acc["ulp_max"], "ulp_p99": acc["ulp_p99"]}
    return out


def row_breaks(x: torch.Tensor, r: torch.Tensor, tol: dict) -> torch.Tensor:
    """(T,) bool: the rows of stored (T, H) `x` that alone break `tol`'s cosine or max-relative-error limit against the
    reference (T, H) `r` (what a routing flip does to a row: `hstap.verify.routing`)."""
    x, r = x.float(), r.float()
    rel = (x - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-30)  # (T,)
    return (_cos(x, r) < tol["cos_min"]) | (rel > tol["rel_max"])


def violations(m: dict, tol: dict) -> list[str]:
    bad = []
    if not m["cos_min"] >= tol["cos_min"]:
        bad.append(f"cosine {m['cos_min']:.6f} < {tol['cos_min']}")
    if not m["rel_max"] <= tol["rel_max"]:
        bad.append(f"max relative error {m['rel_max']:.3g} > {tol['rel_max']}")
    if tol["ulp_p99"] is not None and "ulp_p99" in m and not m["ulp_p99"] <= tol["ulp_p99"]:
        bad.append(f"p99 error {m['ulp_p99']:.3g} bf16 ulps > {tol['ulp_p99']:g}")
    return bad


def compute_class(*names: str | None) -> str:
    """'bf16' if any computation ran in a 16-bit float type, else 'fp32'."""
    for n in names:
        n = str(n or "").lower()
        if any(s in n for s in ("bf16", "bfloat16", "fp16", "float16", "half", "fp8", "float8")):
            return "bf16"
    return "fp32"


def tolerance(store_dtypes: list[str], compute: str) -> tuple[str, dict]:
    sd = max(store_dtypes, key=lambda d: RANK[d])
    return f"{sd} store, {compute} compute", TOLERANCES[(sd, compute)]
