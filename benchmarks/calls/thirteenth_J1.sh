#!/usr/bin/env bash
# Call J1 (thirteenth session, issue #29): the target's greedy answers as the eleventh session's call C made them
# (fp32, batches of 768, <= 256 / 128 new tokens), then train's defaults (base) and the defaults before
# (defaults-42f1a69) trained side by side at the budget with benchmarks/quality_variants.py (T0=0: train and
# replay only); the two runs and the eval prompt parts come back under $OUT for call J2 (temperature 1, tree).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, transformers, datasets; print(torch.__version__, transformers.__version__, datasets.__version__)"
R=.carry/reference; G=/dev/shm/regen; mkdir -p $G; t0=$SECONDS
if [ ! -s $G/regen-eval.jsonl ] || ! grep -q 'conversations written' /tmp/gen-train.log; then
python3 -m hstap.cli generate --target $R/target-tiny --data $R/corpus/train.jsonl.gz --out $G/regen-train.jsonl \
  --max-new-tokens 256 --device cuda --dtype fp32 --batch-size 768 > /tmp/gen-train.log 2>&1 &
python3 -m hstap.cli generate --target $R/target-tiny --data $R/corpus/eval.jsonl.gz --out $G/regen-eval.jsonl \
  --max-samples 160 --max-new-tokens 128 --device cuda --dtype fp32 --batch-size 768 > /tmp/gen-eval.log 2>&1 &
wait; fi
echo "generate: $((SECONDS - t0)) s"; wc -l $G/*.jsonl; tail -n 3 /tmp/gen-train.log /tmp/gen-eval.log
gzip -c $G/regen-train.jsonl > $OUT/regen-train.jsonl.gz &
t1=$SECONDS
REF=$R REGEN=$G OUT=/tmp/qvJ1 W=/dev/shm/hqv VARIANTS=base,defaults-42f1a69 MEASURE=base,defaults-42f1a69 T0=0 \
  NP=160 EP=8 PAR=2 STAGGER=45 TT=300 python3 benchmarks/quality_variants.py > $OUT/qv.log 2>&1
echo "quality_variants: rc $? in $((SECONDS - t1)) s"; grep "^== " $OUT/qv.log
cp /tmp/qvJ1/variants.json $OUT/ 2>/dev/null
cd /dev/shm/hqv && cp $G/regen-eval.jsonl . && tar cf /tmp/runs.tar regen-eval.jsonl qv_data.json prep-eval* run-*.cmd.json run-base/best run-base/config.json \
  run-base/metrics.jsonl run-defaults-42f1a69/best run-defaults-42f1a69/config.json run-defaults-42f1a69/metrics.jsonl \
  && split -b 15M /tmp/runs.tar $OUT/runs.tar.part- ; ls -la /tmp/runs.tar
wait; cat /tmp/gen-train.log /tmp/gen-eval.log >> $OUT/qv.log; ls -la $OUT
python3 -c "
import json; v = json.load(open('/tmp/qvJ1/variants.json'))['variants']
for n, r in v.items(): print(n, {k: r.get(k) for k in ('rc', 'steps', 'val_chain5', 'eval_chain5', 'train_tok_s')})"
