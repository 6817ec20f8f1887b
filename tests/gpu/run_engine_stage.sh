#!/usr/bin/env bash
# On the GPU machine (torch + Triton, no vLLM, no network), from the repository root, with .gpu-carry/ carried
# (tests/gpu/prepare_vllm_column_carry.sh, plus the engine's wheels: tests/gpu/prepare_engine_carry.sh): whole
# vLLM 0.33 engines serve tiny random models with kvdbg's plugin capturing (every snapshot replayed) or its
# sentinel checking (--parts sentinel); tests/gpu/README.md says what each part covers and
# tests/gpu/engine_stage.py what is stood in for. Arguments go to engine_stage.py after OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
SITE=/tmp/kvdbg-engine-site
OUT=${1:?usage: run_engine_stage.sh OUT [engine_stage.py options]}
shift
python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$CARRY"/wheels/*.whl \
  "$CARRY"/engine-wheels/*.whl
ZIP=$(ls "$CARRY"/vllm-*-py.zip)
# vLLM's files unpacked (a zip import compiles every module again in every process) and every process's
# bytecode kept under one prefix (the device's torch ships no .pyc): each engine process after the first
# starts without recompiling vLLM and torch.
SRC=/tmp/kvdbg-vllm-src
[ -d "$SRC/vllm" ] || python3 -m zipfile -e "$ZIP" "$SRC"
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/kvdbg-pycache}
export PYTHONPATH="$PWD/tests/gpu/stub_site:$SRC:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CONFIGURE_LOGGING=${VLLM_CONFIGURE_LOGGING:-1} KVDBG_GPU_VLLM_SO_MODULES="$PWD/$CARRY/vllm-so-modules.txt"
python3 tests/gpu/engine_stage.py "$OUT" "$@"
