"""What a staged graph step's check costs the engine's thread to send to the sentinel's checker process, and to read
back, on a CPU.

Usage:
    .venv/bin/python bench/sentinel_send.py [--layers 8] [--checks 300] [--pause-ms 3] [--load N]

The protocol of a CUDA step (kvdbg.sentinel.remote) run on the host: the tests' staged step (its layers' copies in
one stack, whole buffers read to the graph's rows, 3 requests) with its buffers shared with the child as CUDA
buffers are (``share_host``, torch's file-system sharing), so that the template goes once and each check carries its
step's metadata alone. Three children answer, check by check in turn, so a neighbour's load falls on all alike:

    compact   kvdbg's child (python -m kvdbg.sentinel.child): a passed layer's result as a PassedCheck, its threads
              scheduled as batch work (SCHED_BATCH: woken by a check, they take no core from the sender)
    default   the same serve loop and answers under the bench's own policy (the default one, as a rule), as
              the child was before
    whole     the same serve loop answering with check_layers' CheckResults, as the child did before that

``--load N`` keeps N other processes busy (a loop each, ended with the bench) while the checks run: a serving host's
other work, which leaves the engine's thread no idle core to send from. A woken child of the default policy may
then take the sender's core, and the socket write lasts until the scheduler gives it back.

Printed, as medians over the checks: the send's Python (less its socket write), the socket write to each of the
first two children (with its mean and 90th percentile: it is the long writes that cost), and how long from the
send's start their answer was there (the send, the check's time in the child, its wake and its answer's), the
read of each child's answer (its receive and unpickling, timed once the answer is there), with whole / compact,
and, just after kvdbg's child was sent a check, a hook's look (``answers(None)``: too soon for an answer, it asks
nothing) against a read that asks the socket and the child (``answers(0.0)``, the answer not there yet). Ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The child that answers whole CheckResults: kvdbg's serve loop with check_layers as it returns them.
WHOLE_CHILD = ("import sys\n"
               "from multiprocessing.connection import Connection\n"
               "from kvdbg.sentinel.checker import check_layers\n"
               "from kvdbg.sentinel.remote import serve\n"
               "sys.exit(serve(Connection(int(sys.argv[1])), sys.argv[2], check_layers, *sys.argv[3:]))\n")
# kvdbg's child's serve loop and answers, without its scheduling (kvdbg.sentinel.child.behind_the_engine).
DEFAULT_CHILD = ("import sys\n"
                 "from multiprocessing.connection import Connection\n"
                 "from kvdbg.sentinel.checker import check_layers, compact\n"
                 "from kvdbg.sentinel.remote import serve\n"
                 "answer = lambda entries, **kwargs: compact(check_layers(entries, **kwargs))\n"
                 "sys.exit(serve(Connection(int(sys.argv[1])), sys.argv[2], answer, *sys.argv[3:]))\n")
# A busy neighbour (--load), which ends once the bench is gone (killed, it runs no finally).
BUSY = ("import os, sys\n"
        "parent = int(sys.argv[1])\n"
        "while os.getppid() == parent:\n"
        "    for _ in range(100000):\n"
        "        pass\n")


class _TimedWrites:
    """Each socket write of a CheckerProcess (its connection's send_bytes), timed: a check's send less them is its
    Python."""

    def __init__(self, process):
        self.ns = 0
        real = process._conn.send_bytes

        def timed(data, *args):
            start = time.perf_counter_ns()
            try:
                return real(data, *args)
            finally:
                self.ns += time.perf_counter_ns() - start

        process._conn.send_bytes = timed


def _policy_name() -> str:
    """This process's scheduling policy in a word (the third child's, which starts under it)."""
    from kvdbg.sentinel.child import policy_name

    return policy_name(os.sched_getscheduler(0)) if hasattr(os, "sched_getscheduler") else "default"


def _read_time(process, seconds: float = 30.0) -> tuple[int, list]:
    """The answer's read once it is there (ns), and the answer."""
    if not process._conn.poll(seconds):
        raise RuntimeError(f"no answer from the checker process (pid {process.pid}) within {seconds:g} s")
    return _read(process)


def _read(process) -> tuple[int, list]:
    start = time.perf_counter_ns()
    got = process.answers(0.0)
    spent = time.perf_counter_ns() - start
    if len(got) != 1 or got[0][0] != "ok":
        raise RuntimeError(f"the checker process answered {got!r}")
    return spent, got[0][1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="layers of the staged step (default 8)")
    parser.add_argument("--checks", type=int, default=300, help="checks sent to each child (default 300)")
    parser.add_argument("--pause-ms", type=float, default=3.0,
                        help="pause after each answer, as between an engine's steps (default 3)")
    parser.add_argument("--load", type=int, default=0,
                        help="other processes kept busy while the checks run (default 0; this host's cores: "
                             f"{os.cpu_count()})")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.checks < 2 or not args.pause_ms >= 0 or not 0 <= args.load <= 64:
        parser.error("--layers must be at least 1, --checks at least 2, --pause-ms at least 0 and --load 0 to 64")

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")  # host buffers shared as a CUDA step's are
    from kvdbg.sentinel.remote import CheckerProcess
    from tests.test_sentinel import _in_whole_buffers
    from tests.test_sentinel_process import _staged_step

    entries = _in_whole_buffers(_staged_step(args.layers), extra=6)
    children = {"compact": CheckerProcess("cpu", share_host=True),
                "default": CheckerProcess("cpu", share_host=True, command=[sys.executable, "-c", DEFAULT_CHILD]),
                "whole": CheckerProcess("cpu", share_host=True, command=[sys.executable, "-c", WHOLE_CHILD])}
    scheduling = {name: process.info.get("scheduling", _policy_name()) for name, process in children.items()}
    writes = {name: _TimedWrites(process) for name, process in children.items()}
    times: dict[str, list[int]] = {"python": [], "write_compact": [], "write_default": [], "answer_compact": [],
                                   "answer_default": [], "read_compact": [],
                                   "read_default": [], "read_whole": [], "look_skips": [], "look_asks": []}
    kinds: dict[str, set] = {name: set() for name in children}
    warm = min(20, args.checks // 2)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]) for _ in range(args.load)]
    try:
        for check in range(args.checks):
            for name, process in children.items():
                # The step's own metadata: host copies new every step, the staged buffers the same (the template).
                seq_lens = entries[0][1].seq_lens.clone()
                step = [(layer, dataclasses.replace(inputs, seq_lens=seq_lens)) for layer, inputs in entries]
                writes[name].ns = 0
                sent_at = time.perf_counter_ns()  # the answer's wait counts the send: a check may run during it
                process.submit(step, pairs=4, seed=check, step=check)
                sent, written = process.last_times[0], writes[name].ns
                if not process._conn.poll(30.0):
                    raise RuntimeError(f"no answer from the checker process (pid {process.pid}) within 30 s")
                came = time.perf_counter_ns() - sent_at
                read, results = _read(process)
                kinds[name].update(type(result).__name__ for result in results)
                if check >= warm:
                    if name == "compact":  # the send's Python is the same whichever child reads it
                        times["python"].append(sent - written)
                    if name != "whole":
                        times[f"write_{name}"].append(written)
                        times[f"answer_{name}"].append(came)
                    times[f"read_{name}"].append(read)
                time.sleep(args.pause_ms / 1e3)
        # Then, as many checks again to kvdbg's child alone: just after each send, a hook's look (too soon for an
        # answer: it asks nothing) and a read that asks (the answer not there yet, most times: those are kept).
        process = children["compact"]
        for check in range(args.checks - warm):
            process.submit(entries, pairs=4, seed=check, step=check)
            start = time.perf_counter_ns()
            early = process.answers(None)
            between = time.perf_counter_ns()
            early += process.answers(0.0)
            if not early:
                times["look_skips"].append(between - start)
                times["look_asks"].append(time.perf_counter_ns() - between)
                _read_time(process)
            time.sleep(args.pause_ms / 1e3)
        made = {name: process.templates for name, process in children.items()}
    finally:
        for process in busy:
            process.kill()
            process.wait()
        for process in children.values():
            process.close()
    medians = {name: statistics.median(values) / 1e3 if values else None for name, values in times.items()}
    writes_us = {name: {"median": medians[f"write_{name}"], "mean": statistics.fmean(times[f"write_{name}"]) / 1e3,
                        "p90": sorted(times[f"write_{name}"])[int(0.9 * (len(times[f"write_{name}"]) - 1))] / 1e3}
                 for name in ("compact", "default")}
    ratio = medians["read_whole"] / medians["read_compact"]
    print(f"sentinel send, {args.layers} layers, {args.checks - warm} checks a child after {warm}, {args.load} busy "
          f"processes on {os.cpu_count()} cores (medians, us):")
    print(f"  the send's Python, less its socket write  {medians['python']:8.1f}")
    own = _policy_name()
    for name, label in (("compact", f"kvdbg's child ({scheduling['compact']})"), ("default", f"the bench's ({own})")):
        w = writes_us[name]
        print(f"  its socket write, {label:<22}  {w['median']:8.1f}   mean {w['mean']:.1f}, 90th percentile "
              f"{w['p90']:.1f}")
    print(f"  mean write, default / kvdbg's child  {writes_us['default']['mean'] / writes_us['compact']['mean']:.2f}x")
    print(f"  the answer there, from the send's start: kvdbg's child {medians['answer_compact']:8.1f}   the bench's "
          f"{medians['answer_default']:.1f}")
    print(f"  the answer read, compact ({'/'.join(sorted(kinds['compact']))})  {medians['read_compact']:8.1f}")
    print(f"  the answer read, whole ({'/'.join(sorted(kinds['whole']))})      {medians['read_whole']:8.1f}"
          f"   whole / compact {ratio:.2f}x")
    looks = len(times["look_skips"])
    if looks:
        print(f"  a hook's look just after the send, too soon to ask  {medians['look_skips']:8.1f}   "
              f"a read that asks then {medians['look_asks']:.1f} ({looks} checks)")
    print(f"  templates made: compact child {made['compact']}, whole child {made['whole']}")
    print("SSEND-SUMMARY " + json.dumps({"layers": args.layers, "checks": args.checks - warm, "load": args.load,
                                         "cores": os.cpu_count(), "us": medians, "writes_us": writes_us,
                                         "scheduling": scheduling,
                                         "read_whole_over_compact": ratio, "templates": made,
                                         "answer_kinds": {n: sorted(k) for n, k in kinds.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
