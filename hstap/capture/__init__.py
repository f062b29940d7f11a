"""Capture: run the target over a prepared set inside an engine and write its aux + final states into a store.

`stage.py` is `hstap capture` (it reaches each engine by import), `config.py` its config; `inputs.py` what every
engine shares: the plan of a run (data against target, layers), the store to resume, the store header.
Each engine owns its capture loop: `hf.py` the embedded one (length-bucketed batched prefills, async device-to-host
copies staged by `staging.py`), `sglang/` a forward hook inside a real SGLang server and the driver that feeds it,
`vllm/` vLLM's own engine (hstap's KV connector inside vLLM, its driver, and the import of stock vLLM's files).
`session.py` (request ids, events, session ends) and `served.py` (the writer inside a server) are what the server
engines share; `tap.py` captures in the pass that generates (`hstap generate --capture`) and holds what the servers'
tap modes share. Engines depend on
`hstap.store`, never the reverse.
"""
