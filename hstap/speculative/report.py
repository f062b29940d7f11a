"""What `hstap eval` tells people: the console table and REPORT/report.md, with what tau and speedup mean and why a
measured speedup may not carry over to serving (a CPU, a tiny target)."""

from __future__ import annotations

from hstap.speculative.config import Decoding
from hstap.speculative.sglang import sglang_lines

PLOT = "acceptance.png"


TAU_MEANS = ("tau = tokens per target forward: the drafts the target accepted plus its own next (bonus) token; 1.0 = "
             "no draft ever accepted, k+1 = every draft of a k-token chain accepted.")
SPEEDUP_MEANS = ("speedup = generated tokens/s over target-only decoding's, same prompts, same hardware, same "
                 "process (tokens/s include the prefill).")
TINY_TARGET = 1e8  # parameters: below this a target forward is overhead-bound (Python, launches), whatever the hardware


def speedup_notes(r: dict) -> list[str]:
    """Why the report's speedup figures do not carry over to serving a large target on a GPU (empty when they do)."""
    notes = []
    if r["hardware"]["device"].startswith("cpu"):
        notes.append("measured on a CPU: there a target large enough to be compute-bound pays about k+1 times a "
                     "decoding step to verify k+1 tokens, while on a GPU decoding is memory-bound and verifying k+1 "
                     "tokens costs about as much as decoding one")
    if r["target_params"] < TINY_TARGET:
        d = (r.get("drafter") or {}).get("params")
        notes.append(f"the target is tiny ({r['target_params'] / 1e6:.1f} M parameters"
                     + (f", its drafter {d / 1e6:.1f} M" if d else "") + "): a forward's fixed cost (Python, kernel "
                     "launches) dominates, so drafting costs about as much as the target forwards it saves; tau is the "
                     "figure that carries over to a large target")
    return notes


def print_summary(decode: Decoding, out: str, r: dict) -> None:
    """The console table of the methods and what the figures mean (`decode`: eval's drafting and sampling; `out`:
    the report directory)."""
    from hstap.console import table

    mode = decode.drafting()
    rows = []
    for name, m in r["methods"].items():
        acc = " ".join(f"{a:.2f}" for a in m.get("per_position_acceptance", [])) or "-"
        rows.append([name, f"{m['tau']:.3f}", f"{m['tokens_per_s']:.1f}", f"{m['speedup']:.2f}x", acc])
    lines = [f"hstap eval: {r['num_prompts']} prompts, " + ("greedy" if decode.temperature == 0 else
                                                             f"temperature {decode.temperature:g}")
             + f", {mode}, {r['dtype']} on {r['hardware'].get('gpu', r['hardware']['device'])}",
             table(["method", "tau", "tokens/s", "speedup", "acceptance by draft position"], rows)]
    if r["simulated_tau"] is not None:
        lines.append(f"  simulated tau of this chain (training, teacher-forced): {r['simulated_tau']:.3f}")
    if r["lossless"] is not None:
        lines.append("  lossless (greedy outputs equal target-only): " + ("yes" if r["lossless"] else "NO"))
    lines.extend("  " + x for x in vllm_lines(r.get("vllm")) + sglang_lines(r.get("sglang")))
    lines.append("  " + TAU_MEANS)
    for note in r["speedup_notes"]:
        lines.append(f"  speedup not representative: {note}")
    lines.append(f"  wrote {out}/report.md, report.json, {PLOT}")
    print("\n".join(lines), flush=True)


def markdown(decode: Decoding, sources: tuple[str, str | None, str], r: dict) -> str:
    """REPORT/report.md (`decode`: eval's drafting and sampling; `sources`: its --target, --drafter and --data)."""
    target, drafter, data = sources
    hw = r["hardware"]
    lines = [f"# hstap eval: {r['method']}", "",
             f"target `{target}`, drafter `{drafter}`, data `{data}`, {r['num_prompts']} prompts, "
             f"max {decode.max_new_tokens} new tokens, temperature {decode.temperature}, {r['dtype']} on "
             f"{hw.get('gpu', hw['device'])} (torch {hw['torch']}, transformers {hw['transformers']})",
             "drafting: " + decode.drafting()
             + f"; engine {r['engine']}" + (f" ({r['kernels']} kernels)" if r.get("kernels") else ""), "",
             ("| method | tau | tokens/s | speedup | predicted | draft s | verify s | ms/round draft / verify / host "
              "| per-position acceptance |"),
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f=".2f": format(v, f) if isinstance(v, float) else "-"
    for name, m in r["methods"].items():
        acc = " ".join(f"{a:.2f}" for a in m.get("per_position_acceptance", [])) or "-"
        split = " / ".join(fmt(m.get(f"{k}_ms_per_round"), ".3f") for k in ("draft", "verify", "host"))
        lines.append(f"| {name} | {m['tau']:.3f} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | "
                     f"{fmt(m.get('predicted_speedup'))}{'x' if m.get('predicted_speedup') else ''} | "
                     f"{fmt(m.get('draft_s'))} | {fmt(m.get('verify_s'))} | {split} | {acc} |")
    lines += ["", ("predicted speedup (hstap.speculative.latency.round_model) = tau c_token / (D c_draft + c_verify + "
                   "c_host): the round's measured draft, verify and host time against c_token, target-only's cost "
                   "per token (its step and host time); it leaves out the prefill and the first token. The simpler "
                   "tau / (1 + k c_draft / c_verify), which assumes a verify costs one target-only step and the host "
                   "nothing, is report.json's predicted_speedup_naive."), ""]
    if r["simulated_tau"] is not None and r["tau"] > 0:
        sim, tau = r["simulated_tau"], r["tau"]
        lines.append(f"simulated tau of this chain (training eval at step {r['simulated']['step']}, teacher-forced: "
                     f"chain of {decode.k} drafts replayed on the eval split): {sim:.3f}; measured tau {tau:.3f} "
                     f"({100 * (sim - tau) / tau:+.1f}%)")
    if r["lossless"] is not None:
        ties = sum(1 for m in r["mismatches"] if m["near_tie"])
        lines.append(f"lossless (greedy outputs equal target-only): **{r['lossless']}**"
                     + (f", {len(r['mismatches'])} mismatch(es), see report.json" if r["mismatches"] else ""))
        if ties:
            lines.append(f"{ties} of them are near-ties: at the first differing token the target's own logits (a "
                         "fresh full forward) put both tokens within --tie-tol of the top one, a tie that "
                         f"{r['dtype']} kernels may break either way; such outputs are still the target's greedy "
                         "output up to that tie, so the run counts as lossless.")
    if r.get("vllm"):
        lines += [""] + vllm_lines(r["vllm"])
    if r.get("sglang"):
        lines += [""] + sglang_lines(r["sglang"])
    lines += ["", "- " + TAU_MEANS + " The prefill's first token is not counted.", "- " + SPEEDUP_MEANS]
    if r["speedup_notes"]:
        lines += ["", "**These speedups are not representative** of serving a large target on a GPU:"]
        lines += [f"- {n}." for n in r["speedup_notes"]]
    lines += ["", f"![per-position acceptance]({r['plot']})"]
    return "\n".join(lines) + "\n"



def vllm_lines(v: dict | None) -> list[str]:
    """What `--engine vllm` measured inside vLLM (hstap.speculative.vllm), and whether it agrees with hstap's decoder."""
    if not v:
        return []
    a = v.get("agreement") or {}
    yes = lambda b: "yes" if b else "NO"  # noqa: E731
    acc = " ".join(f"{x:.2f}" for x in v["per_position_acceptance"]) or "-"
    out = [f"vLLM {v['version']} (its own EAGLE-3 decoding, k={v['k']}, {v['batched_prompts']} prompts batched): "
           f"tau {v['tau']:.3f}, acceptance by draft position {acc} ({v['drafts']} rounds, {v['accepted']} drafts "
           f"accepted, from vLLM's counters)",
           f"vLLM's tau is 1 + accepted / rounds (a bonus token in every round); the same figure of hstap's decoder is "
           f"{a.get('hstap_one_plus_accepted', 0):.3f} (hstap's tau counts the tokens kept: a round cut by the token "
           "limit or an end of turn keeps fewer)",
           f"vLLM's counters equal hstap's decoder on the same prompts: rounds {yes(a.get('drafts_equal'))} "
           f"({v['drafts']} vs {a.get('hstap_rounds')}), accepted by position {yes(a.get('accepted_per_pos_equal'))} "
           f"({v['accepted_per_pos']} vs {a.get('hstap_accept_counts')}); outputs equal hstap's on "
           f"{a.get('outputs_equal_hstap')}/{a.get('prompts')} prompts"]
    if v.get("lossless") is not None:
        out.append(f"vLLM lossless (greedy outputs with the drafter equal vLLM without it): {yes(v['lossless'])}")
    out.append(f"vLLM tokens/s {v['tokens_per_s']:.1f} with the drafter, {v['target_tokens_per_s']:.1f} without "
               f"({v['speedup']:.2f}x; batched, so not comparable with hstap's batch-1 figures)")
    return out
