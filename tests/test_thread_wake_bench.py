"""bench/thread_wake.py runs on any machine: every hand-off reaches the waiting thread, its JSON line holds each
kind, and bad options are refused (the figures themselves are the bench's to print, not a test's to time)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests.helpers import ROOT

BENCH = os.path.join(ROOT, "bench", "thread_wake.py")


def _run(*args):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_each_kind_of_hand_off_is_timed_and_received():
    done = _run("--handoffs", "40", "--pause-ms", "0.2")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("THREAD-WAKE "))
    record = json.loads(line[len("THREAD-WAKE "):])
    figures = record["figures"]
    assert set(figures) == {"put, nobody waiting", "put, a thread waiting", "pipe write", "Event.set"}
    assert all(math.isfinite(f["median_us"]) and 0 < f["median_us"] <= f["p90_us"] for f in figures.values())
    # The queue and the pipe hand every job over; Event.set may fold a set the thread was slow to see.
    assert all(figures[name]["received"] == 40 for name in ("put, nobody waiting", "put, a thread waiting",
                                                            "pipe write"))
    assert 1 <= figures["Event.set"]["received"] <= 40
    assert "x the put with nobody waiting" in done.stdout


def test_bad_options_are_refused_in_one_line():
    for args in (("--handoffs", "1"), ("--pause-ms", "-1")):
        done = _run(*args)
        assert done.returncode == 2 and "error:" in done.stderr and "Traceback" not in done.stderr
