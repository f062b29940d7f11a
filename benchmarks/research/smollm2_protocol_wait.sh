#!/usr/bin/env bash
# Waits (at most $1 seconds) for the detached pipeline of smollm2_protocol.sh beside it, printing its log as it grows;
# then copies what it produced so far into OUT/r.tgz (OUT: a results directory, default ./runs/smollm2-protocol;
# results, log tails, eval and store figures, the drafter's metrics, the speculators runs' summaries).
P=${P:-/root/p}; lim=${1:-540}; t=0; OUT=${OUT:-$PWD/runs/smollm2-protocol}
while [ $t -lt $lim ] && ! grep -q "^== done" $P/pipeline.log 2>/dev/null; do sleep 10; t=$((t + 10)); done
cut -c1-400 $P/pipeline.log
mkdir -p $OUT/r
cp $P/res/* $OUT/r/ 2>/dev/null
for f in $P/log/*.log; do tail -c 20000 $f > $OUT/r/$(basename $f); done
cp /dev/shm/p/run/metrics.jsonl $OUT/r/run-metrics.jsonl 2>/dev/null
cp /dev/shm/p/peer-*/summary.json $OUT/r/ 2>/dev/null; for c in default hstap; do
  cp /dev/shm/p/peer-$c/summary.json $OUT/r/peer-$c.json 2>/dev/null; done
cd $OUT/r && tar czf ../r.tgz . && cd .. && rm -rf r; ls -la $OUT
