# Sourced (bash) on the GPU machine from the repository root, with .gpu-carry/ carried
# (tests/gpu/prepare_vllm_column_carry.sh and tests/gpu/prepare_engine_carry.sh fill it): kvdbg installed,
# the carried wheels unpacked, vLLM 0.33's Python files unpacked and put on PYTHONPATH with the compiled
# modules' stand-ins (tests/gpu/stub_site). Every vLLM script of tests/gpu/ and bench/ that runs there starts so.
CARRY=.gpu-carry
SITE=/tmp/kvdbg-engine-site
python3 -m pip install -q --no-deps --no-build-isolation -e .
[ -d "$SITE" ] || python3 -m pip install -q --no-deps --no-index --no-compile --target "$SITE" \
  "$CARRY"/wheels/*.whl "$CARRY"/engine-wheels/*.whl
ZIP=$(ls "$CARRY"/vllm-*-py.zip)
# vLLM's files unpacked (a zip import compiles every module again in every process) and every process's
# bytecode kept under one prefix (the device's torch ships no .pyc): each process after the first starts
# without recompiling vLLM and torch.
SRC=/tmp/kvdbg-vllm-src
[ -d "$SRC/vllm" ] || python3 -m zipfile -e "$ZIP" "$SRC"
# Caches under out/ (ignored by git): a GPU machine kept between two calls keeps the repository's ignored files, so
# the second call finds the first's bytecode and kernel builds (Triton's, FlashInfer's JIT).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$PWD/out/gpu-cache/pycache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/out/gpu-cache/triton}
export PYTHONPATH="$PWD/tests/gpu/stub_site:$SRC:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CONFIGURE_LOGGING=${VLLM_CONFIGURE_LOGGING:-1} KVDBG_GPU_VLLM_SO_MODULES="$PWD/$CARRY/vllm-so-modules.txt"
# KVDBG_GPU_FLASHINFER=1 (an engine on FLASHINFER: engine_stage.py --backend FLASHINFER): FlashInfer's carried files
# unpacked beside vLLM's (its JIT compiler reads headers from disk) and its build settings for the H200.
if [ "${KVDBG_GPU_FLASHINFER:-0}" = 1 ]; then
  FI_SITE=/tmp/kvdbg-flashinfer-site
  [ -d "$FI_SITE/flashinfer" ] || python3 -m zipfile -e "$(ls "$CARRY"/flashinfer-*-py.zip)" "$FI_SITE"
  export PYTHONPATH="$PWD/tests/gpu/stub_site:$SRC:$FI_SITE:$SITE:$PWD${PYTHONPATH#"$PWD/tests/gpu/stub_site:$SRC:$SITE:$PWD"}"
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-8}
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/out/gpu-cache/flashinfer}
fi
