#!/usr/bin/env bash
# Run here (the CPU machine), before tests/gpu/run_vllm_column.sh runs on the GPU machine. Fills .gpu-carry/
# (ignored by git; carry it): vLLM 0.33's Python files zipped with its dist-info (vllm-0.33.0-py.zip), the names
# of its compiled modules (vllm-so-modules.txt; left behind and stubbed by the test harness), and cp312 wheels
# of what vLLM's config and backends import that the GPU machine lacks (vllm_column_requirements.txt).
# The wheel comes from $VLLM_WHEEL, or pip downloads vllm==0.33.0 (no dependencies).
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
mkdir -p "$CARRY/wheels"
WHEEL=${VLLM_WHEEL:-}
if [ -z "$WHEEL" ]; then
  mkdir -p out/vllm-wheel
  python3 -m pip download -q --no-deps --only-binary=:all: -d out/vllm-wheel vllm==0.33.0
  WHEEL=$(ls out/vllm-wheel/vllm-0.33.0-*.whl)
fi
python3 tests/gpu/vllm_carry.py "$WHEEL" "$CARRY"
PLATFORMS=""
for n in 17 24 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
grep -v '^#' tests/gpu/vllm_column_requirements.txt | while read -r req; do
  [ -n "$req" ] || continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform manylinux2014_x86_64 -d "$CARRY/wheels" "$req"
done
du -sh "$CARRY"
