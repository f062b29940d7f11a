#!/usr/bin/env bash
# Quality run on the reference target (H200): prepare -> capture (train + eval splits) -> train EAGLE-3 and the
# EAGLE-1-style baseline -> quick chain eval. Results and drafters go to $OUT (the drafters are small).
#   REF=../shared/reference OUT=/tmp/out bash benchmarks/quality_reference.sh [steps] [baseline_steps]
set -uo pipefail
REF=${REF:-../shared/reference}; OUT=${OUT:-/tmp/hstap-quality-out}; W=${W:-/dev/shm/hq}
STEPS=${1:-2000}; BSTEPS=${2:-2000}
H="python3 -m hstap.cli"
mkdir -p "$OUT"; rm -rf "$W"; mkdir -p "$W"
t0=$(date +%s); stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
stamp prepare
$H prepare --tokenizer $REF/target-tiny --data $REF/corpus/train.jsonl.gz --out $W/prep --draft-vocab 8192 --num-proc 8 | tail -4
$H prepare --tokenizer $REF/target-tiny --data $REF/corpus/eval.jsonl.gz --out $W/prep-eval --draft-vocab 8192 --num-proc 4 | tail -2
stamp capture
$H capture --target $REF/target-tiny --data $W/prep --out $W/store --device cuda --batch-tokens 65536 | tail -3
$H capture --target $REF/target-tiny --data $W/prep-eval --out $W/store-eval --device cuda --batch-tokens 65536 | tail -2
stamp "train eagle3 ($STEPS steps)"
timeout ${T3:-210} $H train --store $W/store --eval-store $W/store-eval --target $REF/target-tiny --out $W/run-eagle3 \
  --vocab-map $W/prep --steps $STEPS --ttt 7 --lr ${LR:-8e-4} --batch-tokens 32768 --eval-every $((STEPS / 2)) \
  --save-every $((STEPS / 2)) --log-every 50 2>&1 | grep -E "^(hstap|step|train:.*100%)" | tail -6
stamp "train eagle1 baseline ($BSTEPS steps)"
timeout ${T1:-70} $H train --store $W/store --eval-store $W/store-eval --target $REF/target-tiny --out $W/run-eagle1 \
  --vocab-map $W/prep --aux-layers final --ttt 1 --steps $BSTEPS --lr ${LR:-8e-4} --batch-tokens 32768 \
  --eval-every $((BSTEPS / 2)) --save-every $((BSTEPS / 2)) --log-every 50 2>&1 | grep -E "^(hstap|step)" | tail -4
for r in run-eagle3 run-eagle1; do cp $W/$r/metrics.jsonl $OUT/$r.metrics.jsonl 2>/dev/null; done
cp $W/prep/meta.json $OUT/prep-meta.json
stamp "eval (${NP:-16} prompts, ${NT:-96} new tokens)"
timeout ${TE:-150} python3 benchmarks/bench_eval.py --target $REF/target-tiny --drafter $W/run-eagle3 \
  --baseline-drafter $W/run-eagle1 --data $W/prep-eval --num-prompts ${NP:-16} --max-new-tokens ${NT:-96} \
  --device cuda --dtype fp32 --k 5 --tree 8,6,60 2>&1 | grep -v DEBUG | tee $OUT/eval.log | tail -10
stamp done
