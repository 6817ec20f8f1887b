#!/usr/bin/env bash
# Run here (the CPU machine), before tests/gpu/run_flashinfer_dump.sh runs on the GPU machine: FlashInfer's wheel
# packed for the carry (tests/gpu/prepare_flashinfer_carry.sh) and cp312 wheels of what FlashInfer imports
# (tests/gpu/flashinfer_dump_requirements.txt) into .gpu-carry/. No vLLM is needed for this run.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tests/gpu/prepare_flashinfer_carry.sh
bash tests/gpu/download_wheels.sh tests/gpu/flashinfer_dump_requirements.txt .gpu-carry/flashinfer-dump-wheels
du -sh .gpu-carry
