"""The fuzzer's fast mode: a fixed-seed run over every command, in the normal suite (well under 60 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

COUNT, SEED = 500, 6


def test_fuzz_fast_mode_has_no_tracebacks_hangs_or_blowups(tmp_path):
    out = tmp_path / "fuzz"
    # A fresh interpreter: the fuzzer forks, and forking pytest's own process is not safe.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.fuzzer", "--count", str(COUNT), "--seed", str(SEED), "--out", str(out),
         "--jobs", "2", "--timeout", "30", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    summary = json.loads((out / "summary.json").read_text())
    failures = (out / "failures.jsonl").read_text()
    assert summary["total_failures"] == 0 and proc.returncode == 0, failures[:4000] or proc.stderr[-4000:]
    assert summary["inputs"] == COUNT
    # Every command ran on every input, and the mutations reach past the loader.
    assert summary["commands"] == 5 * COUNT
    assert sum(summary["per_command"]["replay"].get(code, 0) for code in ("0", "1")) > 0
    assert summary["per_command"]["map"].get("1", 0) > 0


def test_fuzzer_flags_a_traceback(monkeypatch):
    """The classifier must call an escaped exception a failure, and a one-line error fine."""
    from tests.fuzz.fuzzer import classify

    assert classify(1, ValueError("boom"), "", "") == "traceback"
    assert classify(2, SystemExit(2), "Error: x\n", "") is None
    assert classify(2, SystemExit(2), "Error: a\nError: b\n", "") == "multiline_error"
    assert classify(2, SystemExit(2), "Usage: kvdbg window\nTry 'kvdbg window -h'\n\nError: bad\n", "") is None
    assert classify(2, SystemExit(2), "Error: out of memory while reading the input\n", "") == "memory"
    assert classify(0, None, "Traceback (most recent call last):\n", "") == "traceback"
    assert classify(3, SystemExit(3), "", "") is None  # nothing verified: a documented outcome
    assert classify(4, SystemExit(4), "", "") == "bad_exit"
