#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu-carry/ carried as for run_engine_stage.sh: `kvdbg
# conform` holds vLLM 0.33's backends (from the carried Python files; TRITON_ATTN by default) to the exact
# reference on the GPU. Arguments go to `kvdbg conform` (default: --backend TRITON_ATTN).
set -euo pipefail
cd "$(dirname "$0")/../.."
# FLASHINFER: FlashInfer's carried files on the path (vllm_env.sh), and two compile jobs a kernel build: conform's
# workers (8 on this machine) build their families side by side, and 8 workers x 8 jobs of nvcc would overrun the
# machine's cores and memory.
case " $* " in
  *FLASHINFER*) export KVDBG_GPU_FLASHINFER=1 MAX_JOBS=${MAX_JOBS:-2} ;;
esac
source tests/gpu/vllm_env.sh
# The unpacked vLLM files have no bytecode (an installed vLLM has it): compiled once here on every core, so that
# conform's workers, which start side by side, do not each compile every module they import.
python3 -m compileall -q -j 0 "$SRC/vllm" > /dev/null 2>&1 || true
[ $# -gt 0 ] || set -- --backend TRITON_ATTN
# exec: `timeout -s TERM N run_conform.sh ...` then signals and waits for conform itself, which stops with the
# table and JSON of the cells that ran. Under a shell that dies at the signal, a command that went on at once
# could end the session (and conform with it) before conform had printed them: a cut run once lost its JSON so.
exec python3 -m kvdbg conform --device cuda "$@"
