#!/usr/bin/env bash
# Here (the CPU machine): cp312 wheels, for the GPU machine's Python, of what it lacks. With no arguments: what
# vLLM 0.33's config, cache writer and backends import (tests/gpu/vllm_column_requirements.txt) into
# .gpu-carry/wheels; else the requirements file and the directory given (tests/gpu/prepare_engine_carry.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
REQUIREMENTS=${1:-tests/gpu/vllm_column_requirements.txt}
TARGET=${2:-.gpu-carry/wheels}
mkdir -p "$TARGET"
PLATFORMS=""
for n in 17 24 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
grep -v '^#' "$REQUIREMENTS" | while read -r req; do
  [ -n "$req" ] || continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform manylinux2014_x86_64 -d "$TARGET" "$req"
done
