"""`hstap eval`: speculative decoding with a trained drafter, measured against target-only decoding on the same prompts
and the same hardware in the same process.

    hstap eval --target MODEL_DIR --drafter RUN --data PREPARED --out REPORT                       # chain, k=5
    hstap eval --target MODEL_DIR --drafter RUN --data prompts.jsonl --mode tree --topk 8 --depth 6 --tokens 60 \
               --baseline ngram --num-prompts 80 --device cuda --out REPORT

Prompts: from a prepared dataset, each sample cut where its last assistant answer starts (the first token of the last
run of loss_mask = 1); from a conversations JSONL, each conversation up to its last user turn, rendered with the chat
template and the generation prompt (`hstap.data.chat.render_prompt`); `{"id", "messages": [{"role": "user", ...}]}` works as
is. Generation stops at an eos / end-of-turn id (kept in the output) or after --max-new-tokens.

Methods, run one after the other over all prompts after one warm-up prompt each: `target` (plain decoding with a KV
cache: the baseline), `ngram` (prompt lookup, with --baseline ngram, k = --k) and `eagle` (the drafter, --mode chain or
tree), each with a progress line (prompts done / total, tokens/s). Figures: tau = tokens per target forward = tokens
produced by verify forwards / verify forwards, the bonus token included (the same definition as training's sim_tau;
the prefill's first token is excluded; SGLang's accept length counts it); per-position acceptance = fraction of rounds
whose accepted draft reached depth i; tokens/s = generated tokens / wall time including the prefill, summed over
prompts; speedup = tokens/s over the target's. With --drafter RUN and --mode chain, the training run's simulated tau
for a chain of --k drafts is reported next to the measured one: `sim_chain_tau[k-1]` of the checkpoint's eval line in
RUN/metrics.jsonl (chain decoding replayed round by round on the teacher-forced eval split, `hstap.train.ttt.replay_chain`;
older runs: 1 + sum_{j<k} prod_{i<=j} acc_cond_i). It predicts the measured tau when the eval split holds the
target's own outputs (`hstap generate`) and --k <= the run's --ttt.

Losslessness: at temperature 0 every method's output must equal the target's, token for token. A mismatch is reported
loudly and fails the command (exit status 2) unless the target's own logits (a fresh full forward) put both tokens
within --tie-tol of the top at the diverging position: a near-tie that low-precision kernels may break either way.

Output (REPORT/): report.json (top-level tau, per_position_acceptance, timings, speedup, lossless, simulated_tau,
methods, speedup_notes, prompts [{id, prompt_ids, output_ids}]), report.md (what tau and speedup mean, and why a
speedup is not representative: a CPU, a target under TINY_TARGET parameters), acceptance.png (per-position acceptance),
config.json. The console gets a table of the methods. Before anything loads, `hstap.speculative.inputs` checks that the
inputs belong together (the drafter and the prompts against the target; an --out holding a report needs --overwrite).
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

from hstap.common import HstapError, atomic_write_bytes, atomic_write_json, write_run_config
from hstap.console import Progress
from hstap.data.prompts import load_prompts
from hstap.data.reasoning import template_kwargs
from hstap.plots import acceptance_plot
from hstap.speculative.config import EvalConfig
from hstap.speculative.drivers import (acceptance_rates, new_cache, ngram_generate, speculative_generate,
                                       target_forward, target_generate)
from hstap.speculative.fast import FUSED, FastDecoder
from hstap.speculative.inputs import check_inputs
from hstap.speculative.latency import latency_model, round_model
from hstap.speculative.report import PLOT, markdown, print_summary, speedup_notes
from hstap.speculative import sglang as sglang_engine
from hstap.speculative.vllm import agreement, run_vllm, vllm_drafter_dir


# --- prompts ----------------------------------------------------------------------------------------------------------
def eos_ids(tokenizer, target) -> list[int]:
    """End ids: the model's and tokenizer's eos and the template's end-of-turn token (where `hstap generate` stops)."""
    from hstap.data.decode import stop_token_ids

    return stop_token_ids(target.model, tokenizer)


def load_any_drafter(path: str, target):
    """(drafter on the target's device and dtype, its metadata) from an hstap drafter dir, a training RUN, or an
    SGLang / vLLM export (whose missing embedding is the target's)."""
    from hstap.artifacts.drafter_dir import load_drafter
    from hstap.export.engines import load_exported

    p = Path(path)
    if (p / "model.safetensors").is_file() and not (p / "drafter.safetensors").is_file():
        return load_exported(p, embed_weight=target.embed_tokens.weight, device=target.device, dtype=target.dtype)
    return load_drafter(p, device=target.device, dtype=target.dtype, embed=target.embed_tokens.weight)


def sim_chain_tau(rec: dict | None, k: int) -> float | None:
    """Simulated tau of greedy chain decoding with k drafts from a training eval record: its replayed `sim_chain_tau`
    (hstap.train.ttt.replay_chain), else 1 + sum_{j<k} prod_{i<=j} acc_cond[i] (runs from before the replay); None when
    the run simulated fewer than k steps (its --ttt) or logged neither."""
    rec = rec or {}
    chain = rec.get("sim_chain_tau")
    if chain and len(chain) >= k:
        return float(chain[k - 1]) if chain[k - 1] > 0 else None  # 0: the eval split had no round to replay
    acc = rec.get("acc_cond")
    if not acc or len(acc) < k:
        return None
    tau, p = 1.0, 1.0
    for a in acc[:k]:
        p *= float(a)
        tau += p
    return tau


def read_sim_tau(drafter_path: str) -> dict | None:
    """The training run's simulated tau for this drafter: from metrics.jsonl next to it (RUN, RUN/best or a checkpoint),
    the eval line of the checkpoint's own step (trainer_state.json) when there is one, else the last eval line."""
    from hstap.artifacts.drafter_dir import resolve_drafter_dir

    p = Path(drafter_path)
    try:
        d = resolve_drafter_dir(p)
    except HstapError:
        d = p
    step = None
    if (d / "trainer_state.json").is_file():
        try:
            step = json.loads((d / "trainer_state.json").read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            step = None
    for run in dict.fromkeys((p, d.parent, d.parent.parent)):  # RUN itself, RUN for best/, RUN for checkpoints/step_*
        f = run / "metrics.jsonl"
        if not f.is_file():
            continue
        evals = []
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed run
            if isinstance(rec, dict) and rec.get("sim_tau") is not None:
                evals.append(rec)
        if evals:
            own = [r for r in evals if step is not None and r.get("step") == step]
            rec = (own or evals)[-1]
            return {"sim_tau": float(rec["sim_tau"]), "step": rec.get("step"), "checkpoint_step": step,
                    "acc_cond": rec.get("acc_cond"), "sim_chain_tau": rec.get("sim_chain_tau"), "file": str(f)}
    return None


# --- running and summing up -------------------------------------------------------------------------------------------
def run_method(fn, prompts: list[tuple[str, list[int]]], seed: int, device,
               progress=None) -> tuple[list[list[int]], dict]:
    """fn(prompt, generator) -> (output, stats) on every prompt; returns the outputs and the summed figures.
    `progress` (a `hstap.console.Progress`) is told after each prompt, with the tokens/s so far."""
    outs, per = [], []
    new = wall = 0.0
    for i, (_, prompt) in enumerate(prompts):
        gen = torch.Generator(device=device).manual_seed(seed + i)
        out, s = fn(prompt, gen)
        outs.append(out)
        per.append(s)
        new, wall = new + (s.get("new_tokens") or 0), wall + (s.get("total_s") or 0)
        if progress is not None:
            progress.update(1, f"{new / wall:.1f} tokens/s" if wall > 0 else "")
    return outs, aggregate(per)


def aggregate(per: list[dict]) -> dict:
    """Sum per-prompt stats: tau and acceptance over all verify rounds, tokens/s over all wall time."""
    tot = lambda key: sum(s.get(key) or 0 for s in per)  # noqa: E731
    steps, new, wall = tot("verify_forwards"), tot("new_tokens"), tot("total_s")
    agg = {"method": per[0]["method"], "prompts": len(per), "new_tokens": new, "verify_forwards": steps,
           "tau": tot("verify_tokens") / steps if steps else 0.0, "total_s": wall,
           "tokens_per_s": new / wall if wall > 0 else 0.0}
    for key in ("prefill_s", "draft_s", "verify_s", "decode_s", "host_s"):
        if any(key in s for s in per):
            agg[key] = tot(key)
    agg.update(latency_model(agg))
    if "accept_counts" in per[0]:
        counts = [sum(c) for c in zip(*(s["accept_counts"] for s in per))]
        agg["accept_counts"] = counts
        agg["per_position_acceptance"] = acceptance_rates(counts, steps)
        agg["mean_accepted"] = sum(counts) / steps if steps else 0.0
    if "mean_tree_nodes" in per[0]:
        agg["mean_tree_nodes"] = sum(s["mean_tree_nodes"] * s["verify_forwards"] for s in per) / steps if steps else 0.0
    return agg


def decoders(cfg: EvalConfig, target, drafter, prompts, eos) -> tuple[str, dict]:
    """(engine name, {method: fn(prompt, generator, max_new) -> (output, stats)}) for --engine."""
    engine = cfg.engine if cfg.engine in ("fast", "eager") else ("fast" if target.device.type == "cuda" else "eager")
    d, dec = cfg.decode, None
    T = d.temperature
    if cfg.kernels == "fused" and engine != "fast":
        print("hstap eval: --kernels fused applies to the fast engine only: the eager one runs", file=sys.stderr)
    if engine == "fast":
        longest = max(len(p) for _, p in prompts) + d.max_new_tokens + max(d.tokens, d.k, d.depth) + 2
        dec = FastDecoder(target, drafter, max_len=longest, compile=None if cfg.compile else False,
                          **(FUSED if cfg.kernels == "fused" else {}))
    tgt, ngram, spec = ((dec.target_generate, dec.ngram_generate, dec.speculative_generate) if dec else
                        (lambda *a: target_generate(target, *a), lambda *a: ngram_generate(target, *a),
                         lambda *a: speculative_generate(target, drafter, *a)))
    methods = {"target": lambda p, g, m=d.max_new_tokens: tgt(p, m, T, eos, g)}
    if cfg.baseline == "ngram":
        methods["ngram"] = lambda p, g, m=d.max_new_tokens: ngram(p, m, d.k, 3, T, eos, g)
    if drafter is not None:
        methods["eagle"] = lambda p, g, m=d.max_new_tokens: spec(p, m, d.mode, d.k, d.topk, d.depth, d.tokens, T, eos,
                                                                 g)
    return engine, methods


def check_lossless(target, prompts, ref: list[list[int]], outs: list[list[int]], method: str, tol: float) -> list[dict]:
    """Mismatches of `outs` against the target-only outputs, with the target's logit gap at the first difference."""
    bad = []
    for (pid, prompt), a, b in zip(prompts, ref, outs):
        if a == b:
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rec = {"id": pid, "method": method, "position": i, "target_len": len(a), "output_len": len(b)}
        if i < min(len(a), len(b)):  # both continue but differ: how close were the two tokens in the target's eyes?
            logits, _ = target_forward(target, torch.tensor([prompt + a[:i]], device=target.device), [], new_cache())
            top = logits[-1].max()
            gap = float(max(top - logits[-1, a[i]], top - logits[-1, b[i]]))
            rec.update(target_token=a[i], output_token=b[i], logit_gap=gap, near_tie=gap <= tol)
        else:
            rec["near_tie"] = False  # one stopped earlier than the other at equal prefixes: never a tie
        bad.append(rec)
    return bad


# --- the stage --------------------------------------------------------------------------------------------------------
def evaluate(cfg: EvalConfig) -> dict:
    from hstap.artifacts.model_dir import load_target

    check_inputs(cfg)  # the inputs belong together, before anything loads or decodes
    target, tok = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype)
    dev = target.device
    drafter, meta = load_any_drafter(cfg.drafter, target) if cfg.drafter is not None else (None, None)
    prompts = load_prompts(cfg.data, tok, cfg.num_prompts, template_kwargs(cfg.chat_template_kwargs))
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)  # after the input checks, before the long runs
    write_run_config(out_dir, "eval", cfg)  # first: the record that makes the directory eval's (hstap.artifacts.outputs)
    eos = eos_ids(tok, target)
    d = cfg.decode
    T, n = d.temperature, d.max_new_tokens
    dtype = str(target.dtype).replace("torch.", "").replace("float32", "fp32").replace("bfloat16", "bf16")
    vllm_dir = vllm_drafter_dir(cfg.drafter, cfg.target, out_dir, dtype, target.num_layers) \
        if cfg.engine == "vllm" else None  # refused now, before the long runs
    sglang_dir = sglang_engine.sglang_drafter_dir(cfg.drafter, cfg.sglang_python, out_dir, dtype, target.num_layers) \
        if cfg.engine == "sglang" else None
    engine, methods = decoders(cfg, target, drafter, prompts, eos)
    outputs, results = {}, {}
    for name, fn in methods.items():
        fn(prompts[0][1], torch.Generator(device=dev).manual_seed(d.seed), min(n, 32))  # warm-up, not counted
        bar = Progress(f"hstap eval: {name}", len(prompts), "prompts")
        outputs[name], results[name] = run_method(fn, prompts, d.seed, dev, bar)
        bar.close()
        r = results[name]
        print(f"hstap eval: {name:6s} tau {r['tau']:.3f}  {r['tokens_per_s']:.1f} tokens/s  ({r['new_tokens']} "
              f"tokens, {len(prompts)} prompts)", file=sys.stderr)
    base = results["target"]["tokens_per_s"]
    for r in results.values():
        r["speedup"] = r["tokens_per_s"] / base if base > 0 else 0.0
        if r is not results["target"] and "predicted_speedup" in r:  # the refined model; the naive one kept beside it
            r["predicted_speedup_naive"] = r["predicted_speedup"]
            r["predicted_speedup"] = round_model(r, results["target"])
    vl = run_vllm(cfg.target, d, cfg.device, prompts, eos, str(vllm_dir), dtype) if vllm_dir is not None else None

    mismatches = []
    if T == 0:
        tol = cfg.tie_tol if cfg.tie_tol is not None else (1e-3 if target.dtype == torch.float32 else 0.5)
        for name in methods:
            if name != "target":
                mismatches += check_lossless(target, prompts, outputs["target"], outputs[name], name, tol)
    failed = [m for m in mismatches if not m["near_tie"]]
    primary = "eagle" if drafter is not None else ("ngram" if "ngram" in results else "target")
    sim = read_sim_tau(cfg.drafter) if cfg.drafter is not None else None
    p = results[primary]
    report = {
        "method": primary, "tau": p["tau"], "per_position_acceptance": p.get("per_position_acceptance", []),
        "mean_accepted": p.get("mean_accepted"), "tokens_per_s": p["tokens_per_s"], "target_tokens_per_s": base,
        "speedup": p["speedup"], "predicted_speedup": p.get("predicted_speedup"), "engine": engine,
        "kernels": cfg.kernels if engine == "fast" else None,
        "compiled": (cfg.compile and target.device.type == "cuda") if engine == "fast" else None,
        "prefill_s": p.get("prefill_s"), "total_s": p["total_s"],
        "draft_s": p.get("draft_s"), "verify_s": p.get("verify_s"), "host_s": p.get("host_s"),
        "simulated_tau": sim_chain_tau(sim, d.k) if d.mode == "chain" else None,
        "simulated": sim,
        "lossless": (not failed) if T == 0 else None, "mismatches": mismatches,
        "methods": results, "num_prompts": len(prompts), "eos_ids": eos,
        "hardware": _hardware(dev), "dtype": str(target.dtype).replace("torch.", ""),
        "target_params": sum(p.numel() for p in target.model.parameters()),
        "drafter": {"path": cfg.drafter, "aux_layers": list(drafter.config.aux_layers),
                    "draft_vocab_size": drafter.config.draft_vocab_size} if drafter is not None else None,
        "prompts": [{"id": pid, "prompt_ids": pr, "output_ids": outputs[primary][i],
                     **({"target_output_ids": outputs["target"][i]} if T > 0 and primary != "target" else {})}
                    for i, (pid, pr) in enumerate(prompts)],
    }
    if drafter is not None:
        report["drafter"]["trained_on_this_target"] = _same_target(cfg.target, meta)
        report["drafter"]["params"] = sum(p.numel() for p in drafter.parameters())
    if vl is not None:
        vl["agreement"] = agreement(vl, results["eagle"], outputs["eagle"])
        for i, entry in enumerate(report["prompts"]):
            entry["vllm_output_ids"] = vl["outputs"][i]
        report["vllm"] = {k: v for k, v in vl.items() if k not in ("outputs", "target_outputs")}
    if sglang_dir is not None:
        sglang_engine.attach(report, sglang_engine.run_sglang(cfg.target, d, cfg.device, cfg.sglang_python, prompts,
                                                              eos, sglang_dir, dtype, outputs, results["eagle"],
                                                              out_dir))
    report["speedup_notes"] = speedup_notes(report)
    report["plot"] = PLOT
    write_run_config(out_dir, "eval", cfg)
    atomic_write_bytes(out_dir / "report.md", markdown(d, (cfg.target, cfg.drafter, cfg.data), report).encode())
    atomic_write_json(out_dir / "report.json", report)  # before the plot: a plot that fails loses no result
    acceptance_plot(results, d.mode, out_dir / PLOT)
    summary = {k: report[k] for k in ("method", "tau", "per_position_acceptance", "tokens_per_s", "target_tokens_per_s",
                                      "speedup", "simulated_tau", "lossless", "num_prompts", "methods",
                                      "speedup_notes")}
    summary["out"] = str(out_dir)
    print_summary(d, cfg.out, report)
    say_mismatches(mismatches)
    sglang_engine.check_ran(report, out_dir)
    if failed:
        raise HstapError(f"{out_dir / 'report.json'}: lossless: {len(failed)} greedy output(s) differ from target-only "
                         f"decoding beyond a near-tie (first: {failed[0]['method']} on prompt {failed[0]['id']} at "
                         f"token {failed[0]['position']}): a bug")
    return summary


def say_mismatches(mismatches: list[dict]) -> None:
    """One line for the near-ties the lossless check forgave, one per output that left the target's beyond a tie."""
    ties = [m for m in mismatches if m["near_tie"]]
    if ties:
        print(f"hstap eval: {len(ties)} near-tie mismatch(es): an output left the target's at a token whose logit is "
              f"within --tie-tol of the top one (a tie low-precision kernels may break either way; details in "
              f"report.json's mismatches); the run still counts as lossless", file=sys.stderr)
    for m in mismatches:
        if not m["near_tie"]:
            print(f"hstap eval: LOSSLESSNESS VIOLATION: {m['method']} output of prompt {m['id']} differs from the "
                  f"target's at token {m['position']}: {json.dumps(m)}", file=sys.stderr)


def _same_target(target_dir: str, meta: dict) -> bool | None:
    """Whether the drafter was trained on this target's states (weights fingerprint in drafter.json); None = unknown."""
    want = ((meta or {}).get("store") or {}).get("target", {}).get("weights_fingerprint")
    if not want:
        return None
    from hstap.artifacts.model_dir import weights_fingerprint

    same = weights_fingerprint(target_dir) == want
    if not same:
        print("hstap eval: warning: the drafter was trained on hidden states of another target (weights fingerprint "
              "differs): expect low acceptance", file=sys.stderr)
    return same


def _hardware(dev: torch.device) -> dict:
    import transformers

    hw = {"device": str(dev), "torch": torch.__version__, "transformers": transformers.__version__,
          "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(dev)
    return hw
