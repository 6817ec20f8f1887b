#!/usr/bin/env bash
# On the GPU machine (torch + Triton, no vLLM, no network), from the repository root, with .gpu-carry/ carried as
# for run_engine_stage.sh (engine-wheels, vllm-0.33.0-py.zip, vllm-so-modules.txt, wheels): whole vLLM 0.33 engines
# record and replay full CUDA graphs with kvdbg capturing and the sentinel checking (tests/gpu/graph_stage.py says
# what is proven). The same carry, stand-ins and environment as run_engine_stage.sh, which runs it.
# Usage: run_graph_stage.sh OUT [graph_stage.py options]; exit 0 only when every check passes.
set -euo pipefail
cd "$(dirname "$0")/../.."
KVDBG_GPU_STAGE=tests/gpu/graph_stage.py exec bash tests/gpu/run_engine_stage.sh "$@"
