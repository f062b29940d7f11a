"""The serving engines as hstap starts them: `vllm.py` an embedded `vllm.LLM` or a `vllm serve` process (V1's model
runner pinned) and the JSON configs hstap hands vLLM (EAGLE-3's speculative config, a KV connector's transfer config),
`vllm_runner.py` which of vLLM's model runners runs and what of hstap runs under each, `sglang.py` SGLang servers from
their own venv (.venv-sglang). What runs inside them (hooks, connectors, writers) lives with the stage that uses it
(`hstap.capture.sglang`, `hstap.capture.vllm`, `hstap.serve_loop.worker`).
"""
