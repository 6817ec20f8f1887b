"""bench/sentinel_send.py on the CPU: it runs the checker process's protocol of a staged step end to end, one template
a child, reads each child's answer in its own form, and times the write to kvdbg's child and to one of the default
scheduling, with other processes busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT


def test_the_send_bench_times_a_staged_checks_send_and_both_forms_of_its_answer():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sentinel_send.py"), "--layers", "2",
                           "--checks", "6", "--pause-ms", "0", "--load", "1"], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("SSEND-SUMMARY ")]
    summary = json.loads(line.split(" ", 1)[1])
    assert summary["layers"] == 2 and summary["checks"] == 3  # 6 a child, the first 3 not counted
    assert summary["load"] == 1 and summary["cores"] == os.cpu_count()
    # the buffers went once to each child; each check its metadata
    assert summary["templates"] == {"compact": 1, "default": 1, "whole": 1}
    assert summary["answer_kinds"] == {"compact": ["PassedCheck"], "default": ["PassedCheck"],
                                       "whole": ["CheckResult"]}
    # kvdbg's child says how it is scheduled; the one of before is not told
    assert summary["scheduling"] == {"compact": "batch" if hasattr(os, "SCHED_BATCH") else
                                     "default (this system has no SCHED_BATCH)", "default": "default",
                                     "whole": "default"}
    us = summary["us"]
    assert all(us[name] > 0 for name in ("python", "write_compact", "write_default", "answer_compact", "answer_default",
                                         "read_compact", "read_whole"))
    writes = summary["writes_us"]
    assert all(0 < writes[name]["median"] <= writes[name]["p90"] and writes[name]["mean"] > 0
               for name in ("compact", "default"))
    assert "mean write, default / kvdbg's child" in done.stdout
    # Just after a send, a hook's look (too soon: it asks nothing) and a read that asks; None only in the unlikely
    # case that every answer was back by then.
    assert set(us) >= {"look_skips", "look_asks"} and (us["look_skips"] is None) == (us["look_asks"] is None)
    assert "whole / compact" in done.stdout


def test_the_send_bench_refuses_too_few_checks():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sentinel_send.py"), "--checks", "1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "--checks at least 2" in done.stderr
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sentinel_send.py"), "--load", "-1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "--load 0 to 64" in done.stderr
