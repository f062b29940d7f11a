#!/usr/bin/env bash
# Capture and decoding speed at the Llama-3.1-8B shape on one H200, each figure beside its own baseline in the same
# run, with where the time goes. Three parts of a few minutes each (~18 minutes for the three), run from the
# repository root, in this order:
#
#   bash benchmarks/gpu_speed.sh wheels         # for a GPU machine without datasets, dill and multiprocess and
#                                               # without a package index: their wheels into .whl/ on a machine with
#                                               # network access; copy .whl/ with the checkout (installed offline)
#   bash benchmarks/gpu_speed.sh capture        # ~5 min: the goal's passes (benchmarks/bench_capture.py)
#   bash benchmarks/gpu_speed.sh capture-where  # ~4.5 min: where the rest goes (CLI, trace, the mask sync)
#   bash benchmarks/gpu_speed.sh decode         # ~8 min: benchmarks/bench_decode.py, the 8B target and its spec loop
#   bash benchmarks/gpu_speed.sh all            # the three, one after the other
#   SMOKE=1 bash benchmarks/gpu_speed.sh all    # the same commands in their --tiny forms on the CPU (a minute or two)
#
# capture: the CUDA test of the zero-copy pipeline (tests/test_cuda.py -k zero_copy); then bench_capture.py, 512 x 2048
#   tokens a pass: the plain HF prefill of the batches (the baseline), the stores of 3 batches compared bitwise with
#   the pre-change gather path and with the last batch split, capture into /dev/shm (bf16) and into a local disk (bf16,
#   fp8; bf16 also with the last batch run one sample at a time: the drain after the last forward shrinks to one
#   sample's write), the prefill again (the baseline's spread). Goal: capture_disk_bf16.vs_prefill >= 0.99 (or its
#   tailsplit pass's, with bitwise equal stores); fp8 beside it says whether half the bytes close the disk's part.
# capture-where: the prefill and the bf16 /dev/shm pass again, then `hstap capture` itself (--cli: model load, cold
#   start, the CLI's own rate; needs `datasets`), a torch.profiler trace of 4 batches (capture_trace.json.gz) and the
#   prefill + /dev/shm capture without transformers' per-forward host sync (--ab-mask-sync).
#   Every capture pass says where its time goes (device stages from CUDA events, host stages per thread, the writer's
#   write/hash/fsync/commit, host syncs by site) and how its loss against the prefill splits (forward slower, demux +
#   convert, idle, drain, rest).
# decode: copy bandwidth, then target-only decoding of the random 8B-shaped bf16 target on the fast engine for each
#   BIG_VARIANTS variant (the first also eagerly: rate and equal tokens) and, right after the first, with the same
#   target and a random drafter, target-only + EAGLE chain k=5 on BIG_SPEC_VARIANTS (per round: draft, verify, host;
#   outputs checked against target-only, near-ties classified). Each step split against the bound (bytes read /
#   bandwidth): gemm, other kernels, gaps, host. Goal: >= 75% of the bound target-only (the goal's bound: every weight
#   over the datasheet's 4.8 TB/s, 299 tok/s) and per spec round (there counted strictly: the bytes the round reads).
#
# Results under $OUT (default ./runs/gpu-speed, ignored by git; each part writes at most 6 files): env.txt, <part>.json (the bench's JSON
# line), <part>.log, capture_trace.json.gz (capture-where), summary.txt; the summary is printed last.
# Environment: OUT, W (scratch, default /dev/shm/hstap-speed), DISK (a directory on the local disk, default
# /tmp/hstap-speed), SAMPLES (512), BIG_VARIANTS (cdt,fused+cdt), BIG_SPEC_VARIANTS (cdt), PART_S (500): each bench's
# time limit, inside which it prints what it measured (SIGTERM).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.." || exit 1
PART=${1:-all}
OUT=${OUT:-$PWD/runs/gpu-speed}
W=${W:-/dev/shm/hstap-speed}
DISK=${DISK:-/tmp/hstap-speed}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT" "$W" "$DISK"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

wheels() {  # the packages the prepared set (--cli) needs beyond the GPU requirements, for Python 3.12
  local v
  mkdir -p .whl
  for pkg in datasets dill multiprocess; do
    v=$(python3 -m pip show "$pkg" 2>/dev/null | awk '/^Version/{print $2}')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl "$pkg${v:+==$v}" || return 1
  done
  ls -l .whl
}

have_datasets() {  # import datasets, installing the wheels of .whl/ offline when it is missing
  python3 -c "import datasets" 2>/dev/null && return 0
  ls .whl/*.whl >/dev/null 2>&1 || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hstap-site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/hstap-site:$PYTHONPATH
  python3 -c "import datasets" 2>/dev/null
}

env_txt() {
  {
    date -u; git log -1 --format='%H %s' 2>/dev/null; git status --short 2>/dev/null | head -20
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
    nproc; free -g | head -2; df -h "$W" "$DISK" | tail -n +1
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

bench() {  # bench_capture.py under PART_S as part $1, the rest of the arguments its own
  local name=$1
  shift
  if [ "$SMOKE" = 1 ]; then
    set -- "$@" --tiny --shm-dir "$W" --sink-gb 0.02
  else
    set -- "$@" --samples "${SAMPLES:-512}" --no-json-baseline
  fi
  echo "== $name: python3 benchmarks/bench_capture.py $*"
  timeout "${PART_S:-500}" python3 benchmarks/bench_capture.py "$@" > "$W/$name.out" 2> "$W/$name.err"
  echo "$name rc $?"
  grep '^{' "$W/$name.out" | tail -n 1 > "$OUT/$name.json"
  { grep -v '^{' "$W/$name.out"; tail -n 60 "$W/$name.err"; } | tail -c 2000000 >> "$OUT/$name.log"
  grep -v '^{' "$W/$name.out" | tail -n 40
}

capture() {
  if [ "$SMOKE" != 1 ]; then  # the pipeline's zero-copy reuse of pinned buffers, on the GPU, before it is timed
    timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k zero_copy > "$OUT/capture.log" 2>&1
    echo "zero-copy CUDA test rc $? ($(tail -n 1 "$OUT/capture.log"))"
  fi
  bench capture --no-fp8 --disk-dir "$DISK" --disk-dtypes bf16,fp8 --disk-variants default,tailsplit --repeat-prefill
}

capture_where() {
  local cli="--cli"
  if ! have_datasets; then
    cli=""
    echo "gpu_speed: no \`datasets\` (offline wheels: bash benchmarks/gpu_speed.sh wheels): the CLI pass is left out"
  fi
  bench capture_where --no-fp8 $cli --trace-batches 4 --out-dir "$W" --ab-mask-sync
  [ -f "$W/capture_trace.json" ] && gzip -c "$W/capture_trace.json" > "$OUT/capture_trace.json.gz"
}

decode() {
  local args=(--big-variants "${BIG_VARIANTS:-cdt,fused+cdt}" --big-spec
              --big-spec-variants "${BIG_SPEC_VARIANTS:-cdt}" --k 5 --new-tokens 256)
  if [ "$SMOKE" = 1 ]; then
    args+=(--tiny --no-spec --variants base)
  else
    args+=(--no-spec --budget-s $(( ${DECODE_PART_S:-540} - 40 )))
  fi
  echo "== decode: python3 benchmarks/bench_decode.py ${args[*]}"
  timeout "${DECODE_PART_S:-540}" python3 benchmarks/bench_decode.py "${args[@]}" > "$W/decode.out" 2> "$W/decode.err"
  echo "decode rc $?"
  grep '^{' "$W/decode.out" | tail -n 1 > "$OUT/decode.json"
  { grep -v 'profiler_st' "$W/decode.err"; } | tail -c 2000000 > "$OUT/decode.log"
  grep -v 'profiler_st' "$W/decode.err" | tail -n 40
}

summary() {  # the figures the goals are about, from the JSON lines
  python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
d = load("decode.json")
for c in (load("capture.json"), load("capture_where.json")):
  if c:
    p = c["prefill"]
    print(f"capture ({c['device']}, {c['samples']} x {c['seq']} tokens a pass): plain prefill {p['tok_per_s']:,.0f} tok/s"
          + (f", again {c['prefill_again']['tok_per_s']:,.0f} (spread {100 * c['prefill_spread']:+.2f}%)"
             if "prefill_again" in c else ""))
    for k, v in c.items():
        if (k.startswith("capture_") or k == "cli") and isinstance(v, dict) and "vs_prefill" in v:
            loss = v.get("loss_vs_prefill") or {}
            split = ", ".join(f"{n} {100 * f:+.2f}%" for n, f in (loss.get("of_prefill") or {}).items())
            print(f"  {k:32s} {v['vs_prefill']:.3f}x" + (f" (until the GPU is done {v['vs_prefill_until_gpu_done']:.3f}x,"
                  f" drain {v['drain_s']:.2f} s)" if "drain_s" in v else f" (its own clock, load {v.get('load_s')} s)")
                  + (f"; lost: {split}" if split else "")
                  + f"; syncs on the launching thread {((v.get('profile') or {}).get('syncs') or {}).get('main_syncs')}")
    b = c.get("bytes_check") or {}
    print("  bytes vs the old gather: " + ", ".join(f"{k} {'equal' if x['equal'] else 'DIFFERENT'}" for k, x in b.items())
          + "; with the last batch split: " + ", ".join(f"{k} {'equal' if x['split_last_equal'] else 'DIFFERENT'}"
                                                       for k, x in b.items()))
    disk = c.get("capture_disk_bf16", {})
    if "vs_prefill" in disk:
        split = c.get("capture_disk_bf16_tailsplit", {}).get("vs_prefill")
        best = max(disk["vs_prefill"], split or 0.0)
        print(f"  goal capture -> disk bf16 >= 0.99x prefill: {'met' if best >= 0.99 else 'not met'} "
              f"({disk['vs_prefill']:.3f}x; last batch split {split}; fp8 {c.get('capture_disk_fp8', {}).get('vs_prefill')})")
if d:
    print(f"decode ({d['device']}, copy {d['copy_gb_s']:.0f} GB/s, datasheet {d.get('datasheet_gb_s')} GB/s)")
    for t in d["targets"]:
        s = t["step"]
        goal = (f" = {100 * t['fast_of_datasheet_bound']:.1f}% of {t['datasheet_bound_tok_s']:.0f} tok/s (every weight "
                f"over the datasheet's bandwidth, the goal's bound)" if "fast_of_datasheet_bound" in t else "")
        print(f"  {t['target']} {t['variant']}: {t['fast_tok_s']:.1f} tok/s{goal}; {s['ms']:.3f} ms/step: "
              f"{100 * s['of_bound']:.1f}% of the bytes it reads over the copy bandwidth"
              + (f", {100 * s['of_datasheet_bound']:.1f}% over the datasheet's" if "of_datasheet_bound" in s else "")
              + "; over the bound: "
              + ", ".join(f"{k} {v:+.3f} ms" for k, v in s["over_bound_ms"].items())
              + (f"; eager tokens equal {t['eager_equal_tokens']}/{t['eager_tokens']}" if t.get("eager_tokens") else ""))
    for v, rows in (d.get("speculative_big") or {}).items():
        for name, r in rows.items():
            rb = r.get("round") or {}
            if rb and name != "target":
                print(f"  spec {v}/{name}: round {rb['ms']:.3f} ms (draft {r.get('draft_ms_per_round', 0):.3f}, "
                      f"verify {r.get('verify_ms_per_round', 0):.3f}, host {rb['host_ms']:.3f}): "
                      f"{100 * rb['of_bound']:.1f}% of the copy-bw bound"
                      + (f", {100 * rb['of_datasheet_bound']:.1f}% of the datasheet's" if "of_datasheet_bound" in rb
                         else "")
                      + f"; verify alone {100 * rb['verify'].get('of_datasheet_bound', rb['verify']['of_bound']):.1f}%; "
                      f"{r['near_ties']} near-ties, {r['violations']} violations")
    print("  checks: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in d["checks"].items()))
    if d.get("skipped"):
        print("  skipped (budget): " + ", ".join(d["skipped"]))
EOF
}

case "$PART" in
  wheels) wheels ;;
  capture) env_txt; capture; summary ;;
  capture-where) env_txt; capture_where; summary ;;
  decode) env_txt; decode; summary ;;
  all) env_txt; capture; capture_where; decode; summary ;;
  *) echo "usage: bash benchmarks/gpu_speed.sh wheels|capture|capture-where|decode|all" >&2; exit 2 ;;
esac
