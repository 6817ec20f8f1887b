#!/usr/bin/env bash
# On a Hopper GPU machine (torch + nvcc, no FlashInfer, no network), from the repository root, with .gpu-carry/
# carried (tests/gpu/prepare_flashinfer_dump_carry.sh): FlashInfer's own paged decode and prefill wrappers run
# real kernels (JIT-built on first use, ~90 s a kernel family) with FLASHINFER_LOGLEVEL=10 dumping; `kvdbg
# import` turns the dumps into snapshots; `kvdbg replay` must pass them and fail a planted wrong output naming
# its request and head (tests/gpu/flashinfer_dump_gpu.py). Exit 0 only when every check passes. Arguments go
# to that script (--more: also an HND decode with window and soft cap; --out DIR: keep dumps and snapshots).
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
SITE=/tmp/kvdbg-flashinfer-dump-site
FI_SITE=/tmp/kvdbg-flashinfer-site
ZIP=$(ls "$CARRY"/flashinfer-*-py.zip 2>/dev/null | head -n 1 || true)
if [ -z "$ZIP" ] || ! ls "$CARRY"/flashinfer-dump-wheels/*.whl >/dev/null 2>&1; then
  echo "run_flashinfer_dump: $CARRY lacks FlashInfer's zip or its wheels; run tests/gpu/prepare_flashinfer_dump_carry.sh on the CPU machine and carry $CARRY" >&2
  exit 2
fi
python3 -m pip install -q --no-deps --no-build-isolation -e .
rm -rf "$SITE" "$FI_SITE" && mkdir -p "$SITE" "$FI_SITE"
python3 -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$CARRY"/flashinfer-dump-wheels/*.whl
python3 -m zipfile -e "$ZIP" "$FI_SITE"  # the JIT compiler reads headers from disk
export PYTHONPATH="$FI_SITE:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/out/gpu-cache/flashinfer}
python3 tests/gpu/flashinfer_dump_gpu.py "$@"
