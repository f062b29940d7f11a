"""Latency models of speculative decoding: the speedup predicted from the measured per-round costs of a method
(draft_s, verify_s, host_s summed over its rounds, and verify_forwards, the rounds; hstap.speculative.fast's stats), to set
beside the measured one.

    naive model     tau / (1 + k c_draft / c_verify)                        (latency_model)
    refined model   tau c_token / (D c_draft + c_verify + c_host)           (round_model)

The first assumes that verifying k+1 tokens costs one decode step and that the host costs nothing; on a small target
neither holds (benchmarks/RESULTS.md: it over-predicts by 20-120%, the refined one is within a few percent).
"""

from __future__ import annotations


def latency_model(stats: dict) -> dict:
    """Per-round costs and the predicted speedup tau / (1 + k c_draft / c_verify) from the measured ones: k c_draft is
    the drafting time of a round (per-level cost times the depth), c_verify the verify time of a round."""
    rounds = stats.get("verify_forwards") or 0
    verify = stats.get("verify_s", stats.get("decode_s"))  # target-only: its one-token step is the "verify"
    if not rounds or not verify:
        return {}
    out = {f"{k}_ms_per_round": 1e3 * (v or 0.0) / rounds
           for k, v in (("draft", stats.get("draft_s")), ("verify", verify), ("host", stats.get("host_s")))}
    if stats.get("draft_s") is not None:
        out["predicted_speedup"] = stats["tau"] / (1 + stats["draft_s"] / verify)
        if stats.get("depth"):  # drafter forwards per round (a chain's k; a tree's levels): c_draft per forward
            out["draft_ms_per_step"] = out["draft_ms_per_round"] / stats["depth"]
    return out


def round_model(spec: dict, target: dict) -> float | None:
    """Refined latency model: tau c_token / (D c_draft + c_verify + c_host), per-round costs of the speculative method
    and c_token = the target-only cost per token (its decode step + its host time, per round), all measured. Unlike
    the naive tau / (1 + k c_draft / c_verify) it does not assume that verifying N tokens costs one decode step and
    that the host costs nothing; it leaves out only the prefill and the first token."""
    n, m = spec.get("verify_forwards") or 0, target.get("verify_forwards") or 0
    c_tok = ((target.get("decode_s") or target.get("verify_s") or 0.0) + (target.get("host_s") or 0.0)) / m if m else 0
    c_round = sum(spec.get(k) or 0.0 for k in ("draft_s", "verify_s", "host_s")) / n if n else 0
    return spec["tau"] * c_tok / c_round if c_tok > 0 and c_round > 0 else None
