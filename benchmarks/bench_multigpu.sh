#!/usr/bin/env bash
# Multi-GPU on 2 GPUs (NCCL), in one command: capture scaling + exactly-once merge on a Llama-3.1-8B-shaped random target,
# DDP / FSDP2 training equivalence on the reference target, drafter training scaling. Ends with ONE JSON line.
#
#   bash benchmarks/bench_multigpu.sh              # 2 GPUs (W=/dev/shm/mg); all stages need ~10 min on 2 H200s, so
#                                                  # the budget skips bt_fsdp (seen with N8B=512 BUDGET=545); then:
#   BT_ONLY=1 bash benchmarks/bench_multigpu.sh    # stage 4 alone (~4 min)
#   bash benchmarks/bench_multigpu.sh --tiny       # same stages on the CPU: 2 gloo processes, tiny shapes (~3 min)
#
# Stages (each prints "== NAME at +Ns"; a failing stage does not stop the later ones; the JSON lists failures):
#  make        benchmarks/make_random_target.py: random bf16 8B-shaped Llama (no tokenizer) + N8B x SEQ random tokens
#              (ref_prepare, CPU only, runs meanwhile: `hstap prepare` of the reference train split, draft vocab 8192)
#  cap1, cap2  capture on 1 GPU (CUDA_VISIBLE_DEVICES=0), then torchrun x2 into another store; tok/s = capture's own
#              rate (tokens / the capture loop's seconds, the slowest rank's), nothing else running
#  check8b     (CPU, while ref_capture runs) the 2-rank store: manifest.json and the reader hold every prepared id
#              exactly once, shards of both ranks, Store.verify() clean, 3 samples equal to the 1-GPU store's
#  ref_capture torchrun x2 capture of the reference train split; ref_check: exactly once, as above (verify: VERIFY_REF)
#  train_1gpu, train_ddp, train_fsdp   one seed, one global batch: 1 GPU --grad-accum 2, torchrun DDP, torchrun
#              --fsdp; logged loss compared step by step (max relative difference vs 1 GPU); tok/s = median of the
#              logged windows after the first (which holds the compilation)
#  bt_1gpu, bt_ddp, bt_fsdp   benchmarks/bench_train.py --no-baseline on 1 GPU, then torchrun x2 --dist ddp / fsdp
#              (weak scaling: 16384 tokens per rank); scaling = aggregate tok/s / 1-GPU tok/s
# Knobs (env): N8B SEQ CAP_BT REF_N (0 = whole train split) REF_MAXLEN REF_BT STEPS TRAIN_BT LOG_EVERY TTT LR
# BT_STEPS BT_WARMUP LOSS_TOL VERIFY_REF W REF PY; BUDGET = seconds for the whole script (a stage is skipped when fewer
# than MIN_STAGE s are left; each stage's timeout is cut to what is left); OUT = a directory (if set) that receives
# multigpu.log (every stage's full output), the three train metrics.jsonl and result.json (= the last line).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # keep: no NVLink multicast
[[ "${1:-}" == "--tiny" ]] && TINY=1
TINY=${TINY:-0}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO"  # hstap from this checkout, in torchrun's children too
PY=${PY:-python3}
REF=${REF:-../shared/reference}
TR="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
if [[ $TINY == 1 ]]; then
  W=${W:-/tmp/hstap-mg-tiny}; DEV=cpu; TF=--tiny; NP=2
  N8B=${N8B:-24}; SEQ=${SEQ:-64}; CAP_BT=${CAP_BT:-256}; REF_BT=${REF_BT:-4096}; REF_N=${REF_N:-64}
  REF_MAXLEN=${REF_MAXLEN:-256}; STEPS=${STEPS:-4}; TRAIN_BT=${TRAIN_BT:-512}; LOG_EVERY=${LOG_EVERY:-2}; TTT=${TTT:-3}
  BT_STEPS=${BT_STEPS:-3}; BT_WARMUP=${BT_WARMUP:-1}; LOSS_TOL=${LOSS_TOL:-1e-4}
  BUDGET=${BUDGET:-600}; VERIFY_REF=${VERIFY_REF:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  W=${W:-/dev/shm/mg}; DEV=cuda; TF=; NP=16
  N8B=${N8B:-384}; SEQ=${SEQ:-2048}; CAP_BT=${CAP_BT:-16384}; REF_BT=${REF_BT:-65536}; REF_N=${REF_N:-0}
  REF_MAXLEN=${REF_MAXLEN:-2048}
  STEPS=${STEPS:-80}; TRAIN_BT=${TRAIN_BT:-16384}; LOG_EVERY=${LOG_EVERY:-10}; TTT=${TTT:-7}
  BT_STEPS=${BT_STEPS:-6}; BT_WARMUP=${BT_WARMUP:-3}; LOSS_TOL=${LOSS_TOL:-0.01}
  BUDGET=${BUDGET:-525}; VERIFY_REF=${VERIFY_REF:-0}  # VERIFY_REF=1: Store.verify() of the 21 GB ref store (~15 s)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}  # the same in 1-process runs and in each torchrun child
fi
LR=${LR:-8e-4}; MIN_STAGE=${MIN_STAGE:-20}; BT_ONLY=${BT_ONLY:-0}
H="$PY -m hstap.cli"
rm -rf "$W"; mkdir -p "$W/logs" "$W/res"
: > "$W/status"
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }

# run NAME LIMIT_S CMD...: log to $W/logs/NAME.log, print its key lines, record "NAME rc seconds" in $W/status.
run() {
  local name=$1 lim=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) - 10 ))
  if (( left < MIN_STAGE )); then
    echo "== $name skipped (time budget: ${left}s left)"; echo "$name skipped 0" >> "$W/status"; return 99
  fi
  (( lim > left )) && lim=$left
  stamp "$name"
  echo "\$ $*" | sed "s#$W/#\$W/#g; s#$REPO/##g" | tee "$W/logs/$name.log"  # W= is printed at the start
  local s=$(date +%s)
  timeout -k 20 "$lim" "$@" >> "$W/logs/$name.log" 2>&1
  local rc=$?
  echo "$name $rc $(( $(date +%s) - s ))" >> "$W/status"
  grep -E '^(capture:|prepare:|prepared:|target:|hstap|exact TTT|check:|compare:)' "$W/logs/$name.log" | cut -c1-400
  if (( rc != 0 )); then
    echo "!! $name failed (rc $rc$( ((rc == 124)) && echo ", timed out after ${lim}s")); last lines of its log:"
    tail -n 15 "$W/logs/$name.log" | cut -c1-300
  fi
  return $rc
}
ok() { grep -q "^$1 0 " "$W/status"; }

# check_store NAME STORE PREPARED [OTHER_STORE]: exactly-once, both ranks, verify(); samples vs OTHER_STORE if given
check_store() {
  run "$1" 240 "$PY" - "$2" "$3" "${4:-}" <<'EOF'
import json, os, sys, time
import torch
from hstap.data.prepare import load_prepared
from hstap.store.reader import open_store
path, prep, other = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
want = [str(x) for x in load_prepared(prep).data.column("id").to_pylist()]
s = open_store(path)
merged = json.load(open(f"{path}/manifest.json"))["shards"]  # what rank 0's merge wrote (the reader adds parts too)
m_ids = [i for e in merged for i in e["ids"]]
ranks = sorted({int(e["rank"]) for e in s.manifest["shards"]})
res = {"store": path, "prepared": len(want), "store_samples": len(s), "merged_manifest_samples": len(m_ids),
       "duplicates": len(s.ids) - len(set(s.ids)), "manifest_duplicates": len(m_ids) - len(set(m_ids)),
       "missing": len(set(want) - set(s.ids)), "extra": len(set(s.ids) - set(want)),
       "manifest_equals_prepared": sorted(m_ids) == sorted(want), "ranks": ranks,
       "shards": len(s.manifest["shards"]), "tokens": sum(s.lengths)}
t1 = time.perf_counter()
verified = os.environ.get("VERIFY", "1") == "1"
problems = s.verify() if verified else []
res |= {"verified": verified, "verify_problems": problems[:5], "verify_s": round(time.perf_counter() - t1, 1)}
if other:  # the same samples captured by one process: equal states (batch composition may change bf16 rounding)
    o = open_store(other)
    diffs = []
    for sid in [s.ids[0], s.ids[-1], s.ids[len(s.ids) // 2]]:
        a, b = s[s.index_of(sid)], o[o.index_of(sid)]
        same_in = torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        d = max(float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-30))
                for k in ("aux", "final"))
        diffs.append(d if same_in else float("inf"))
    res["vs_1proc_max_rel_diff"] = max(diffs)
res["exactly_once"] = (res["store_samples"] == len(want) and res["duplicates"] == 0 and res["missing"] == 0
                       and res["extra"] == 0 and res["manifest_equals_prepared"] and res["manifest_duplicates"] == 0)
res["ok"] = res["exactly_once"] and ranks == [0, 1] and not problems and res.get("vs_1proc_max_rel_diff", 0) < 0.05
res["seconds"] = round(time.perf_counter() - t0, 1)
print(f"check: {path}: {len(s)} samples in {res['shards']} shards of ranks {ranks} for {len(want)} prepared; "
      f"dup {res['duplicates']}, missing {res['missing']}, extra {res['extra']}, manifest = prepared "
      f"{res['manifest_equals_prepared']}; verify: "
      + (f"{len(problems)} problem(s) in {res['verify_s']} s" if verified else "not run")
      + (f"; vs 1-process store max rel diff {res['vs_1proc_max_rel_diff']:.3g}" if other else ""))
print(json.dumps(res))
EOF
  [[ -f $W/logs/$1.log ]] && tail -n 1 "$W/logs/$1.log" > "$W/res/$1.json"
}

echo "bench_multigpu: tiny=$TINY W=$W N8B=$N8B SEQ=$SEQ CAP_BT=$CAP_BT STEPS=$STEPS TRAIN_BT=$TRAIN_BT TTT=$TTT" \
     "LR=$LR BT_STEPS=$BT_STEPS LOSS_TOL=$LOSS_TOL BUDGET=$BUDGET BT_ONLY=$BT_ONLY OMP_NUM_THREADS=$OMP_NUM_THREADS" \
     "git=$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +dirty)"
[[ $DEV == cuda ]] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
df -h "$W" | tail -1

HAVE_REF=0; [[ -d $REF/target-tiny && -f $REF/corpus/train.jsonl.gz ]] && HAVE_REF=1
if [[ $BT_ONLY != 1 ]]; then  # stages 1-3
# ---- 1: random 8B-shaped target + prepared random tokens; the reference train split is prepared meanwhile (CPU only,
# nothing measured runs at the same time)
if [[ $HAVE_REF == 1 ]]; then
  RDATA=$REF/corpus/train.jsonl.gz
  if (( REF_N > 0 )); then
    RDATA=$W/ref-subset.jsonl; gzip -dc "$REF/corpus/train.jsonl.gz" | head -n "$REF_N" > "$RDATA"
  fi
  run ref_prepare 150 $H prepare --tokenizer "$REF/target-tiny" --data "$RDATA" --out "$W/ref-prep" \
    --draft-vocab 8192 --num-proc "$NP" --max-len "$REF_MAXLEN" &
  BG_PREP=$!
fi
run make 300 "$PY" benchmarks/make_random_target.py $TF --target "$W/t8b" --data "$W/p8b" --samples "$N8B" --seq "$SEQ"

# ---- 2: capture, 1 process then 2
BG_CHECK=
if ok make; then
  CAP=(capture --target "$W/t8b" --data "$W/p8b" --device "$DEV" --batch-tokens "$CAP_BT")
  [[ -n ${BG_PREP:-} ]] && wait "$BG_PREP"  # nothing else on the CPU while capture is timed
  CUDA_VISIBLE_DEVICES=0 run cap1 240 $H "${CAP[@]}" --out "$W/s8b-1"
  run cap2 200 $TR -m hstap.cli "${CAP[@]}" --out "$W/s8b-2"
  if ok cap2; then  # CPU only: runs while the reference store is captured (nothing timed there is a goal)
    VERIFY=1 check_store check8b "$W/s8b-2" "$W/p8b" "$(ok cap1 && echo "$W/s8b-1")" &
    BG_CHECK=$!
  fi
fi

# ---- 3: reference target: 2-rank capture, 1 GPU / DDP / FSDP training
if [[ $HAVE_REF == 1 ]]; then
  wait "$BG_PREP"
  ok ref_prepare && run ref_capture 200 $TR -m hstap.cli capture --target "$REF/target-tiny" --data "$W/ref-prep" \
    --out "$W/ref-store" --device "$DEV" --batch-tokens "$REF_BT"
  [[ -n $BG_CHECK ]] && wait "$BG_CHECK"
  rm -rf "$W/s8b-1" "$W/s8b-2" "$W/t8b"  # RAM
  if ok ref_capture; then
    VERIFY=$VERIFY_REF check_store ref_check "$W/ref-store" "$W/ref-prep"
    TRN=(train --store "$W/ref-store" --target "$REF/target-tiny" --vocab-map "$W/ref-prep" --steps "$STEPS"
         --batch-tokens "$TRAIN_BT" --lr "$LR" --ttt "$TTT" --seed 0 --eval-frac 0 --save-every 1000000
         --log-every "$LOG_EVERY" --tensorboard false --device "$DEV")
    CUDA_VISIBLE_DEVICES=0 run train_1gpu 200 $H "${TRN[@]}" --grad-accum 2 --out "$W/run-1gpu"
    run train_ddp 200 $TR -m hstap.cli "${TRN[@]}" --out "$W/run-ddp"
    run train_fsdp 200 $TR -m hstap.cli "${TRN[@]}" --fsdp --out "$W/run-fsdp"
  fi
else
  echo "== reference stages skipped: $REF/target-tiny or $REF/corpus/train.jsonl.gz not found"
  echo "reference skipped 0" >> "$W/status"
  [[ -n $BG_CHECK ]] && wait "$BG_CHECK"
fi
rm -rf "$W/ref-store" "$W/s8b-1" "$W/s8b-2" "$W/t8b"
fi  # BT_ONLY

# ---- 4: 8B-shaped drafter training throughput, 1 GPU vs 2 (DDP, FSDP2)
BT=(benchmarks/bench_train.py $TF --no-baseline --steps "$BT_STEPS" --warmup "$BT_WARMUP")
CUDA_VISIBLE_DEVICES=0 run bt_1gpu 200 "$PY" "${BT[@]}"
run bt_ddp 220 $TR "${BT[@]}" --dist ddp
run bt_fsdp 220 $TR "${BT[@]}" --dist fsdp

# ---- 5: one JSON line
stamp report
W="$W" TINY="$TINY" LOSS_TOL="$LOSS_TOL" T0="$t0" "$PY" - <<'EOF' > "$W/res/final.json"
import json, os, re, statistics, time
W, tol = os.environ["W"], float(os.environ["LOSS_TOL"])
def log(n):
    try:
        return open(f"{W}/logs/{n}.log").read()
    except OSError:
        return ""
def last_json(n):
    for line in reversed(log(n).splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None
status = {}
for line in open(f"{W}/status"):
    n, rc, s = line.split()
    status[n] = {"rc": rc if rc == "skipped" else int(rc), "s": int(s)}
out = {"bench": "multigpu", "tiny": os.environ["TINY"] == "1", "stages": status,
       "failed": [n for n, v in status.items() if v["rc"] != 0]}
mk = last_json("make")
if mk:
    out["make"] = {k: mk.get("target", {}).get(k) for k in ("params", "gb", "init_s", "save_s", "device")}
def cap(n):  # "capture: 384 samples, 786432 tokens in 25.6 s on 2 process(es) (...): 30,700 tok/s; ..."
    m = re.search(r"^capture: (\d+) samples, (\d+) tokens in ([\d.]+) s on (\d+) process.*?: ([\d,]+) tok/s",
                  log(n), re.M)
    if not m:
        return None
    load = re.search(r"model load ([\d.]+) s, total ([\d.]+) s", log(n))
    return {"samples": int(m[1]), "tokens": int(m[2]), "seconds": float(m[3]), "procs": int(m[4]),
            "tok_s": float(m[5].replace(",", "")), "load_s": float(load[1]) if load else None,
            "total_s": float(load[2]) if load else None}
c1, c2 = cap("cap1"), cap("cap2")
out["capture"] = {"one_gpu": c1, "two_gpu": c2, "scaling": round(c2["tok_s"] / c1["tok_s"], 3) if c1 and c2 else None}
for n in ("check8b", "ref_check"):
    try:
        out[n] = json.load(open(f"{W}/res/{n}.json"))
    except (OSError, ValueError):
        out[n] = None
out["ref_capture"] = cap("ref_capture")
def metrics(run):
    try:
        rows = [json.loads(x) for x in open(f"{W}/{run}/metrics.jsonl") if x.strip()]
    except OSError:
        return None
    return [r for r in rows if not r.get("eval")]
runs = {n: metrics(f"run-{n}") for n in ("1gpu", "ddp", "fsdp")}
tr = {}
for n, rows in runs.items():
    if not rows:
        tr[n] = None
        continue
    tps = [r["tok_s"] for r in rows if "tok_s" in r]
    tr[n] = {"steps": rows[-1]["step"], "final_loss": rows[-1]["loss"], "tok_s": statistics.median(tps[1:] or tps),
             "tok_s_first_window": tps[0], "peak_mem_gb": rows[-1].get("peak_mem_gb"),
             "loss_by_step": {r["step"]: round(r["loss"], 5) for r in rows}}
base = runs["1gpu"]
for n in ("ddp", "fsdp"):
    if base and runs[n] and tr[n]:
        b = {r["step"]: r["loss"] for r in base}
        o = {r["step"]: r["loss"] for r in runs[n]}
        common = sorted(set(b) & set(o))
        rel = [abs(o[s] - b[s]) / abs(b[s]) for s in common]
        tr[n] |= {"compared_steps": len(common), "same_steps": set(b) == set(o),
                  "max_rel_loss_diff": max(rel) if rel else None, "first_rel_loss_diff": rel[0] if rel else None,
                  "tok_s_vs_1gpu": round(tr[n]["tok_s"] / tr["1gpu"]["tok_s"], 3)}
out["train"] = tr
bt = {n: last_json(f"bt_{n}") for n in ("1gpu", "ddp", "fsdp")}
dr = {}
for n, j in bt.items():
    if j and "exact" in j:
        e = j["exact"]
        dr[n] = {"world": j.get("world", 1), "step_s": round(e["step_s"], 4), "tok_s": round(e["tok_s"], 1),
                 "tok_s_per_rank": round(e.get("tok_s_per_rank", e["tok_s"]), 1), "mfu": round(e["mfu"], 4),
                 "warmup_s": round(e["warmup_s"], 1), "peak_gb": e["peak_gb"],
                 "global_batch_tokens": j.get("global_batch_tokens", j["batch_tokens"])}
for n in ("ddp", "fsdp"):
    if n in dr and "1gpu" in dr:
        dr[n]["scaling"] = round(dr[n]["tok_s"] / dr["1gpu"]["tok_s"], 3)
out["drafter"] = dr
def g(x):
    return None if x is None else bool(x)
sc = out["capture"]["scaling"]
ck = [out[n] for n in ("check8b", "ref_check") if out[n] is not None]
out["goals"] = {
    "capture_scaling_ge_1_9": g(sc is not None and sc >= 1.9) if sc is not None else None,
    "exactly_once_8b": g(out["check8b"]["ok"]) if out["check8b"] else None,
    "exactly_once_ref": g(out["ref_check"]["ok"]) if out["ref_check"] else None,
    **{f"loss_within_{tol:g}_{n}": (g(tr[n]["max_rel_loss_diff"] <= tol) if tr.get(n) and
                                     tr[n].get("max_rel_loss_diff") is not None else None) for n in ("ddp", "fsdp")},
    **{f"drafter_scaling_ge_1_8_{n}": (g(dr[n]["scaling"] >= 1.8) if n in dr and "scaling" in dr[n] else None)
       for n in ("ddp", "fsdp")},
}
out["total_s"] = int(time.time()) - int(os.environ["T0"])
print(json.dumps(out, separators=(",", ":")))
EOF
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  for n in 1gpu ddp fsdp; do cp "$W/run-$n/metrics.jsonl" "$OUT/train-$n.metrics.jsonl" 2>/dev/null; done
  cp "$W/res/final.json" "$OUT/result.json" 2>/dev/null
  for f in "$W"/logs/*.log; do echo "######## $(basename "$f")"; tail -c 2000000 "$f"; done > "$OUT/multigpu.log"
fi
cat "$W/res/final.json"
