"""`hstap eval --engine sglang`: the drafter inside SGLang's own speculative decoding (EAGLE-3), next to hstap's decoder.

SGLang runs as two servers of the SGLang server venv (`hstap.engines.sglang`; `--sglang-python`), one after the other,
on the same target and dtype, with the radix cache off: without speculation, then with the drafter
(`--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR --speculative-num-steps K
--speculative-eagle-topk 1 --speculative-num-draft-tokens K+1`: a chain of --k drafts, hstap's --mode chain). Every
prompt goes to /generate as token ids, greedy, with hstap's stop ids (eos and end of turn), all at once as a server
batches them. What comes back:

- SGLang's own per-request counters of the speculative run (its /generate `meta_info`): `spec_verify_ct` (rounds:
  target verify forwards), `spec_num_correct_drafts` (drafts accepted) and `spec_correct_drafts_histogram` (rounds by
  drafts accepted, j = 0..K), from which accepted-by-position follows: position i accepted in the rounds that took
  more than i drafts. Summed over the prompts they compare with hstap's decoder (rounds, accept_counts); SGLang's tau
  here is 1 + accepted / rounds (hstap's tau; SGLang's own `spec_accept_length` also counts the prefill's token);
- whether SGLang's outputs with the drafter equal its outputs without it (lossless inside SGLang), and whether its
  outputs without the drafter equal hstap's target-only outputs (the same greedy target in two engines);
- tokens/s of both runs (batched: comparable with each other only).

On SGLang's generic CPU path (the only one that runs without a GPU, `hstap.engines.sglang.cpu_args`), sglang 0.5.23's
EAGLE-3 does not start: docs/engines.md ("SGLang's EAGLE-3 and `hstap eval --engine sglang`") has the file and line of
each blocker. The
target-only run still runs; the speculative server's own error line is reported (`speculative.error`, and the command
then stops with it, after writing the report).

The drafter directory SGLang gets: an SGLang export (its `eagle_config` ids say which layers SGLang taps), or, for an
hstap drafter or training run, an SGLang export written now into REPORT/sglang-drafter (eval dtype).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hstap.common import HstapError
from hstap.speculative.config import Decoding


def sglang_drafter_dir(drafter: str, sglang_python: str | None, out_dir: Path, dtype: str, num_layers: int) -> Path:
    """Before the long runs: the server venv's python exists (`sglang_python`: --sglang-python), and the directory
    SGLang loads as the drafter (module docstring; `drafter`: --drafter), refused when SGLang cannot tap its layers."""
    from hstap.layers import check_sglang_capturable, from_sglang
    from hstap.engines.sglang import server_python

    server_python(sglang_python)
    p = Path(drafter)
    if not ((p / "config.json").is_file() and (p / "model.safetensors").is_file()):
        from hstap.export.config import ExportConfig
        from hstap.export.stage import export

        p = out_dir / "sglang-drafter"
        export(ExportConfig(run=drafter, to="sglang", out=str(p), dtype=dtype, overwrite=True))
    conf = json.loads((p / "config.json").read_text())
    ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if conf.get("architectures") != ["LlamaForCausalLMEagle3"] or not ids:
        raise HstapError(f"{p / 'config.json'}: not an SGLang EAGLE-3 drafter (architectures LlamaForCausalLMEagle3 "
                         "with eagle_config.eagle_aux_hidden_state_layer_ids): export it with `hstap export --run RUN "
                         "--to sglang`")
    check_sglang_capturable(from_sglang(ids, conf.get("model_type", "llama")), num_layers, f"{p / 'config.json'}")
    return p


def _serve(python: str, target: str, log: Path, args: list[str], prompts: list[list[int]], max_new: int,
           temperature: float, eos: list[int], seed: int) -> tuple[list[dict], float, float, str]:
    """(answers, wall seconds, startup seconds, SGLang version) of one server over all prompts at once."""
    from hstap.engines.sglang import SGLangServer, generate

    with SGLangServer(python, target, log, args) as srv:
        version = str(srv.info().get("version"))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            answers = list(pool.map(lambda p: generate(srv.url, p, max_new, temperature, eos, seed), prompts))
        for a in answers:
            if not isinstance(a, dict) or not isinstance(a.get("output_ids"), list):
                raise ValueError(f"an answer without output_ids: {str(a)[:200]}")
        return answers, time.perf_counter() - t0, srv.startup_s or 0.0, version


def spec_counts(meta: dict, k: int) -> tuple[int, list[int]]:
    """(rounds, accepted by draft position 0..k-1) of one request from SGLang's meta_info."""
    hist = list(meta.get("spec_correct_drafts_histogram") or [])
    return int(meta.get("spec_verify_ct") or 0), [sum(hist[j] for j in range(i + 1, len(hist))) for i in range(k)]


def run_sglang(target: str, decode: Decoding, device: str, sglang_python: str | None,
               prompts: list[tuple[str, list[int]]], eos: list[int], drafter_dir: Path, dtype: str,
               hstap_outputs: dict[str, list[list[int]]], eagle: dict, out_dir: Path) -> dict:
    """Both SGLang runs (module docstring) of `target` on `device` (--device) with the servers of `sglang_python`
    (--sglang-python), decoding as `decode` asks (--k, --max-new-tokens, --temperature, --seed); returns the report's
    `sglang` block (per-prompt outputs under `outputs` and `target_outputs`, moved into the report's prompts by
    `attach`)."""
    from hstap.engines.sglang import launch_args, server_python, startup_error
    from hstap.device import auto_device

    python = server_python(sglang_python)
    device = auto_device(device).partition(":")[0]  # "cuda" or "cpu", as the target was loaded
    k, n, T, seed = decode.k, decode.max_new_tokens, decode.temperature, decode.seed
    ids = [p for _, p in prompts]
    base = [*launch_args(device, dtype), "--disable-radix-cache", "--random-seed", str(seed)]
    print(f"hstap eval: SGLang ({python}): target only, then EAGLE-3 with {drafter_dir} (k={k})", file=sys.stderr)
    run = (python, target)
    try:
        ref, t_ref, up_ref, version = _serve(*run, out_dir / "sglang-target.log", base, ids, n,
                                             T, eos, seed)
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        raise HstapError(f"--engine sglang: the SGLang server without speculation failed: {e}") from None
    target_out = [list(a["output_ids"]) for a in ref]
    new_ref = sum(map(len, target_out))
    block: dict = {
        "version": version, "python": python, "drafter_dir": str(drafter_dir), "k": k, "batched_prompts": len(ids),
        "target_startup_s": up_ref, "target_tokens_per_s": new_ref / t_ref if t_ref > 0 else 0.0,
        "target_equal_hstap": sum(a == b for a, b in zip(target_out, hstap_outputs["target"])),
        "target_outputs": target_out,
    }
    spec_log = out_dir / "sglang-eagle3.log"
    spec = [*base, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter_dir),
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]
    try:
        ans, t_spec, up_spec, _ = _serve(*run, spec_log, spec, ids, n, T, eos, seed)
    except (RuntimeError, OSError, ValueError, KeyError) as e:  # it did not start (its log's error line), or a
        # request failed
        error = startup_error(spec_log.read_text(errors="replace")) if isinstance(e, RuntimeError) else \
            f"a request failed: {e}"
        block["speculative"] = {"ran": False, "error": error, "log": str(spec_log), "device": device}
        return block
    outs = [list(a["output_ids"]) for a in ans]
    counts = [spec_counts(a.get("meta_info") or {}, k) for a in ans]
    rounds = sum(c[0] for c in counts)
    per_pos = [sum(c[1][i] for c in counts) for i in range(k)]
    new_spec = sum(map(len, outs))
    hstap_counts = eagle.get("accept_counts") or []
    block.update({
        "speculative": {"ran": True, "error": None, "log": str(spec_log), "device": device, "startup_s": up_spec},
        "rounds": rounds, "accepted": sum(per_pos), "accepted_per_pos": per_pos,
        "tau": 1 + sum(per_pos) / rounds if rounds else 0.0,
        "per_position_acceptance": [a / rounds if rounds else 0.0 for a in per_pos],
        "tokens_per_s": new_spec / t_spec if t_spec > 0 else 0.0,
        "speedup": (new_spec / t_spec) / block["target_tokens_per_s"] if t_spec > 0 and new_ref and t_ref > 0 else 0.0,
        "lossless": (outs == target_out) if T == 0 else None,
        "agreement": {"rounds_equal": rounds == eagle.get("verify_forwards"),
                      "accepted_per_pos_equal": per_pos == list(hstap_counts),
                      "hstap_rounds": eagle.get("verify_forwards"), "hstap_accept_counts": list(hstap_counts),
                      "outputs_equal_hstap": sum(a == b for a, b in zip(outs, hstap_outputs["eagle"])),
                      "prompts": len(ids)},
        "outputs": outs, "per_prompt": [{"rounds": c[0], "accepted_per_pos": c[1]} for c in counts],
    })
    return block


def attach(report: dict, block: dict) -> None:
    """Put the SGLang block into the report: per-prompt outputs and counters into `prompts`, the rest as `sglang`."""
    for i, entry in enumerate(report["prompts"]):
        entry["sglang_target_output_ids"] = block["target_outputs"][i]
        if "outputs" in block:
            entry["sglang_output_ids"] = block["outputs"][i]
            entry["sglang_counts"] = block["per_prompt"][i]
    report["sglang"] = {k: v for k, v in block.items() if k not in ("outputs", "target_outputs", "per_prompt")}


def check_ran(report: dict, out_dir: Path) -> None:
    """After the report is written: HstapError when SGLang's speculative server did not run (its error line)."""
    s = (report.get("sglang") or {}).get("speculative") or {}
    if s.get("ran") is False:
        where = " (SGLang's generic CPU path has no EAGLE-3: docs/engines.md)" if s.get("device") == "cpu" else ""
        raise HstapError(f"--engine sglang: SGLang's EAGLE-3 server did not run: {s.get('error')}{where}; log "
                         f"{s.get('log')}; {out_dir / 'report.json'} holds hstap's decoder and SGLang's target-only run")


def sglang_lines(s: dict | None) -> list[str]:
    """What `--engine sglang` measured inside SGLang, and whether it agrees with hstap's decoder."""
    if not s:
        return []
    n = s["batched_prompts"]
    lines = [f"SGLang {s['version']}, target only: {s['target_tokens_per_s']:.1f} tokens/s (batched), outputs equal "
             f"hstap's target-only decoding on {s['target_equal_hstap']}/{n} prompts"]
    sp = s.get("speculative") or {}
    if not sp.get("ran"):
        return lines + [f"SGLang EAGLE-3 (k={s['k']}): did not run: {sp.get('error')} (log {sp.get('log')})"]
    a = s["agreement"]
    yes = {True: "yes", False: "NO"}
    return lines + [
        f"SGLang EAGLE-3 (k={s['k']}): tau {s['tau']:.3f}, {s['rounds']} rounds, accepted by position "
        f"{s['accepted_per_pos']}, {s['tokens_per_s']:.1f} tokens/s (batched), lossless {yes.get(s['lossless'], '-')}",
        f"SGLang's counts equal hstap's decoder on the same prompts: rounds {yes[a['rounds_equal']]} "
        f"({s['rounds']} vs {a['hstap_rounds']}), accepted by position {yes[a['accepted_per_pos_equal']]}; outputs "
        f"equal hstap's on {a['outputs_equal_hstap']}/{a['prompts']} prompts"]
