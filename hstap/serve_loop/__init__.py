"""Train as you serve (`hstap serve-loop`): a live vLLM serves with an EAGLE-3 drafter and taps what it serves into a
store, `hstap train --follow` trains on that store beside it, and the drafter it reaches is loaded into the running
server.

`stage.py` is `hstap serve-loop` (the processes it starts, the loop), `config.py` its config, `plan.py` what it resolves
from the config and its inputs once, before anything is written (OUT/plan.json); `requests.py` the request stream
against the server and vLLM's per-request counters; `updates.py` the drafter updates between answers (gate, export,
reload, check, rollback); `gate.py` the held-back samples, the drafters' scores on them and the reload check;
`report.py` the summary; `worker.py` hstap's methods inside vLLM's workers (`--worker-extension-cls`): the drafter
reloaded in place, the tap beside EAGLE-3 started.
"""
