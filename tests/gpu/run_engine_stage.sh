#!/usr/bin/env bash
# On the GPU machine (torch + Triton, no vLLM, no network), from the repository root, with .gpu-carry/ carried
# (tests/gpu/prepare_vllm_column_carry.sh, plus the engine's wheels: tests/gpu/prepare_engine_carry.sh): whole
# vLLM 0.33 engines serve tiny random models with kvdbg's plugin capturing (every snapshot replayed) or its
# sentinel checking (--parts sentinel); tests/gpu/README.md says what each part covers and
# tests/gpu/engine_stage.py what is stood in for. Arguments go to engine_stage.py after OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: run_engine_stage.sh OUT [engine_stage.py options]}
shift
source tests/gpu/vllm_env.sh
# KVDBG_GPU_STAGE: the stage script run with this carry and environment (run_graph_stage.sh sets it).
python3 "${KVDBG_GPU_STAGE:-tests/gpu/engine_stage.py}" "$OUT" "$@"
