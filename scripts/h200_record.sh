#!/usr/bin/env bash
# Record the GPU figures flashlab commits, on an NVIDIA H200 (or any CUDA GPU), from the repository root (files are
# named after the GPU: h200-..., h100-...; the names below say h200):
#
#     OUT=/tmp/h200 bash scripts/h200_record.sh                 # every step
#     OUT=/tmp/h200 STEPS="tests backward" bash scripts/h200_record.sh
#
# Steps, each under its own time cap so one slow step cannot starve the rest (names for STEPS):
#   tests     the GPU test suite (pytest -m gpu)                                  -> $LOG
#   backward  dq, dk, dv from dO against SDPA's backends (scripts/backward_gpu_check.py)
#                                                                                 -> $OUT/backward_gpu_check.json
#   decode    one-token decode, contiguous and paged KV, host time (--mode decode) -> $OUT/h200-decode-bf16-DATE.*
#   prefill   the forward on its grid, flashlab against every SDPA backend       -> $OUT/h200-bf16-DATE.{csv,json}
#   quick     a short forward check against the recorded grid (3 backends, 12 cells) -> $OUT/h200-bf16-DATE-quick.*
#   ladder    every rung of the kernel ladder beside SDPA, D = 64 and 128 (notebook 05)
#                                                                                 -> $OUT/h200-ladder-bf16-DATE-all-rungs.*
#   host      decode host time per call and ragged paged decode (scripts/decode_host_time.py)
#                                                                                 -> $OUT/decode_host_time.json
#   sdpa      which SDPA backend runs for which dtype / head dim (flashlab.sdpa)  -> $OUT/h200-sdpa-backends.json
#   traffic   HBM and L2 bytes of every kernel from Nsight Compute (record_traffic.sh) -> $OUT/h200-traffic-*.{json,csv}
#   memory    training-step memory, naive against flashlab (scripts/backward_memory.py)
#                                                                                 -> $OUT/h200-backward-memory.json
#   coldstart the first call of 40 assorted shapes, fresh process, empty Triton cache (--mode coldstart)
#                                                                                 -> $OUT/h200-coldstart-DATE.*
#   loops     whole loops that change shape every call against repeated ones (--mode loops) -> $OUT/h200-loops-DATE.*
#   rungs     every backward rung under its tile variants beside SDPA (lab/probes/backward_hopper_tiles.py)
#                                                                                 -> $OUT/h200-backward-rungs-DATE.txt
#   bwladder  the backward grid, every backward rung beside SDPA FLASH and cuDNN (--mode backward)
#                                                                                 -> $OUT/h200-backward-ladder-bf16-DATE.*
#   bwshapes  the backward at GQA 8:1 (D = 128) and at D = 256, rungs 1 and 2 beside SDPA, N 1K-8K (--mode backward)
#                                                                                 -> $OUT/h200-backward-{gqa8,d256}-bf16-DATE.*
#   kvtraffic HBM bytes of one decode step, 16-bit against 8-bit paged cache (--mode traffic, ncu)
#                                                                                 -> $OUT/h200-traffic-decode-fp8-DATE.*
#   step      one training step of a 12-layer GPT with each attention (--mode step) -> $OUT/h200-step-DATE.*
#   varlen    packed batches of log-normal lengths against torch's varlen_attn and padding, then the mixed serving
#             batch through the paged cache (--mode varlen)     -> $OUT/h200-varlen-{lognormal,mixed}-DATE.*
# TAR=FILE packs $OUT into FILE after every step (a device machine returns few files; a cut call keeps its steps).
# The log ($LOG, by default $OUT/h200-record-DATE.log) goes to lab/results/. data/results/ keeps one current
# recording of each kind: a new one replaces the old (git mv the old one to lab/results/) and takes its row in
# data/results/README.md; the scripts' JSON (backward_gpu_check.json, decode_host_time.json) is renamed
# h200-<what>-DATE.json first, and whatever no notebook, README or test reads goes to lab/results/
# (tests/test_data_files.py checks this).
set -uo pipefail
OUT=${OUT:-data/results}
STEPS=${STEPS:-"tests backward decode host prefill ladder sdpa traffic memory"}
mkdir -p "$OUT"
DATE=$(date -u +%F)
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')}
GPU=${GPU:-gpu}
LOG=${LOG:-$OUT/$GPU-record-$DATE.log}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step SECONDS DESCRIPTION COMMAND...
    local cap=$1 what=$2
    shift 2
    echo "=== $what ($(date -u +%T), cap ${cap}s): $*" | tee -a "$LOG"
    timeout "$cap" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $what: exit ${PIPESTATUS[0]} ($(date -u +%T))" | tee -a "$LOG"
    [ -z "${TAR:-}" ] || tar czf "$TAR" -C "$OUT" .
}
want() { [[ " $STEPS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    | tee -a "$LOG"

want tests && step "${TESTS_CAP:-240}" "GPU tests" python3 -m pytest -q -m gpu -p no:cacheprovider -n "${TESTS_WORKERS:-12}" --durations=15 tests/
want backward && step "${BACKWARD_CAP:-200}" "backward against SDPA" env OUT="$OUT" python3 scripts/backward_gpu_check.py
want decode && step "${DECODE_CAP:-170}" "decode benchmark" python3 -m flashlab.bench --mode decode --no-progress \
    --backends flashlab,paged16,paged256,sdpa_flash,sdpa_cudnn --out "$OUT/$GPU-decode-bf16-$DATE"
want host && step "${HOST_CAP:-150}" "decode host time, ragged paged decode" env OUT="$OUT" \
    python3 scripts/decode_host_time.py --budget-s 90
want prefill && step "${BENCH_CAP:-300}" "prefill benchmark" python3 -m flashlab.bench --no-progress \
    --out "$OUT/$GPU-bf16-$DATE"
want quick && step "${QUICK_CAP:-100}" "quick prefill check" python3 -m flashlab.bench --no-progress --no-ceilings \
    --backends flashlab,sdpa_flash,sdpa_cudnn --head-dims 64,128 --seq-lens 1k,4k,16k --out "$OUT/$GPU-bf16-$DATE-quick"
want ladder && step "${LADDER_CAP:-300}" "kernel ladder" python3 -m flashlab.bench --no-progress --head-dims 64,128 \
    --backends "flashlab,$(python3 -c 'from flashlab.kernels import ladder; print(",".join("flashlab_" + n for n in ladder.names()))'),sdpa_flash,sdpa_cudnn" \
    --out "$OUT/$GPU-ladder-bf16-$DATE-all-rungs"
want sdpa && step 60 "SDPA backend probe" python3 -m flashlab.sdpa --device cuda --head-dims 64,96,100,128,192,256,512,1024 \
    --out "$OUT/$GPU-sdpa-backends.json"
if want traffic; then  # ncu leaves large reports: keep them beside, copy the tables
    mkdir -p /tmp/flashlab-traffic
    step "${TRAFFIC_CAP:-240}" "traffic (Nsight Compute)" env OUT=/tmp/flashlab-traffic SMOKE="${SMOKE:-1}" \
        GRID_TIMEOUT="${GRID_TIMEOUT:-220}" bash scripts/record_traffic.sh
    cp /tmp/flashlab-traffic/*-traffic-*.json /tmp/flashlab-traffic/*-traffic-*.csv "$OUT"/ 2>/dev/null
fi
want memory && step "${MEMORY_CAP:-90}" "training-step memory" python3 scripts/backward_memory.py \
    --out "$OUT/$GPU-backward-memory.json"
want coldstart && step "${COLDSTART_CAP:-180}" "cold first calls" python3 -m flashlab.bench --mode coldstart --no-warmup \
    --timeout 170 --out "$OUT/$GPU-coldstart-$DATE"
want loops && step "${LOOPS_CAP:-200}" "loops that change shape" python3 -m flashlab.bench --mode loops --no-progress \
    --out "$OUT/$GPU-loops-$DATE"
want rungs && step "${RUNGS_CAP:-220}" "backward rungs and their tiles" python3 lab/probes/backward_hopper_tiles.py \
    "$OUT/$GPU-backward-rungs-$DATE.txt"
want bwladder && step "${BWLADDER_CAP:-240}" "backward ladder" python3 -m flashlab.bench --mode backward --no-progress \
    --no-ceilings --backends "${BWLADDER_BACKENDS:-flashlab,$(python3 -c 'from flashlab.kernels import backward as b; print(",".join("backward_" + n for n in b.names()))'),sdpa_flash,sdpa_cudnn}" \
    --out "$OUT/$GPU-backward-ladder-bf16-$DATE"
BWSHAPES="--mode backward --no-progress --no-ceilings --seq-lens 1k,4k,8k --backends flashlab,backward_two_pass,backward_hopper,sdpa_flash,sdpa_cudnn"
want bwshapes && step "${BWSHAPES_CAP:-100}" "backward, GQA 8:1" python3 -m flashlab.bench $BWSHAPES --gqa 8 --head-dims 128 \
    --out "$OUT/$GPU-backward-gqa8-bf16-$DATE"
want bwshapes && step "${BWSHAPES_CAP:-100}" "backward, D = 256" python3 -m flashlab.bench $BWSHAPES --head-dims 256 \
    --out "$OUT/$GPU-backward-d256-bf16-$DATE"
want kvtraffic && step "${KVTRAFFIC_CAP:-200}" "decode bytes, 8-bit cache" python3 -m flashlab.bench --mode traffic \
    --backends paged256,paged256_fp8 --heads 64 --kv-heads 8 --batch 8 --seq-lens 32k,128k --head-dims 128 --causal no \
    --timeout 180 --out "$OUT/$GPU-traffic-decode-fp8-$DATE"
want step && step "${STEP_CAP:-240}" "training step" python3 -m flashlab.bench --mode step --out "$OUT/$GPU-step-$DATE"
want varlen && step "${VARLEN_CAP:-150}" "packed varlen batches" python3 -m flashlab.bench --mode varlen --no-progress \
    --mixes log-normal --tokens 16384,65536 --head-dim 64,128 --kv-heads 4 --out "$OUT/$GPU-varlen-lognormal-$DATE"
want varlen && step "${VARLEN_CAP:-150}" "mixed serving batch" python3 -m flashlab.bench --mode varlen --no-progress \
    --mixed-batch --kv-heads 4 --out "$OUT/$GPU-varlen-mixed-$DATE"
