#!/usr/bin/env bash
# One-shot GPU check of the engine (issue 14); see benchmarks/README.md "GPU check".
#
#   bash benchmarks/gpu_check.sh --prepare          # here, once: pack SmolLM2 into .gpucarry/smollm2 (~58 MB)
#   bash benchmarks/gpu_check.sh [OUT_DIR]          # on the CUDA machine: writes gpu_check.{json,md,log}
#   bash benchmarks/gpu_check.sh --smoke [OUT_DIR]  # on a CPU: tiny shapes, one length, end to end
#
# OUT_DIR defaults to $OUT (the device tool's folder), else benchmarks/results/gpu.
# Needs only python3 with torch, transformers and safetensors; no network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
case "${1:-}" in
  --prepare)
    exec "$PY" -m benchmarks.gpu_pack .gpucarry/smollm2 ;;
  --smoke)
    out="${2:-${OUT:-/tmp/gpu_check_smoke}}"
    mkdir -p "$out"
    "$PY" -m benchmarks.gpu_check "$out" --smoke 2>&1 | tee "$out/gpu_check.log"
    exit "${PIPESTATUS[0]}" ;;
esac
out="${1:-${OUT:-benchmarks/results/gpu}}"
mkdir -p "$out"
if [ ! -f .gpucarry/smollm2/packed3.safetensors ]; then
  echo "missing .gpucarry/smollm2: run 'bash benchmarks/gpu_check.sh --prepare' first and carry .gpucarry" >&2
  exit 2
fi
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia_smi.csv" 2>&1 || true
# 8 minutes at most on an H200: the check itself is sized for ~3-4; the timeout keeps what was written
timeout 470 "$PY" -m benchmarks.gpu_check "$out" --smollm .gpucarry/smollm2 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
