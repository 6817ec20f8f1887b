# Sourced from the repository root by the GPU machine's whole-engine scripts (run_engine_stage.sh,
# run_graph_cost.sh), with .gpu-carry/ carried (tests/gpu/prepare_vllm_column_carry.sh, then
# tests/gpu/prepare_engine_carry.sh): kvdbg installed, the carried wheels in a site directory, vLLM 0.33's files
# unpacked, and the compiled modules stood in for in every interpreter (stub_site).
CARRY=.gpu-carry
SITE=/tmp/kvdbg-engine-site
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
