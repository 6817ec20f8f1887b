#!/usr/bin/env bash
# On the GPU machine (torch + Triton, no vLLM, no network), from the repository root, with .gpu-carry/ carried
# (tests/gpu/prepare_vllm_column_carry.sh fills it): the vllm column runs vLLM 0.33's own TRITON_ATTN code --
# its builder, its Triton cache write and unified attention -- on snapshots, through kvdbg's replay, shrink
# and poison (tests/gpu/test_vllm_column_gpu.py). Exit 0 only when every check passes.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
SITE=/tmp/kvdbg-vllm-column-site
python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$CARRY"/wheels/*.whl
ZIP=$(ls "$CARRY"/vllm-*-py.zip)
export PYTHONPATH="$PWD/$ZIP:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CONFIGURE_LOGGING=0 KVDBG_GPU_VLLM_SO_MODULES="$PWD/$CARRY/vllm-so-modules.txt"
python3 -m pytest -q -p no:cacheprovider -m cuda tests/gpu/test_vllm_column_gpu.py "$@"
