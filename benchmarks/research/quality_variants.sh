#!/usr/bin/env bash
# Recipe variants on the reference target, one GPU, one table and one JSON line (see quality_variants.py beside it).
#   REGEN=DIR OUT=/tmp/qv bash benchmarks/research/quality_variants.sh     # one GPU (H200: ~6 min), ../shared/reference
#   bash benchmarks/research/quality_variants.sh --tiny                    # CPU smoke run
# Env: REF REGEN OUT W VARIANTS MEASURE PAR EPAR EPOCHS STEPS BT EV NP EP NT VAL_FRAC DEV CE_CHUNK COMPILE ENGINE WORKERS
#      TP TC TT TE (documented in the .py's docstring).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 benchmarks/research/quality_variants.py "$@"
