#!/usr/bin/env bash
# On a Hopper GPU machine (torch + Triton + nvcc, no vLLM, no FlashInfer, no network), from the repository root,
# with .gpu-carry/ carried (tests/gpu/prepare_vllm_column_carry.sh, then tests/gpu/prepare_flashinfer_carry.sh):
# the vllm column runs vLLM 0.33's FLASHINFER backend -- its builder, cache update and FlashInfer's own paged
# decode/prefill kernels, JIT-built here on first use (~90 s a kernel family) -- through kvdbg's replay
# (tests/gpu/test_flashinfer_column_gpu.py). Exit 0 only when every check passes. A user with a Hopper GPU and
# vLLM + FlashInfer installed needs none of this: `kvdbg replay SNAP --device cuda` runs the same column.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
SITE=/tmp/kvdbg-vllm-column-site
FI_SITE=/tmp/kvdbg-flashinfer-site
python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$CARRY"/wheels/*.whl
rm -rf "$FI_SITE" && mkdir -p "$FI_SITE"
python3 -m zipfile -e "$(ls "$CARRY"/flashinfer-*-py.zip)" "$FI_SITE"  # the JIT compiler reads headers from disk
ZIP=$(ls "$CARRY"/vllm-*-py.zip)
export PYTHONPATH="$PWD/tests/gpu/stub_site:$PWD/$ZIP:$FI_SITE:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CONFIGURE_LOGGING=0 KVDBG_GPU_VLLM_SO_MODULES="$PWD/$CARRY/vllm-so-modules.txt"
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-4}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/out/gpu-cache/flashinfer}
# Five pytest processes side by side, so that FlashInfer builds their kernel families at once (a prefill family
# takes 2-4 minutes to build on an H200, a decode one about 1): ~5 minutes on a fresh machine, not ~15.
TEST=tests/gpu/test_flashinfer_column_gpu.py
LOGS=$(mktemp -d /tmp/kvdbg-flashinfer-column.XXXX)
GROUPS_=("mixed_bf16" "mixed_window_fp16" "decode_fp16_gqa or planted or two_flashinfers or refuses"
         "decode_window or decode_softcap" "fp8")
pids=()
for i in "${!GROUPS_[@]}"; do
  python3 -m pytest -q -s -p no:cacheprovider -m cuda "$TEST" -k "${GROUPS_[$i]}" "$@" > "$LOGS/$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  echo "== ${GROUPS_[$i]}"; cat "$LOGS/$i.log"
done
exit $status
