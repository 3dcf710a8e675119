#!/usr/bin/env bash
# Record the bytes every attention kernel moves, from the GPU's counters, in one call on a CUDA GPU with Nsight
# Compute (ncu), from the repository root:
#
#     OUT=/tmp/traffic bash scripts/record_traffic.sh
#
# Steps, each under its own time cap (about 6 minutes in all):
#   0. what is there: the GPU, torch / triton, ncu's path and version
#   1. a smoke test: python -m flashlab.bench --mode traffic --quick      -> $OUT/quick.{json,csv}
#   2. the grid: bf16, D 128 then 64, no mask then causal, N 1K..16K, every backend, H = 2048 / D, B = 1
#                                                                         -> $OUT/<gpu>-traffic-bf16-DATE.{json,csv}
#      with ncu's report, its CSV and the case list (grid.ncu-rep, .csv, .cases.json) to check the attribution
# The child stops starting cases when 80 % of --timeout has gone, so a slow machine still writes a (shorter) file.
# Copy $OUT/*-traffic-*.json and .csv into data/results/ (git mv the recording they replace to lab/results/) and
# $OUT/record-traffic.log into lab/results/.
set -uo pipefail
OUT=${OUT:-data/results}
mkdir -p "$OUT"
LOG="$OUT/record-traffic.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=$(command -v python3 || command -v python)
NCU=${NCU:-$(command -v ncu || true)}
if [ -z "$NCU" ]; then
    for candidate in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
        [ -x "$candidate" ] && NCU=$candidate && break
    done
fi
export NCU

step() {  # step SECONDS DESCRIPTION COMMAND...
    local cap=$1 what=$2
    shift 2
    echo "=== $what ($(date -u +%T), cap ${cap}s): $*" | tee -a "$LOG"
    timeout "$cap" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $what: exit ${PIPESTATUS[0]} ($(date -u +%T))" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$LOG"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    2>&1 | tee -a "$LOG"
if [ -z "$NCU" ]; then
    echo "no ncu found (PATH, \$NCU, /usr/local/cuda/bin, /opt/nvidia/nsight-compute): cannot record" | tee -a "$LOG"
    exit 2
fi
echo "ncu: $NCU ($("$NCU" --version 2>&1 | tail -n 1))" | tee -a "$LOG"

[ "${SMOKE:-1}" = 1 ] && step "${QUICK_CAP:-90}" "traffic smoke test" "$PY" -m flashlab.bench --mode traffic --quick --ncu "$NCU" \
    --timeout 80 --out "$OUT/quick"
step "${GRID_CAP:-270}" "traffic grid" "$PY" -m flashlab.bench --mode traffic --ncu "$NCU" --timeout "${GRID_TIMEOUT:-250}" \
    --out-dir "$OUT" --keep-report "$OUT/grid.ncu-rep"
ls -la "$OUT" | tee -a "$LOG"
