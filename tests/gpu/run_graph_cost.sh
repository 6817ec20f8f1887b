#!/usr/bin/env bash
# On the GPU machine, with the carry of run_engine_stage.sh: what capture and the sentinel cost a vLLM 0.33 engine
# whose decode steps replay full CUDA graphs, measured in one run (bench/graph_cost.py says how). Arguments go
# to graph_cost.py after OUT; it prints one GCOST-SUMMARY line and exits 0 only when every check passes and every
# figure is within its line (1: a figure over its line; 2: a part failed).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: run_graph_cost.sh OUT [graph_cost.py options]}
shift
source tests/gpu/vllm_env.sh
python3 bench/graph_cost.py "$OUT" "$@"
