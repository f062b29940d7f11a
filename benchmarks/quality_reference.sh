#!/usr/bin/env bash
# Quality run on the reference target, one GPU: regenerate the corpus answers with the target itself (hstap generate,
# greedy, fp32), prepare -> capture (train + eval splits) -> train the EAGLE-3 drafter and the EAGLE-1-style baseline
# side by side on the same GPU -> speculative decoding on eval prompts (a process per method, side by side on the
# GPU: their tau and acceptance are exact, their tokens/s are not a clean timing).
#   REF=../shared/reference OUT=/tmp/out bash benchmarks/quality_reference.sh
# Env: EPOCHS (3) or STEPS, LR (1e-3), NEWTOK (256: max tokens of a regenerated training answer), NT (128: new tokens per eval
# prompt, also the eval split's regeneration length, so that the simulated tau sees the same answers), NP (48 eval
# prompts per method), NPC (160: prompts of the EAGLE-3 chain, split over 4 processes), GEN_BS (768), MAXS (use only the first N conversations of each split), DEV (cuda; cpu for a smoke run),
# stage timeouts TG TT TE (s). REGEN=DIR reuses regen-{train,eval}.jsonl.gz from an earlier run.
# MIX=1 also trains on the corpus's own train answers (ids prefixed "orig-"; labels are still the target's
# distribution, from its captured final state). BASELINE=0 skips the EAGLE-1-style drafter (training and eval).
# LAYERS=1,3,6 captures (and trains EAGLE-3 on) other aux layers than the default [1, N//2-1, N-4].
# A stage cut by its timeout keeps what it finished: generate output is resumable, training keeps its best checkpoint.
set -uo pipefail
REF=${REF:-../shared/reference}; OUT=${OUT:-/tmp/hstap-quality-out}; W=${W:-/dev/shm/hq}
DEV=${DEV:-cuda}; EPOCHS=${EPOCHS:-3}; LR=${LR:-1e-3}; NEWTOK=${NEWTOK:-256}; NT=${NT:-128}; NP=${NP:-48}; NPC=${NPC:-160}; GEN_BS=${GEN_BS:-768}
H="python3 -m hstap.cli"; T=$REF/target-tiny
(( NPC % 4 == 0 )) || { echo "NPC=$NPC: must be a multiple of 4 (4 processes share the EAGLE-3 chain prompts)"; exit 2; }
mkdir -p "$OUT"; rm -rf "$W"; mkdir -p "$W"; rm -f "$OUT/eval.jsonl"
t0=$(date +%s); stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }

stamp "regenerate answers (greedy fp32, <= $NEWTOK tokens train / $NT eval)"
for split in train eval; do
  if [ -n "${REGEN:-}" ] && [ -f "$REGEN/regen-$split.jsonl.gz" ]; then
    gunzip -c "$REGEN/regen-$split.jsonl.gz" > "$W/regen-$split.jsonl"; continue
  fi
  n=$NEWTOK; [ $split = eval ] && n=$NT
  timeout "${TG:-170}" $H generate --target $T --data $REF/corpus/$split.jsonl.gz --out "$W/regen-$split.jsonl" \
    --device $DEV --dtype fp32 --batch-size "$GEN_BS" --max-new-tokens $n ${MAXS:+--max-samples $MAXS} 2>&1 | grep -v "^generate:" | tail -2
  # a cut run may leave a torn last line: drop it (what generate's resume does)
  python3 -c "from hstap.data.generate import recover_output as r; print(len(r('$W/regen-$split.jsonl')), 'records')"
  gzip -1 -c "$W/regen-$split.jsonl" > "$OUT/regen-$split.jsonl.gz"
done

stamp prepare
extra=""
if [ "${MIX:-0}" != 0 ]; then
  python3 - "$REF/corpus/train.jsonl.gz" "$W/orig-train.jsonl" <<'PY'
import gzip, itertools, json, os, sys
with gzip.open(sys.argv[1], "rt") as f, open(sys.argv[2], "w") as out:
    for line in itertools.islice(f, int(os.environ.get("MAXS") or 0) or None):  # MAXS: as for the regenerated split
        r = json.loads(line)
        r["id"] = f"orig-{r['id']}"
        out.write(json.dumps(r) + "\n")
PY
  [ $? = 0 ] || exit 1
  extra="$W/orig-train.jsonl"
fi
$H prepare --tokenizer $T --data "$W/regen-train.jsonl" $extra --out $W/prep --draft-vocab 8192 --num-proc 8 | tail -3
$H prepare --tokenizer $T --data "$W/regen-eval.jsonl" --out $W/prep-eval --draft-vocab 8192 --num-proc 4 | tail -1
stamp capture
$H capture --target $T --data $W/prep --out $W/store --device $DEV ${LAYERS:+--layers $LAYERS} --compute-dtype fp32 \
  --batch-tokens 65536 | tail -3
$H capture --target $T --data $W/prep-eval --out $W/store-eval --device $DEV ${LAYERS:+--layers $LAYERS} --compute-dtype fp32 \
  --batch-tokens 65536 | tail -1

sched="--epochs $EPOCHS"; [ -n "${STEPS:-}" ] && sched="--steps $STEPS"
stamp "train EAGLE-3 (and the EAGLE-1-style drafter side by side unless BASELINE=0): $sched, lr $LR"
common="--store $W/store --eval-store $W/store-eval --target $T --vocab-map $W/prep $sched --lr $LR \
  --batch-tokens ${BT:-32768} --device $DEV --eval-every ${EV:-100} --save-every ${EV:-100} --log-every 50 --keep 2"
timeout "${TT:-240}" $H train $common --out $W/run-eagle3 --ttt 7 --ttt-decay 0.8 --loss ce > $W/train-eagle3.log 2>&1 &
runs="eagle3"
if [ "${BASELINE:-1}" != 0 ]; then
  timeout "${TT:-240}" $H train $common --out $W/run-eagle1 --aux-layers final --ttt 1 > $W/train-eagle1.log 2>&1 &
  runs="eagle3 eagle1"
fi
wait
for r in $runs; do
  grep -E "^(hstap|step)" $W/train-$r.log | tail -4
  cp $W/run-$r/metrics.jsonl $OUT/run-$r.metrics.jsonl 2>/dev/null
done
python3 -c "import json; print('prepared train split:', json.load(open('$W/prep/meta.json'))['counts'])"

stamp "eval (greedy fp32, <= $NT new tokens; EAGLE-3 chain on $NPC prompts in 4 processes, the rest on $NP; one process per method)"
base=""; methods="eagle3-tree ngram"
if [ "${BASELINE:-1}" != 0 ]; then base="--baseline-drafter $W/run-eagle1"; methods="eagle3-tree baseline-chain baseline-tree ngram"; fi
ev="python3 benchmarks/bench_eval.py --target $T --drafter $W/run-eagle3 $base \
  --data $W/prep-eval --max-new-tokens $NT --device $DEV --dtype fp32 --k 5 --tree 8,6,60"
export OMP_NUM_THREADS=2  # 6-8 batch-1 decoders side by side: each is one Python thread launching small kernels
q=$((NPC / 4)); pids=()
for i in 0 1 2 3; do
  timeout "${TE:-200}" $ev --methods eagle3-chain --num-prompts $q --prompt-offset $((i * q)) > $W/eval-c$i.log 2>&1 &
  pids+=($!)
done
for m in $methods; do
  timeout "${TE:-200}" $ev --methods $m --num-prompts $NP > $W/eval-$m.log 2>&1 & pids+=($!)
done
wait "${pids[@]}"
for f in $W/eval-*.log; do
  grep -iE "violation|Traceback|Error" $f | tail -2; tail -1 $f | grep '^{' >> $OUT/eval.jsonl || echo "no result: $f"
done
python3 - "$OUT/eval.jsonl" <<'PY'
import json, sys
agg, sims = {}, {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    sims.update({k: v for k, v in r.get("simulated", {}).items()})
    for name, m in r["results"].items():
        a = agg.setdefault(name, {"f": 0, "tok": 0.0, "acc": None, "p": 0, "tps": []})
        f = m["verify_forwards"]
        a["f"] += f; a["tok"] += m["tau"] * f; a["p"] += r["prompts"]; a["tps"].append(m["tokens_per_s"])
        if m.get("per_position_acceptance"):
            acc = [x * f for x in m["per_position_acceptance"]]
            a["acc"] = acc if a["acc"] is None else [x + y for x, y in zip(a["acc"], acc)]
print(f"{'method':16s} {'prompts':>7s} {'tau':>6s}  acceptance by position   (target rows: every process's own)")
out = {}
for name, a in agg.items():
    tau = a["tok"] / a["f"]; acc = [round(x / a["f"], 3) for x in a["acc"]] if a["acc"] else []
    out[name] = {"prompts": a["p"], "tau": round(tau, 4), "per_position_acceptance": acc, "verify_forwards": a["f"]}
    print(f"{name:16s} {a['p']:7d} {tau:6.3f}  {' '.join(f'{x:.2f}' for x in acc)}")
s = sims.get("eagle3", {})
if s.get("chain_tau") and "eagle3-chain" in out:
    d = s["chain_tau"] / out["eagle3-chain"]["tau"] - 1
    print(f"EAGLE-3 chain-5: simulated {s['chain_tau']:.3f} (training eval, step {s['step']}) vs measured "
          f"{out['eagle3-chain']['tau']:.3f} on {out['eagle3-chain']['prompts']} prompts: {100 * d:+.1f}%")
    out["sim_vs_measured_eagle3_chain"] = d
for d in ("chain", "tree"):
    if f"eagle3-{d}" in out and f"baseline-{d}" in out:
        out[f"eagle3_over_baseline_{d}"] = out[f"eagle3-{d}"]["tau"] / out[f"baseline-{d}"]["tau"]
print(json.dumps({"bench": "quality_reference", "merged": out, "simulated": sims}))
PY
stamp done
