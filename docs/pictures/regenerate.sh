#!/usr/bin/env bash
# The README's pictures, from the bundled fixtures: bash docs/pictures/regenerate.sh (needs the plot extra).
set -euo pipefail
cd "$(dirname "$0")/../.."
KVDBG=${KVDBG:-.venv/bin/kvdbg}
out=docs/pictures
# Each command exits 1 on these fixtures (what the pictures show is a finding); the files are still written.
"$KVDBG" replay fixtures/prefix_page0.safetensors --png "$out/errors.png" --force >/dev/null || [ $? -eq 1 ]
"$KVDBG" attention fixtures/dflash.safetensors --step 0 --request 0 --head 0 --token 0 \
  --png "$out/attention_dflash.png" --force >/dev/null || [ $? -eq 1 ]
"$KVDBG" attention fixtures/prefix_page0.safetensors --png "$out/attention_null_block.png" --force >/dev/null \
  || [ $? -eq 1 ]
"$KVDBG" window fixtures/dflash.safetensors --png "$out/window.png" --force >/dev/null || [ $? -eq 1 ]
ls -l "$out"/*.png
