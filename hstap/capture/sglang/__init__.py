"""The SGLang engine: `hook.py` runs inside the server's logits processor and demultiplexes each prefill batch into
store samples, `writer.py` is its writer thread, `plugin.py` the `sglang.srt.plugins` entry point that turns aux
capture on without a draft model, `driver.py` the `hstap capture --engine sglang --server URL` side, and
`protocol.py` what the three agree on (environment names, request ids, the hook spec). None imports another."""
