#!/usr/bin/env bash
# Record the GPU figures flashlab commits, in one call on an NVIDIA H200 (or any CUDA GPU), from the repo root:
#
#     OUT=/tmp/h200 bash scripts/h200_record.sh
#
# Steps, most important first, each under its own time cap so one slow step cannot starve the rest:
#   1. the prefill benchmark on its GPU grid (python -m flashlab.bench)       -> $OUT/h200-bf16-DATE.{csv,json}
#   2. which SDPA backend runs for which dtype / head dim (flashlab.sdpa)  -> $OUT/h200-sdpa-backends.json
#   3. the GPU test suite (pytest -m gpu)                                     -> in $OUT/record.log
#   4. notebooks 04, 08 and 05 executed on the GPU (needs nbclient/ipykernel)  -> $OUT/notebooks-gpu.tar.gz
#   5. the decode benchmark (one query token, GQA 64/8)                        -> $OUT/h200-decode-bf16-DATE.{csv,json}
# Copy the result files into data/results/ and commit them with this script's log.
set -uo pipefail
OUT=${OUT:-data/results}
mkdir -p "$OUT"
DATE=$(date -u +%F)
LOG="$OUT/record.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step SECONDS DESCRIPTION COMMAND...
    local cap=$1 what=$2
    shift 2
    echo "=== $what ($(date -u +%T), cap ${cap}s): $*" | tee -a "$LOG"
    timeout "$cap" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $what: exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    | tee -a "$LOG"

step "${BENCH_CAP:-240}" "prefill benchmark" python3 -m flashlab.bench --no-progress --out "$OUT/h200-bf16-$DATE"
step 60 "SDPA backend probe" python3 -m flashlab.sdpa --device cuda --head-dims 64,96,100,128,192,256,512,1024 \
    --out "$OUT/h200-sdpa-backends.json"
step "${TESTS_CAP:-240}" "GPU tests" python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/
if python3 -c "import nbclient, ipykernel" 2>/dev/null; then
    mkdir -p /tmp/nb-gpu
    for nb in 04_triton_kernel 08_exactness 05_timing_on_gpu; do
        step 90 "notebook $nb on the GPU" python3 - "$nb" <<'PY'
import sys, time, nbformat
from nbclient import NotebookClient
name = sys.argv[1]
nb = nbformat.read(f"notebooks/{name}.ipynb", as_version=4)
t = time.perf_counter()
NotebookClient(nb, timeout=85, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
nbformat.write(nb, f"/tmp/nb-gpu/{name}.ipynb")
print(f"{name}: executed on the GPU in {time.perf_counter() - t:.0f} s")
PY
    done
    tar -czf "$OUT/notebooks-gpu.tar.gz" -C /tmp nb-gpu
fi
step "${DECODE_CAP:-60}" "decode benchmark" python3 -m flashlab.bench --mode decode --no-progress --out "$OUT/h200-decode-bf16-$DATE"
