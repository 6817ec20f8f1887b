#!/usr/bin/env bash
# On the GPU machine (torch + Triton, no vLLM, no network), from the repository root, with .gpu-carry/ carried
# (tests/gpu/prepare_triton_attn_carry.sh fills it): vLLM 0.33's TRITON_ATTN kernels write and attend, kvdbg
# captures and replays. Prints PASS/FAIL per check; exit 0 only when all pass. Snapshots: out/gpu-triton-attn/.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
python3 -m pip install -q --no-deps --no-build-isolation -e .
if ! python3 -c "import zmq" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target "$CARRY/site" "$CARRY"/wheels/pyzmq-*.whl
fi
ZIP=$(ls "$CARRY"/vllm-*-py.zip)
export PYTHONPATH="$PWD/$ZIP:$PWD/$CARRY/site${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CONFIGURE_LOGGING=0
rm -rf out/gpu-triton-attn
python3 tests/gpu/triton_attn_capture.py --so-modules "$CARRY/vllm-so-modules.txt" --out out/gpu-triton-attn "$@"
