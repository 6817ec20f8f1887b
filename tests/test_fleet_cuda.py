"""`kvdbg replay DIR --device cuda --jobs N`: several workers on each visible GPU (run with `pytest -m cuda`).

On a machine of one GPU this puts three workers on it; on several, three on
each. Each worker must see exactly its own GPU (CUDA_VISIBLE_DEVICES), the
groups must match the causes planted (as on CPU), and a worker killed mid-run
must lose nothing.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from kvdbg.replayer.batch import BatchOptions, find_snapshots
from kvdbg.fleet.runs import run_fleet
from kvdbg.fleet.workers import Started

from tests.fleet_helpers import mixed_directory, pinned_replay, small_directory

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PER_GPU = 3


def test_every_gpu_gets_its_workers_each_pinned_to_it(tmp_path):
    count = torch.cuda.device_count()
    paths = small_directory(str(tmp_path / "d"), PER_GPU * count * 2)
    fleet = run_fleet(paths, BatchOptions(device="cuda"), jobs=PER_GPU, replay=pinned_replay)
    assert fleet.batch.exit_code == 0, fleet.batch.summary
    assert [d.device for d in fleet.devices] == [f"cuda:{g}" for g in range(count)]
    assert sum(d.files for d in fleet.devices) == len(paths)
    assert all(d.workers == PER_GPU for d in fleet.devices), [d.to_json() for d in fleet.devices]
    expected = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [e.strip() for e in expected.split(",")] if expected else [str(g) for g in range(count)]
    for row in fleet.rows:
        with open(f"{row.path}.{row.placement.pid}.where", encoding="utf-8") as fh:
            seen = json.load(fh)
        gpu = int(row.placement.device.split(":")[1])
        assert seen == {"CUDA_VISIBLE_DEVICES": visible[gpu], "device_count": 1, "device": "cuda"}, seen


def test_groups_on_the_gpu_match_the_causes_built_in(tmp_path):
    directory = str(tmp_path / "mixed")
    planted = mixed_directory(directory)
    fleet = run_fleet(find_snapshots([directory]), BatchOptions(device="cuda"), jobs=PER_GPU)
    found = {frozenset(os.path.basename(r.path) for r in g.rows) for g in fleet.triage.groups}
    assert found == {frozenset(names) for cause, names in planted.items() if cause != "pass"}
    assert fleet.triage.passed == len(planted["pass"])


def test_a_worker_killed_on_the_gpu_loses_nothing(tmp_path):
    paths = small_directory(str(tmp_path / "d"), 8)
    killed = []

    def kill_one(event):
        if isinstance(event, Started) and event.index == 3 and event.attempt == 1:
            os.kill(event.placement.pid, signal.SIGKILL)
            killed.append(event.placement.device)

    fleet = run_fleet(paths, BatchOptions(device="cuda"), jobs=PER_GPU, on_event=kill_one)
    assert killed and fleet.batch.exit_code == 0 and len(fleet.rows) == 8
    assert fleet.rows[3].attempts == 2 and fleet.rows[3].placement.device == killed[0]
    assert [(w.index, w.retried) for w in fleet.lost] == [(3, True)]
