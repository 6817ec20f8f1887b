#!/usr/bin/env bash
# The Ray stage: kvdbg[ray] into the test venv, then tests/fleet_ray against a Ray cluster of this machine
# (a head and two worker nodes on 127.0.0.1, started and stopped by the tests' session fixture, every wait
# bounded). The whole stage is bounded too: SIGINT after STAGE_TIMEOUT (the fixture still stops the cluster),
# SIGKILL 60 s later (each node then dies with its parent).
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE_TIMEOUT=${KVDBG_RAY_STAGE_TIMEOUT:-1200}
started=$(date +%s)
.venv/bin/pip install -q -e '.[ray]'
echo "ray $(.venv/bin/python -c 'import ray; print(ray.__version__)') installed after $(( $(date +%s) - started )) s"
KVDBG_REQUIRE_RAY=1 RAY_USAGE_STATS_ENABLED=0 timeout --signal=INT --kill-after=60 "$STAGE_TIMEOUT" \
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/fleet_ray
echo "ray stage total: $(( $(date +%s) - started )) s"
