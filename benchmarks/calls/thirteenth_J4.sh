#!/usr/bin/env bash
# Call J4 (thirteenth session, issue #29): which lever of train's defaults moves temperature-1 acceptance. The data of
# call J1 (carried: .carry/regen, the target's greedy answers), train's defaults (base: its training must reproduce
# J1b's, validation chain-5 3.366), R = lr3e-3+ttt5 (soft CE, decay 0.8) and R+hard (R with the ce+hard objective)
# trained side by side; R and R+hard decoded with lossless rejection sampling at T=1 as in call J2 (base and the
# defaults before were measured there).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,power.limit --format=csv
t1=$SECONDS
REF=.carry/reference REGEN=.carry/regen OUT=$OUT/qv W=/dev/shm/hqv VARIANTS=base,lr3e-3+ttt5,R+hard \
  MEASURE=lr3e-3+ttt5,R+hard T0=0 T1=1.0 NP=160 EP=8 PAR=3 EPAR=16 STAGGER=45 TT=260 TE=280 OMP_NUM_THREADS=1 \
  python3 benchmarks/quality_variants.py > $OUT/qv.log 2>&1
echo "quality_variants: rc $? in $((SECONDS - t1)) s"; grep "^== \|^temperature" $OUT/qv.log
rm -rf $OUT/qv/logs; ls -la $OUT $OUT/qv
