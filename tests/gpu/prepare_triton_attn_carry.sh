#!/usr/bin/env bash
# Run here (the CPU machine), before tests/gpu/run_triton_attn_capture.sh runs on the GPU machine: fills
# .gpu-carry/ (ignored by git; carry it) with vLLM 0.33's Python files (zipped, from .venv-vllm033, which
# tests/vllm033/run.sh builds) and a pyzmq wheel for the GPU machine's Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
PYTHON=${VLLM033_PYTHON:-.venv-vllm033/bin/python}
mkdir -p "$CARRY/wheels"
"$PYTHON" tests/gpu/build_carry.py --out "$CARRY"
PYZMQ=$(grep -i '^pyzmq==' tests/vllm033/requirements.txt)
if ! ls "$CARRY"/wheels/pyzmq-*cp312*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$CARRY/wheels" "$PYZMQ"
fi
du -sh "$CARRY"
