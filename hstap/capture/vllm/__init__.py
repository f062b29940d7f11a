"""The vLLM engine: `connector.py` is hstap's KV connector, loaded by vLLM (`kv_connector_module_path`) in its own
processes, with its writer thread in `writer.py`; `driver.py` is `hstap capture --engine vllm` (vLLM's LLM in-process,
or a `vllm serve` launched with the connector); `protocol.py` what the two sides agree on; `norm.py` the final norm of
vLLM's last slot; `importer.py` converts files written by stock vLLM's `extract_hidden_states` (or speculators);
`eagle_tap.py` is the tap beside EAGLE-3: a server that drafts with an EAGLE-3 drafter also stores the requests it
serves, from the aux and final states its target computes for the drafter, kept by request and position (the serve
loop's store)."""
