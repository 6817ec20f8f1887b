#!/usr/bin/env bash
# Run here (the CPU machine), after tests/gpu/prepare_vllm_column_carry.sh: cp312 wheels of what a whole vLLM
# 0.33 engine imports beyond the vllm column's needs and the GPU machine's image (tests/gpu/engine_requirements.txt),
# into .gpu-carry/engine-wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tests/gpu/download_wheels.sh tests/gpu/engine_requirements.txt .gpu-carry/engine-wheels
du -sh .gpu-carry/engine-wheels
