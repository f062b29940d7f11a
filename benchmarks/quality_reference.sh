#!/usr/bin/env bash
# Quality run on the reference target, one GPU: regenerate the corpus answers with the target itself (hstap generate,
# greedy, fp32), prepare -> capture (train + eval splits) -> train the EAGLE-3 drafter and the EAGLE-1-style baseline
# side by side on the same GPU -> speculative decoding on eval prompts (3 processes: EAGLE-3, baseline, n-gram).
#   REF=../shared/reference OUT=/tmp/out bash benchmarks/quality_reference.sh
# Env: EPOCHS (3), LR (1e-3), NEWTOK (256: max tokens of a regenerated training answer), NT (128: new tokens per eval
# prompt, also the eval split's regeneration length, so that the simulated tau sees the same answers), NP (48 eval
# prompts), GEN_BS (768), MAXS (use only the first N conversations of each split), DEV (cuda; cpu for a smoke run),
# stage timeouts TG TT TE (s). REGEN=DIR reuses regen-{train,eval}.jsonl.gz from an earlier run.
# A stage cut by its timeout keeps what it finished: generate output is resumable, training keeps its best checkpoint.
set -uo pipefail
REF=${REF:-../shared/reference}; OUT=${OUT:-/tmp/hstap-quality-out}; W=${W:-/dev/shm/hq}
DEV=${DEV:-cuda}; EPOCHS=${EPOCHS:-3}; LR=${LR:-1e-3}; NEWTOK=${NEWTOK:-256}; NT=${NT:-128}; NP=${NP:-48}; GEN_BS=${GEN_BS:-768}
H="python3 -m hstap.cli"; T=$REF/target-tiny
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
  python3 -c "from hstap.generate import recover_output as r; print(len(r('$W/regen-$split.jsonl')), 'records')"
  gzip -1 -c "$W/regen-$split.jsonl" > "$OUT/regen-$split.jsonl.gz"
done

stamp prepare
$H prepare --tokenizer $T --data "$W/regen-train.jsonl" --out $W/prep --draft-vocab 8192 --num-proc 8 | tail -3
$H prepare --tokenizer $T --data "$W/regen-eval.jsonl" --out $W/prep-eval --draft-vocab 8192 --num-proc 4 | tail -1
stamp capture
$H capture --target $T --data $W/prep --out $W/store --device $DEV --compute-dtype fp32 --batch-tokens 65536 | tail -3
$H capture --target $T --data $W/prep-eval --out $W/store-eval --device $DEV --compute-dtype fp32 \
  --batch-tokens 65536 | tail -1

stamp "train EAGLE-3 and EAGLE-1-style side by side ($EPOCHS epochs, lr $LR)"
common="--store $W/store --eval-store $W/store-eval --target $T --vocab-map $W/prep --epochs $EPOCHS --lr $LR \
  --batch-tokens ${BT:-32768} --device $DEV --eval-every ${EV:-100} --save-every ${EV:-100} --log-every 50 --keep 2"
timeout "${TT:-240}" $H train $common --out $W/run-eagle3 --ttt 7 > $W/train-eagle3.log 2>&1 &
p3=$!
timeout "${TT:-240}" $H train $common --out $W/run-eagle1 --aux-layers final --ttt 1 > $W/train-eagle1.log 2>&1 &
p1=$!
wait $p3; wait $p1
for r in eagle3 eagle1; do
  grep -E "^(hstap|step)" $W/train-$r.log | tail -4
  cp $W/run-$r/metrics.jsonl $OUT/run-$r.metrics.jsonl 2>/dev/null
done
python3 -c "import json; print('prepared train split:', json.load(open('$W/prep/meta.json'))['counts'])"

stamp "eval ($NP prompts, <= $NT new tokens, greedy fp32; 3 processes)"
ev="python3 benchmarks/bench_eval.py --target $T --drafter $W/run-eagle3 --baseline-drafter $W/run-eagle1 \
  --data $W/prep-eval --num-prompts $NP --max-new-tokens $NT --device $DEV --dtype fp32 --k 5 --tree 8,6,60"
timeout "${TE:-170}" $ev --methods eagle3-chain,eagle3-tree > $W/eval-eagle3.log 2>$W/eval-eagle3.err &
e3=$!
timeout "${TE:-170}" $ev --methods baseline-chain,baseline-tree > $W/eval-eagle1.log 2>$W/eval-eagle1.err &
e1=$!
timeout "${TE:-170}" $ev --methods ngram > $W/eval-ngram.log 2>$W/eval-ngram.err &
en=$!
wait $e3; wait $e1; wait $en
for r in eagle3 eagle1 ngram; do
  grep -v DEBUG $W/eval-$r.log | tail -6; grep -iE "error|violation|Traceback" $W/eval-$r.err | tail -3
  tail -1 $W/eval-$r.log >> $OUT/eval.jsonl
done
stamp done
