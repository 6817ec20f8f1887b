"""What another Python thread's wish for the GIL costs a thread that makes small torch calls (any machine, CPU).

Usage:
    python bench/gil_handover.py [--calls 10] [--elements 32768] [--iters 1000] [--switch-ms 5]

A torch call releases the GIL while it dispatches. When another thread of the process is waiting for the
GIL and wakes while the call runs (a free core), it takes it, and the caller waits to get it back before it
can go on: a hand-over, and a wait, at such a call. A thread running pure Python gives the lock back only
when the interpreter asks it to (after ``sys.getswitchinterval()``, 5 ms by default), so each such call
then costs the caller a whole interval. Run it on an idle machine: on a loaded one the other thread wakes
late and the hand-overs mostly do not happen (the bench says so when the load is over half the cores).

This is a reading of why the engine's thread's part of a wanted CUDA-graph step costs about four times more
inside vLLM's engine than in ``bench/staging_calls.py`` alone (docs/benchmarks.md §10); this bench measures
the mechanism on its own.

A *caller* thread makes ``--calls`` torch calls in a row (copies of ``--elements`` int64, a few µs each, as
long as a CUDA runtime call) ``--iters`` times. Each sequence is timed on the caller's thread: wall time
(``perf_counter_ns``), the thread's own CPU time (``time.thread_time_ns``: wall less CPU is time off the CPU,
waiting), and the thread's voluntary context switches (``getrusage(RUSAGE_THREAD)``: each wait for the GIL
is one). It runs beside three kinds of *other* thread:

- ``alone``: none;
- ``torch-worker``: one that makes small torch and numpy calls in a loop (as kvdbg's capture thread and writer
  do: work that releases the GIL often);
- ``python-worker``: one that runs pure Python (it gives the GIL back only when the interpreter asks it to,
  after ``sys.getswitchinterval()``);
- ``kvdbg-writer``: kvdbg's own snapshot write, over and over (validation, the safetensors header, the
  atomic write of a synthetic step of four requests, 8 query heads over 2 KV heads of 128, bfloat16), at the
  niceness kvdbg's background writer thread takes (kvdbg.capture.writer): what capturing costs an engine's
  thread while the steps after a capture are written.

and the same with one call a sequence (``--calls 1``'s figure is printed beside), so the cost per call shows.
About two minutes with the defaults (beside pure Python each call waits a switch interval).
Prints one line per case, the ratios against ``alone`` from this one run, and ``GIL-HANDOVER {json}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import threading
import time


def _sequence(calls: int, elements: int):
    """``calls`` torch calls in a row, each a copy of ``elements`` int64 (about as long as a CUDA runtime call at
    the default: a few µs, the GIL released meanwhile)."""
    import torch

    source = torch.arange(elements, dtype=torch.int64)
    target = torch.empty(elements, dtype=torch.int64)

    def run() -> None:
        for _ in range(calls):
            target.copy_(source)

    return run


def _time(run, iters: int) -> dict:
    for _ in range(20):
        run()
    wall, cpu, switches = [], [], []
    who = getattr(resource, "RUSAGE_THREAD", None)  # Linux; elsewhere no count of switches

    def switched() -> int:
        return 0 if who is None else resource.getrusage(who).ru_nvcsw

    began = time.perf_counter_ns()
    for _ in range(iters):
        before = switched()
        c0 = time.thread_time_ns()
        w0 = time.perf_counter_ns()
        run()
        w1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        switches.append(switched() - before)
        wall.append(w1 - w0)
        cpu.append(c1 - c0)
    whole = time.perf_counter_ns() - began
    ordered = sorted(wall)
    return {"wall_us": statistics.median(wall) / 1e3, "wall_p90_us": ordered[int(0.9 * (iters - 1))] / 1e3,
            "wall_p99_us": ordered[int(0.99 * (iters - 1))] / 1e3, "wall_max_us": ordered[-1] / 1e3,
            "stalled": sum(w > 1_000_000 for w in wall) / iters,  # sequences that waited over a millisecond
            "mean_us": statistics.fmean(wall) / 1e3, "loop_us": whole / iters / 1e3,
            "cpu_us": statistics.median(cpu) / 1e3,
            "off_cpu_us": statistics.median([max(0, w - c) for w, c in zip(wall, cpu)]) / 1e3,
            "switches": statistics.fmean(switches) if who is not None else None}


class _Other:
    """A second thread of the process, of one kind, running until stopped."""

    def __init__(self, kind: str):
        self.kind, self.stop, self.loops = kind, threading.Event(), 0
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        import numpy as np
        import torch

        if self.kind == "kvdbg-writer":
            return self._write()
        a = torch.zeros(2048)
        b = np.zeros(2048)
        while not self.stop.is_set():
            if self.kind == "torch-worker":
                a.add_(1.0)
                torch.index_select(a, 0, torch.arange(64))
                b += 1.0
            else:
                total = 0
                for i in range(2000):
                    total += i * i
            self.loops += 1

    def _write(self) -> None:
        import os
        import tempfile

        from kvdbg.capture.writer import writer_niceness
        from kvdbg.moves.synth import SynthSpec, synth_snapshot
        from kvdbg.snapshot.store import save_snapshot

        try:  # as kvdbg's writer thread does (Linux)
            me = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, me, writer_niceness(os.getpriority(os.PRIO_PROCESS, me)))
        except (AttributeError, OSError):
            pass
        snapshot = synth_snapshot(SynthSpec(seq_lens=(300, 77, 150, 512), num_heads=8, num_kv_heads=2,
                                            head_size=128, page_size=16))
        with tempfile.TemporaryDirectory(prefix="kvdbg-gil-") as directory:
            while not self.stop.is_set():
                path = os.path.join(directory, f"step{self.loops % 2}.safetensors")
                save_snapshot(snapshot, path, overwrite=True)
                self.loops += 1

    def __enter__(self):
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _count(value: float | None) -> str:
    return "    ?" if value is None else f"{value:5.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10, help="torch calls a sequence [10]")
    parser.add_argument("--elements", type=int, default=32768,
                        help="int64 elements each call copies [32768: about 5 us, as long as a CUDA launch]")
    parser.add_argument("--iters", type=int, default=1000, help="sequences timed a case [1000]")
    parser.add_argument("--switch-ms", type=float, default=None,
                        help="the interpreter's switch interval for the run (default: as it is)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.iters < 10 or args.elements < 1 or (args.switch_ms is not None
                                                                   and not 0 < args.switch_ms <= 1000):
        print("gil_handover: --calls and --elements must be >= 1, --iters >= 10, --switch-ms in (0, 1000]",
              file=sys.stderr)
        return 2
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    import os

    import torch

    load, cores = os.getloadavg(), os.cpu_count() or 1  # the machine as the cases begin

    torch.set_num_threads(1)  # one intra-op thread: the caller's calls stay on the caller's thread
    cases = {}
    for kind in ("alone", "torch-worker", "python-worker", "kvdbg-writer"):
        for calls in dict.fromkeys((1, args.calls)):
            run = _sequence(calls, args.elements)
            if kind == "alone":
                cases[(kind, calls)] = _time(run, args.iters)
            else:
                with _Other(kind):
                    cases[(kind, calls)] = _time(run, args.iters)
    print(f"gil_handover: {args.iters} sequences a case, calls of {args.elements} elements, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms, Python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{cores} cores, load {load[0]:.2f} before the cases, {os.getloadavg()[0]:.2f} after")
    if max(load[0], os.getloadavg()[0]) > cores / 2:
        # A waiting thread takes the lock only if it wakes within the call: with no core free it wakes late and
        # the hand-overs this bench measures mostly do not happen.
        print("  (a loaded machine: the other thread wakes late and takes the lock less often than on an idle "
              "one; run it idle)")
    rows = []
    for (kind, calls), f in cases.items():
        alone = cases[("alone", calls)]
        ratio = f["wall_us"] / alone["wall_us"] if alone["wall_us"] else None
        loop = f["loop_us"] / alone["loop_us"] if alone["loop_us"] else None
        rows.append({"other": kind, "calls": calls, **f, "median_to_alone": ratio, "loop_to_alone": loop})
        print(f"  {kind:13s} {calls:2d} call(s): median {f['wall_us']:7.1f} us ({ratio:5.2f}x alone), p99 "
              f"{f['wall_p99_us']:8.1f}, max {f['wall_max_us']:8.1f}; stalled > 1 ms {f['stalled']:6.1%}; off the "
              f"CPU {f['off_cpu_us']:6.1f} us, switches {_count(f['switches'])} a sequence; a loop turn "
              f"{loop:5.2f}x alone")
    print("GIL-HANDOVER " + json.dumps({"switch_interval_ms": sys.getswitchinterval() * 1e3, "iters": args.iters,
                                        "cores": cores, "load_before": load[0], "load_after": os.getloadavg()[0],
                                        "elements": args.elements, "python": sys.version.split()[0],
                                        "torch": torch.__version__, "cases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
