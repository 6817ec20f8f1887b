#!/usr/bin/env bash
# The FlashInfer dump stage: FlashInfer 0.7.2.post1's own logging code writes fresh level-10 dumps on this CPU
# machine (tests/flashinfer_dumps/make_dumps.py), and `kvdbg import`'s tests run on them instead of the committed
# ones (KVDBG_FLASHINFER_DUMPS), which must still match what FlashInfer writes. FlashInfer and the few
# pure-Python modules it imports go into out/flashinfer-site (--no-deps, ~65 MB, kept between runs), on
# PYTHONPATH for the dump writer only: kvdbg's tests never import FlashInfer. About 30 s with the site in place.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
SITE=out/flashinfer-site
PINS="flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 einops==0.8.2 nvidia-ml-py==13.615.71 tabulate==0.10.0 tqdm==4.70.1"
started=$(date +%s)
if [ ! -f "$SITE/.kvdbg-pins" ] || [ "$(cat "$SITE/.kvdbg-pins")" != "$PINS" ]; then
  rm -rf "$SITE" && mkdir -p "$SITE"
  "$PY" -m pip install -q --no-deps --no-compile --target "$SITE" $PINS > out/flashinfer-site-pip.log 2>&1 \
    || { tail -n 20 out/flashinfer-site-pip.log; exit 1; }
  echo "$PINS" > "$SITE/.kvdbg-pins"
fi
rm -rf out/flashinfer-dumps
PYTHONPATH="$SITE" "$PY" -m tests.flashinfer_dumps.make_dumps out/flashinfer-dumps
KVDBG_FLASHINFER_DUMPS="$PWD/out/flashinfer-dumps" "$PY" -m pytest -q -p no:cacheprovider tests/test_import_flashinfer.py
echo "flashinfer dump stage total: $(( $(date +%s) - started )) s"
