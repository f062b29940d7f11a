"""Capture: run the target over a prepared set inside an engine and write its aux + final states into a store.

`stage.py` is `hstap capture`: the config, the tokenizer and template checks, the store header, the table of engines.
Each engine owns its capture loop: `hf.py` the embedded one (length-bucketed batched prefills, async device-to-host
copies staged by `staging.py`), `sglang/` a forward hook inside a real SGLang server and the driver that feeds it,
`vllm/` vLLM's engine (the import of its extract_hidden_states files). Engines depend on `hstap.store`, never the
reverse.
"""
