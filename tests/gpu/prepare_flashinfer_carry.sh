#!/usr/bin/env bash
# Run here (the CPU machine), after tests/gpu/prepare_vllm_column_carry.sh and before
# tests/gpu/run_flashinfer_column.sh runs on the GPU machine: FlashInfer's wheel, packed for the carry
# (tests/gpu/flashinfer_carry.py), into .gpu-carry/. apache-tvm-ffi, which FlashInfer needs, is among the
# vLLM carry's wheels already. The wheel comes from $FLASHINFER_WHEEL, or pip downloads it (no dependencies).
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
WHEEL=${FLASHINFER_WHEEL:-}
if [ -z "$WHEEL" ]; then
  mkdir -p out/flashinfer-wheel
  python3 -m pip download -q --no-deps --only-binary=:all: -d out/flashinfer-wheel "flashinfer-python==$VERSION"
  WHEEL=$(ls out/flashinfer-wheel/flashinfer_python-"$VERSION"-*.whl)
fi
python3 tests/gpu/flashinfer_carry.py "$WHEEL" "$CARRY"
du -sh "$CARRY"
