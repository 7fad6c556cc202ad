#!/usr/bin/env bash
# One-shot GPU check of the engine (issue 14); see benchmarks/README.md "GPU check".
#
#   bash benchmarks/gpu/gpu_check.sh --prepare          # here, once (make gpu-prepare): pack SmolLM2 into .gpucarry/smollm2
#   bash benchmarks/gpu/gpu_check.sh [OUT_DIR] [--lengths 4096,8192] [--reps 3]   # on the CUDA machine
#   bash benchmarks/gpu/gpu_check.sh --smoke [OUT_DIR] [--reps N]                 # on a CPU: tiny shapes, end to end
#
# OUT_DIR defaults to $OUT (the device tool's folder), else benchmarks/results/gpu. Options after it
# (--lengths, --reps) go to benchmarks/gpu/gpu_check.py as they are.
# Needs only python3 with torch, transformers and safetensors; no network.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
case "${1:-}" in
  --prepare)
    exec "$PY" -m benchmarks.gpu.gpu_pack .gpucarry/smollm2 ;;
  --smoke)
    shift
    out="${OUT:-/tmp/gpu_check_smoke}"
    if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then out="$1"; shift; fi
    mkdir -p "$out"
    "$PY" -m benchmarks.gpu.gpu_check "$out" --smoke "$@" 2>&1 | tee "$out/gpu_check.log"
    exit "${PIPESTATUS[0]}" ;;
esac
out="${OUT:-benchmarks/results/gpu}"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then out="$1"; shift; fi
mkdir -p "$out"
if [ ! -f .gpucarry/smollm2/packed3.safetensors ]; then
  echo "missing .gpucarry/smollm2: run 'bash benchmarks/gpu/gpu_check.sh --prepare' first and carry .gpucarry" >&2
  exit 2
fi
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia_smi.csv" 2>&1 || true
# 8 minutes at most on an H200: the check itself is sized for ~3-4; the timeout keeps what was written
timeout -k 10 470 "$PY" -m benchmarks.gpu.gpu_check "$out" --smollm .gpucarry/smollm2 "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
