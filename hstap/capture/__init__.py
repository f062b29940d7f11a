"""Capture: run the target over a prepared set inside an engine and write its aux + final states into a store.

`stage.py` is `hstap capture` (it imports the engine --engine names when it runs), `config.py` its config; `inputs.py`
what every engine shares: the plan of a run (`CapturePlan`: data against target, layers), the store to resume, the
store header. Each engine owns its capture loop: `hf/` the embedded one (length-bucketed batched prefills, async
device-to-host copies staged by `staging.py`; `profile.py` says where a pass's time goes, stage by stage), `sglang/` a
forward hook inside a real SGLang server and the driver that feeds it, `vllm/` vLLM's own engine (hstap's KV connector
inside vLLM, its driver, the import of stock vLLM's files, and the tap beside EAGLE-3). `writer_queue.py` is the queue
between each engine's producer and its writer thread (back-pressure, or never waiting for a tap); `session.py` (request
ids, events, session ends) and `served.py` (the writer inside a server) are what the server engines share; `tap.py`
captures in the pass that generates (`hstap generate --capture`) and holds what the servers' tap modes share. Engines
depend on `hstap.store`, never the reverse.
"""
