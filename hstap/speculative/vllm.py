"""`hstap eval --engine vllm`: the drafter inside vLLM's own speculative decoding, next to hstap's decoder.

vLLM runs the eval prompts twice, in this process, on the same target and dtype: without speculation, then with the
drafter as its EAGLE-3 proposer (`hstap.engines.vllm.eagle3_config`: `{"method": "eagle3", "model": DIR,
"num_speculative_tokens": --k}`; vLLM drafts chains only). Both get all prompts at once, as a server would batch them; the stop ids are hstap's
(eos and end of turn), so that the outputs compare token for token with hstap's. What comes back:

- vLLM's own counters of the speculative run (`LLM.get_metrics()`, taken as the difference over the run):
  `spec_decode_num_drafts` (rounds), `num_draft_tokens`, `num_accepted_tokens` and `num_accepted_tokens_per_pos`;
  vLLM's tau = 1 + accepted / drafts (its mean acceptance length, the bonus token included: hstap's tau) and its
  per-position acceptance = accepted at position i / drafts (hstap's definition);
- whether its greedy outputs equal its outputs without speculation (lossless inside vLLM);
- tokens/s of both runs (batched: not comparable with hstap's batch-1 figures, only with each other).

The drafter directory vLLM gets: a vLLM export whose layers vLLM reads right (`hstap.export.engines.vllm_aux_layers`,
which refuses anything else with the export to use), or, for an hstap drafter or training run, a vLLM export written
now into REPORT/vllm-drafter (in the eval dtype, verifier = --target).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hstap.speculative.config import Decoding

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_drafter_dir(drafter: str, target: str, out_dir: Path, dtype: str, num_layers: int) -> Path:
    """The directory vLLM loads as the drafter (module docstring)."""
    from hstap.export.engines import vllm_aux_layers

    p = Path(drafter)
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        vllm_aux_layers(p, num_layers)  # refuses a directory whose taps vLLM would read off by one
        return p
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export

    d = out_dir / "vllm-drafter"
    export(ExportConfig(run=drafter, to="vllm", out=str(d), dtype=dtype, target=target, overwrite=True))
    return d


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters of an offline `LLM`, summed over its engines (COUNTERS; PER_POS a list)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0) + int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            prev = out.get(PER_POS, [0] * len(vals))
            out[PER_POS] = [a + b for a, b in zip(prev, vals)]
    return out


def _run(target: str, dtype: str, prompts: list[list[int]], max_new: int, temperature: float, eos: list[int],
         seed: int, spec: dict | None, device: str) -> tuple[list[list[int]], float, dict, str]:
    """(outputs, wall seconds, counters of this run, its model runner: 'v1' or 'v2') of one vLLM engine over the
    prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hstap.engines.vllm import start_llm, stop_llm
    from hstap.engines.vllm_runner import configured_runner

    longest = max(len(p) for p in prompts) + max_new + 8
    llm = start_llm(target, dtype, device, longest, speculative_config=spec, seed=seed, disable_log_stats=False)
    runner = configured_runner(getattr(llm.llm_engine, "vllm_config", None))
    try:
        params = SamplingParams(max_tokens=max_new, temperature=temperature, stop_token_ids=list(eos), seed=seed)
        before = counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = counters(llm)
    finally:
        stop_llm(llm)
    diff = {k: (after[k] - before.get(k, 0)) if k in COUNTERS else
            [a - b for a, b in zip(after[k], before.get(k, [0] * len(after[k])))] for k in after}
    return [list(o.outputs[0].token_ids) for o in outs], wall, diff, runner


def run_vllm(target: str, decode: Decoding, device: str, prompts: list[tuple[str, list[int]]], eos: list[int],
             drafter_dir: str, dtype: str) -> dict:
    """Both vLLM runs (module docstring) of `target` with the drafter in `drafter_dir` (`vllm_drafter_dir`), decoding
    as `decode` asks (--k, --max-new-tokens, --temperature, --seed) on `device` (--device); returns the report's `vllm`
    block."""
    from hstap.device import auto_device
    from hstap.engines.vllm import eagle3_config, require_vllm

    require_vllm("--engine vllm")
    import vllm

    d, k = drafter_dir, decode.k
    device = auto_device(device).partition(":")[0]  # "cuda" or "cpu", as the target was loaded
    ids = [p for _, p in prompts]
    run = (target, dtype, ids, decode.max_new_tokens, decode.temperature, eos, decode.seed)
    print(f"hstap eval: vLLM {vllm.__version__}: target only, then EAGLE-3 with {d} (k={k})", file=sys.stderr)
    ref, t_ref, _, _ = _run(*run, None, device)
    outs, t_spec, c, runner = _run(*run, eagle3_config(d, k), device)
    drafts, accepted = c.get(COUNTERS[0], 0), c.get(COUNTERS[2], 0)
    per_pos = c.get(PER_POS, [])
    new_ref, new_spec = sum(map(len, ref)), sum(map(len, outs))
    return {
        "version": vllm.__version__, "model_runner": runner, "drafter_dir": str(d), "k": k, "batched_prompts": len(ids),
        "drafts": drafts, "draft_tokens": c.get(COUNTERS[1], 0), "accepted": accepted, "accepted_per_pos": per_pos,
        "tau": 1 + accepted / drafts if drafts else 0.0,
        "per_position_acceptance": [a / drafts if drafts else 0.0 for a in per_pos],
        "target_tokens_per_s": new_ref / t_ref if t_ref > 0 else 0.0,
        "tokens_per_s": new_spec / t_spec if t_spec > 0 else 0.0,
        "speedup": (new_spec / t_spec) / (new_ref / t_ref) if t_spec > 0 and t_ref > 0 and new_ref else 0.0,
        "lossless": ([a == b for a, b in zip(ref, outs)].count(False) == 0) if decode.temperature == 0 else None,
        "outputs": outs, "target_outputs": ref,
    }


def agreement(v: dict, eagle: dict, hstap_outputs: list[list[int]]) -> dict:
    """vLLM's counters against hstap's decoder on the same prompts: rounds, accepted tokens by position, outputs."""
    counts = eagle.get("accept_counts") or []
    return {"drafts_equal": v["drafts"] == eagle.get("verify_forwards"),
            "accepted_per_pos_equal": list(v["accepted_per_pos"]) == list(counts),
            "hstap_rounds": eagle.get("verify_forwards"), "hstap_accept_counts": counts,
            "hstap_one_plus_accepted": 1 + sum(counts) / eagle["verify_forwards"] if eagle.get("verify_forwards") else 0.0,
            "outputs_equal_hstap": sum(a == b for a, b in zip(v["outputs"], hstap_outputs)),
            "prompts": len(hstap_outputs)}
