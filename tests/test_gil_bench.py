"""bench/gil_handover.py runs on any machine: its cases, its JSON line and its refusal of bad options (the figures
themselves are the bench's to print, not a test's to time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

BENCH = os.path.join(ROOT, "bench", "gil_handover.py")


def _run(*args):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_every_case_runs_and_the_json_line_holds_them():
    done = _run("--iters", "10", "--calls", "2", "--elements", "64")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("GIL-HANDOVER "))
    record = json.loads(line[len("GIL-HANDOVER "):])
    cases = {(c["other"], c["calls"]) for c in record["cases"]}
    assert cases == {(other, calls) for other in ("alone", "torch-worker", "python-worker", "kvdbg-writer",
                                                  "sentinel-check", "sentinel-check-stacked") for calls in (1, 2)}
    alone = [c for c in record["cases"] if c["other"] == "alone"]
    assert all(c["median_to_alone"] == 1.0 and c["wall_us"] > 0 for c in alone)
    assert record["cores"] >= 1 and record["switch_interval_ms"] > 0
    # The sentinel's check of an honest step passes, and its torch calls are counted.
    check = record["sentinel_check"]
    assert check["passed"] and check["layers"] == 8 and 0 < check["torch_calls"] < 400 and check["check_us"] > 0
    assert "the sentinel's check alone:" in done.stdout
    # The same step with its layers' copies stacked (a graph's staging): the same verdict, fewer torch calls.
    stacked = record["sentinel_checks"]["sentinel-check-stacked"]
    assert stacked["passed"] and stacked["layers"] == 8 and 0 < stacked["torch_calls"] < check["torch_calls"]
    assert "the sentinel's check alone, its layers stacked:" in done.stdout


def test_the_other_threads_can_be_chosen():
    done = _run("--iters", "10", "--calls", "2", "--elements", "64", "--others", "torch-worker")
    assert done.returncode == 0, done.stderr
    record = json.loads(next(line for line in done.stdout.splitlines()
                             if line.startswith("GIL-HANDOVER "))[len("GIL-HANDOVER "):])
    assert {c["other"] for c in record["cases"]} == {"alone", "torch-worker"} and record["sentinel_check"] is None


def test_bad_options_are_one_line_and_exit_2():
    for args in (["--calls", "0"], ["--iters", "3"], ["--switch-ms", "0"], ["--elements", "0"],
                 ["--others", "torch-worker,nobody"]):
        done = _run(*args)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done
        assert "Traceback" not in done.stderr
