"""The SGLang engine: `hook.py` runs inside the server's logits processor and demultiplexes each prefill batch into
store samples, `ranks.py` says which store rank a server process writes, `writer.py` is the hook's writer thread,
`tap.py` its tap mode (every client's requests, prefill and decode rows, stored when they finish; how requests end,
from SGLang's output streamer), `plugin.py` the `sglang.srt.plugins` entry point that turns aux capture on without a
draft model, `driver.py` the `hstap capture --engine sglang --server URL` side, and `protocol.py` what they agree on
(environment names, the hook spec). The hook, the plugin and the driver never import one another."""
