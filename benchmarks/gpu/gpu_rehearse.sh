#!/usr/bin/env bash
# Rehearse the GPU check on a CPU with the GPU image's package versions (issue 39); see
# benchmarks/README.md "GPU check". `make gpu-rehearse` runs it.
#
#   bash benchmarks/gpu/gpu_rehearse.sh [OUT_DIR]
#
# 1. a venv (.venv-gpu-rehearse, git-ignored) holding only what the GPU image has that the check
#    uses, at the image's versions: transformers 5.17.0, tokenizers 0.23.2, huggingface_hub 1.33.0,
#    safetensors 0.8.0, xxhash, numpy, and torch: $REHEARSE_TORCH (default torch==2.11.0+cpu, the
#    image's torch as a CPU build) from $REHEARSE_TORCH_INDEX when set. PyPI serves torch 2.11 for
#    Linux only as the CUDA build (a 530 MB wheel needing ~3 GB of CUDA wheels to import), so where
#    no index with the CPU build is reachable the venv falls back to the dev venv's CPU torch
#    ($REHEARSE_TORCH_FALLBACK) and says so: transformers' drift is rehearsed, torch's is not;
# 2. the carry (.gpucarry/smollm2, `make gpu-prepare`) read by that transformers;
# 3. the whole check (preflight, correctness gate, timing, batched run, profile, ingestion) with --smoke in
#    bf16 on the CPU, --strict: any part that raises (an import, a dtype, an API that moved) fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${REHEARSE_VENV:-.venv-gpu-rehearse}"
BASE_PY="${REHEARSE_PYTHON:-python3.11}"
TORCH_SPEC="${REHEARSE_TORCH:-torch==2.11.0+cpu}"
TORCH_FALLBACK="${REHEARSE_TORCH_FALLBACK:-torch==2.13.0}"
out="${1:-/tmp/gpu_rehearse}"
PINS=(transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0 xxhash numpy)

if [ ! -f .gpucarry/smollm2/packed3.safetensors ]; then
  echo "gpu-rehearse: missing .gpucarry/smollm2: run 'make gpu-prepare' first" >&2
  exit 2
fi
stamp="$VENV/.rehearse-$(echo "$TORCH_SPEC ${PINS[*]}" | md5sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q)
  index=()
  if [ -n "${REHEARSE_TORCH_INDEX:-}" ]; then index=(--index-url "$REHEARSE_TORCH_INDEX"); fi
  if "${pip[@]}" --no-deps "${index[@]}" "$TORCH_SPEC" 2>/dev/null \
      && "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    echo "gpu-rehearse: torch from $TORCH_SPEC"
  else
    echo "gpu-rehearse: WARNING: $TORCH_SPEC is not served here as a CPU build; using $TORCH_FALLBACK" \
         "(transformers' drift is rehearsed, torch's is not)" >&2
    "${pip[@]}" --no-deps "$TORCH_FALLBACK"
  fi
  # torch's own pure-Python needs (its CUDA wheels are left out on purpose)
  "${pip[@]}" filelock 'typing-extensions>=4.10' 'setuptools<82' sympy networkx jinja2 fsspec
  "${pip[@]}" "${PINS[@]}"
  touch "$stamp"
fi
mkdir -p "$out"
"$VENV/bin/python" - <<'EOF' | tee "$out/rehearse_env.txt"
import platform, torch, transformers, tokenizers, safetensors
print(f"python {platform.python_version()} torch {torch.__version__} transformers {transformers.__version__} "
      f"tokenizers {tokenizers.__version__} safetensors {safetensors.__version__}")
EOF
PYTHON="$VENV/bin/python" bash benchmarks/gpu/gpu_check.sh --smoke "$out" --smollm .gpucarry/smollm2 \
  --dtype bfloat16 --strict
