#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu-carry/ carried as for run_engine_stage.sh: `kvdbg
# conform` holds vLLM 0.33's backends (from the carried Python files; TRITON_ATTN by default) to the exact
# reference on the GPU. Arguments go to `kvdbg conform` (default: --backend TRITON_ATTN).
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/vllm_env.sh
[ $# -gt 0 ] || set -- --backend TRITON_ATTN
python3 -m kvdbg conform --device cuda "$@"
