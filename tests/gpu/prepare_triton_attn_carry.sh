#!/usr/bin/env bash
# Run here (the CPU machine), before tests/gpu/run_triton_attn_capture.sh runs on the GPU machine: fills
# .gpu-carry/ (ignored by git; carry it) with vLLM 0.33's Python files (zipped, from .venv-vllm033, which
# tests/vllm033/run.sh builds) and cp312 wheels of what its ops import there (pydantic, pyzmq, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
PYTHON=${VLLM033_PYTHON:-.venv-vllm033/bin/python}
mkdir -p "$CARRY/wheels"
"$PYTHON" tests/gpu/build_carry.py --out "$CARRY"
bash tests/gpu/download_wheels.sh
du -sh "$CARRY"
