"""Call J2 (thirteenth session, issue #29): the runs trained in call J1, in J1's work dir W on the same (still warm)
machine, decoded with `hstap eval` through benchmarks/quality_variants.py's measure() (the calls that
`REUSE=1 T0=0 T1=... TREE=1` makes after its replay): chain k=5 with lossless rejection sampling at
temperature T1 over the NP eval prompts, then greedy with eval's default tree (8 x depth 6, 60 nodes); one JSON line.
Env: quality_variants' knobs (REF, W, VARIANTS, NP, EP, EPAR, NT, DEV, ENGINE, T1) plus TE1 / TET, the per-process
timeouts of the two stages (s)."""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import quality_variants as qv  # noqa: E402

s = qv.settings(False)
W, names, t0 = Path(s["W"]), s["names"], time.time()
out = {"bench": "callJ2", "variants": {n: {} for n in names}, "settings": {k: s[k] for k in (
    "NP", "EP", "EPAR", "NT", "DEV", "ENGINE", "T1")}, "stages_s": {}}
stages = [("t1", s["T1"], "chain", int(os.environ.get("TE1", "330"))),
          ("tree", "", "tree", int(os.environ.get("TET", "200")))]
for key, temp, mode, te in stages:
    if key == "tree" and os.environ.get("TREE", "1") == "0":
        continue
    t = time.time()
    for n, m in qv.measure({**s, "TE": te}, W, names, temp, mode).items():
        out["variants"][n][key] = {k: m[k] for k in ("tau", "per_position_acceptance", "lossless", "prompts",
                                                      "complete", "rc", "accept_counts", "rounds", "tokens")}
        print(f"{key}: {n}: tau {m['tau']}, acceptance {m['per_position_acceptance']}, lossless {m['lossless']}, "
              f"prompts {m['prompts']}, complete {m['complete']}", file=sys.stderr, flush=True)
    out["stages_s"][key] = round(time.time() - t, 1)
b = out["variants"].get("base", {})
for n, v in out["variants"].items():
    for key in ("t1", "tree"):
        if v.get(key, {}).get("tau") and b.get(key, {}).get("tau"):
            v[key]["x_base"] = round(v[key]["tau"] / b[key]["tau"], 4)
out["duration_s"] = round(time.time() - t0, 1)
Path(os.environ.get("J2_JSON", "/tmp/callJ2.json")).write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out))
