"""Speculative decoding and `hstap eval`: lossless chain and tree decoding with a drafter, measured.

`drivers.py` holds the eager drivers (chain, EAGLE-2 tree, target-only, n-gram lookup); `draft_tree.py` grows the draft
trees and their masks; `acceptance.py` is the acceptance rule (greedy and lossless rejection sampling). `fast.py` runs
the same drivers on static caches (`static_kv.py`) as fixed-shape steps (`fast_steps.py`, with tree construction and
acceptance on the device in `device_tree.py`), captured as CUDA graphs (`cudagraph.py`). `latency.py` predicts speedups
from measured round costs; `evaluate.py` is `hstap eval` (`config.py` its config, and the `Decoding` section the report
and the engines' halves take): tau, per-position acceptance, speedup, losslessness, with `report.py` its console table
and report.md, and `inputs.py` what it checks before anything loads (the drafter and the prompts against the target, the
report directory); `vllm.py` runs the drafter inside vLLM (`--engine vllm`), `sglang.py` inside SGLang servers
(`--engine sglang`).
"""
