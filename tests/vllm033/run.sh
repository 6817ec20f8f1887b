#!/usr/bin/env bash
# vLLM 0.33 (the CUDA wheel) on a CPU machine: its Python backend and layout classes import, not run.
# Builds .venv-vllm033 in the clone (torch 2.13 CPU, vllm 0.33.0 --no-deps, the pure-Python modules its
# backend modules import: requirements.txt) unless one with the same pins is there, then runs
# tests/vllm033 with it. These tests hold kvdbg's reading of vLLM's declarations to vLLM's own classes.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm033
HERE=tests/vllm033
PINS="vllm==0.33.0 $(sha256sum "$HERE/requirements.txt" "$HERE/constraints.txt" | sha256sum | cut -c1-16)"
started=$(date +%s)
if [ ! -f "$VENV/.kvdbg-pins" ] || [ "$(cat "$VENV/.kvdbg-pins")" != "$PINS" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  mkdir -p out
  {
    "$VENV/bin/pip" install torch==2.13.0 &&
    "$VENV/bin/pip" install --no-deps vllm==0.33.0 &&
    "$VENV/bin/pip" install -c "$HERE/constraints.txt" -r "$HERE/requirements.txt"
  } > out/vllm033-pip.log 2>&1 || { tail -n 20 out/vllm033-pip.log; exit 1; }
  echo "$PINS" > "$VENV/.kvdbg-pins"
fi
"$VENV/bin/pip" install -q --no-deps -e .
echo "vllm 0.33 venv ready after $(( $(date +%s) - started )) s"
KVDBG_VLLM033=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$HERE"
echo "vllm 0.33 stage total (venv included): $(( $(date +%s) - started )) s"
