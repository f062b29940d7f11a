"""MT-bench measurement of drafters side by side (the real-model protocol's table): `hstap eval` over MT-bench's turn-1 prompts and
its turn-2 conversations (the target's own first answer in them), in parts run as parallel processes, merged.

    python benchmarks/research/protocol_eval.py --target M --work W --turn1 mtbench_turn1.jsonl \
        --turn2 mtbench_turn2.jsonl --hstap RUN --peers PEER_OUT[,PEER_OUT...] --out eval.json --parallel 16
    python benchmarks/research/protocol_eval.py --tiny  # CPU smoke run: a toy target and drafter (figures mean nothing)

Drafters: hstap's training run (RUN/best), and of the speculators runs (peer_speculators.py output dirs)
the one whose summary.json has the highest validation chain tau (never chosen on MT-bench). Settings (--settings):
hstap's drafter at chain k=5 and eval's default tree (8 x depth 6, 60 nodes), each greedy (temperature 0: lossless
checked token for token) and at temperature 1 (lossless rejection sampling; prompt i of a part samples with seed i,
the same for every drafter); the peer's
at chain k=5 and tree, greedy. Each (drafter, setting, turn) is split into parts of --part prompts, one `hstap eval`
process per part (--parallel at a time, one CPU thread each). The engine: the fast one with its steps captured in CUDA
graphs uncompiled (`hstap eval --no-compile`: seconds of set-up per method where SmolLM2's compile takes minutes; tau
does not depend on speed) or --engine eager (the CPU's; seen on the H200: 16 eager processes of 10 prompts each ran
past 110 s). Tree at temperature 1 runs the eager decoder in either (EAGLE-2's sampling rules are not on the device):
its parts start first.

Merged per (drafter, setting, turn) and over both turns: tau = tokens produced by verify forwards / verify forwards
(the bonus token included), per-position acceptance = rounds whose accepted draft reached position i / rounds,
lossless (all parts), prompts measured, parts that failed or ran past --limit (left out of tau). Prints a table, then ONE JSON line. The baseline of the table is the peer's
drafter in the same run: the ratio column is hstap's tau over the peer's at the same setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"chain-t0": ["--mode", "chain", "--k", "5"], "chain-t1": ["--mode", "chain", "--k", "5", "--temperature",
                                                                       "1.0"],
            "tree-t0": ["--mode", "tree"], "tree-t1": ["--mode", "tree", "--temperature", "1.0"]}


def split(path: Path, part: int, out: Path) -> list[Path]:
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    files = []
    for i in range(0, len(lines), part):
        f = out / f"{path.stem}.part{i // part:02d}.jsonl"
        f.write_text("\n".join(lines[i:i + part]) + "\n")
        files.append(f)
    return files


def best_peer(peers: list[str]) -> tuple[str | None, dict]:
    """The peer run with the highest validation chain tau, and what was compared."""
    seen = {}
    for p in peers:
        f = Path(p) / "summary.json"
        if not f.is_file():
            continue
        s = json.loads(f.read_text())
        for name, c in s["configs"].items():
            seen[name] = {"val_chain_tau": c["val_chain_tau"][-1], "drafter": c["drafter"]}
    if not seen:
        return None, {}
    name = max(seen, key=lambda n: seen[n]["val_chain_tau"])
    return name, seen


def run_all(jobs: list[tuple[list[str], Path]], parallel: int, limit: float) -> list[int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def one(job):
        cmd, log = job
        with open(log, "wb") as f:
            try:
                return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                return 124

    with ThreadPoolExecutor(parallel) as ex:
        return list(ex.map(one, jobs))


def merge(dirs: list[Path]) -> dict:
    tok = rounds = prompts = failed = 0
    counts = None
    lossless: bool | None = True
    for d in dirs:
        f = d / "report.json"
        if not f.is_file():
            lossless, failed = None, failed + 1
            continue
        r = json.loads(f.read_text())
        e = r["methods"]["eagle"]
        tok += e["tau"] * e["verify_forwards"]
        rounds += e["verify_forwards"]
        prompts += r["num_prompts"]
        c = e.get("accept_counts") or []
        counts = list(c) if counts is None else [a + b for a, b in zip(counts, c)]
        ok = r.get("lossless")
        lossless = None if lossless is None or ok is None else bool(lossless and ok)
    return {"tau": round(tok / rounds, 4) if rounds else None, "rounds": rounds, "prompts": prompts,
            "per_position_acceptance": [round(c / rounds, 4) for c in counts or []] if rounds else None,
            "lossless": lossless, "failed_parts": failed}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--work", help="work directory (prompt parts, eval reports, logs)")
    ap.add_argument("--turn1")
    ap.add_argument("--turn2")
    ap.add_argument("--hstap", help="hstap's training run")
    ap.add_argument("--peers", default="", help="comma list of peer_speculators.py output dirs")
    ap.add_argument("--out", help="merged results (JSON)")
    ap.add_argument("--settings", default="chain-t0,chain-t1,tree-t0,tree-t1")
    ap.add_argument("--peer-settings", default="chain-t0,tree-t0")
    ap.add_argument("--part", type=int, default=10, help="prompts per eval process")
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--limit", type=float, default=420.0, help="seconds per eval process")
    ap.add_argument("--engine", default="fast", choices=["fast", "eager"],
                    help="fast: CUDA graphs of the uncompiled steps (--no-compile); eager: drivers.py")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    if a.tiny:
        return tiny(a)
    W = Path(a.work) / "mtbench-eval"
    shutil.rmtree(W, ignore_errors=True)
    (W / "parts").mkdir(parents=True)
    parts = {"turn1": split(Path(a.turn1), a.part, W / "parts"), "turn2": split(Path(a.turn2), a.part, W / "parts")}
    peer, peers_seen = best_peer([p for p in a.peers.split(",") if p])
    drafters = {"hstap": (a.hstap, a.settings.split(","))}
    if peer is not None:
        drafters[f"speculators-{peer}"] = (peers_seen[peer]["drafter"], a.peer_settings.split(","))
    jobs, keys = [], []
    for name, (path, settings) in drafters.items():
        for s in settings:
            for turn, files in parts.items():
                for i, f in enumerate(files):
                    out = W / f"{name}-{s}-{turn}-{i:02d}"
                    jobs.append(([sys.executable, "-m", "hstap.cli", "eval", "--target", a.target, "--drafter", path,
                                  "--data", str(f), "--out", str(out), *SETTINGS[s], "--max-new-tokens",
                                  str(a.max_new_tokens), "--device", a.device, "--dtype", a.dtype, "--engine", a.engine,
                                  *(["--no-compile"] if a.engine == "fast" else [])],
                                 W / f"{name}-{s}-{turn}-{i:02d}.log"))
                    keys.append((name, s, turn, out))
    slow_first = sorted(range(len(jobs)), key=lambda j: keys[j][1] != "tree-t1")  # stable: otherwise as listed
    jobs, keys = [jobs[j] for j in slow_first], [keys[j] for j in slow_first]
    t0 = time.perf_counter()
    rcs = run_all(jobs, a.parallel, a.limit)
    res: dict = {"drafters": {n: p for n, (p, _) in drafters.items()}, "peer_validation": peers_seen,
                 "peer_chosen": peer, "max_new_tokens": a.max_new_tokens, "failed_parts": sum(rc != 0 for rc in rcs),
                 "seconds": round(time.perf_counter() - t0, 1), "rows": {}}
    for name, (_, settings) in drafters.items():
        for s in settings:
            dirs = {t: [k[3] for k in keys if k[:3] == (name, s, t)] for t in parts}
            row = {t: merge(d) for t, d in dirs.items()}
            row["both"] = merge(dirs["turn1"] + dirs["turn2"])
            res["rows"][f"{name} {s}"] = row
    print(f"{'drafter / setting':34s} {'turn 1':>7s} {'turn 2':>7s} {'both':>7s} {'ratio':>6s} lossless  failed  "
          "acceptance (both turns)")
    for key, row in res["rows"].items():
        name, s = key.rsplit(" ", 1)
        peer_row = res["rows"].get(f"speculators-{peer} {s}") if name == "hstap" else None
        ratio = (row["both"]["tau"] / peer_row["both"]["tau"]) if peer_row and peer_row["both"]["tau"] and \
            row["both"]["tau"] else None
        row["ratio_to_peer"] = round(ratio, 4) if ratio else None
        f = lambda v: f"{v:7.3f}" if isinstance(v, (int, float)) else f"{'-':>7s}"  # noqa: E731
        print(f"{key:34s} {f(row['turn1']['tau'])} {f(row['turn2']['tau'])} {f(row['both']['tau'])} "
              f"{f(ratio)[1:]} {str(row['both']['lossless']):8s}  {row['both']['failed_parts']:6d}  "
              f"{row['both']['per_position_acceptance']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return res


def tiny(a) -> dict:
    """A toy target, a 10-step hstap drafter, two prompts per turn file: the script's plumbing, on the CPU."""
    from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts

    tmp = Path(tempfile.mkdtemp(prefix="protocol-eval-"))
    tok = build_tokenizer(sample_texts()[:200], vocab_size=300)
    build_random_target(tmp / "target", tok, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2)
    conv = [{"id": f"c{i}", "conversations": [{"role": "user", "content": t[:80]}, {"role": "assistant",
                                                                                   "content": t[80:300]}]}
            for i, t in enumerate(sample_texts()[:24])]
    (tmp / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conv))
    h = [sys.executable, "-m", "hstap.cli"]
    for cmd in (["prepare", "--tokenizer", tmp / "target", "--data", tmp / "chats.jsonl", "--out", tmp / "prep",
                 "--draft-vocab", "256"],
                ["capture", "--target", tmp / "target", "--data", tmp / "prep", "--out", tmp / "store", "--layers",
                 "0,1,2", "--dtype", "fp32"],
                ["train", "--store", tmp / "store", "--target", tmp / "target", "--out", tmp / "run", "--steps", "4",
                 "--batch-tokens", "2048"]):
        subprocess.run([*h, *map(str, cmd)], check=True, capture_output=True)
    t1 = tmp / "t1.jsonl"
    t1.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": "what is json?"}]})
                          + "\n" for i in range(2)))
    t2 = tmp / "t2.jsonl"
    t2.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "what is json?"},
                                                                  {"role": "assistant", "content": "a format"},
                                                                  {"role": "user", "content": "and csv?"}]})
                          + "\n" for i in range(2)))
    return main(["--target", str(tmp / "target"), "--work", str(tmp), "--turn1", str(t1), "--turn2", str(t2),
                 "--hstap", str(tmp / "run"), "--settings", "chain-t0,tree-t1", "--part", "1", "--parallel", "2",
                 "--max-new-tokens", "8", "--device", "cpu", "--dtype", "fp32", "--out", str(tmp / "eval.json")])


if __name__ == "__main__":
    main()
