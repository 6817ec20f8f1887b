#!/usr/bin/env bash
# Run here (the CPU machine), after tests/gpu/prepare_vllm_column_carry.sh: cp312 wheels of what a whole vLLM
# 0.33 engine imports beyond the vllm column's needs and the GPU machine's image (tests/gpu/engine_requirements.txt),
# into .gpu-carry/engine-wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
mkdir -p "$CARRY/engine-wheels"
PLATFORMS=""
for n in 17 24 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
grep -v '^#' tests/gpu/engine_requirements.txt | while read -r req; do
  [ -n "$req" ] || continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform manylinux2014_x86_64 -d "$CARRY/engine-wheels" "$req"
done
du -sh "$CARRY/engine-wheels"
