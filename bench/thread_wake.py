"""What handing a job to a waiting thread costs the thread that hands it (any machine, CPU).

Usage:
    python bench/thread_wake.py [--handoffs 2000] [--pause-ms 0.5]

A wanted step replayed from vLLM's full CUDA graph on its shape's ticket is handed to kvdbg's graph capture thread
through a ``queue.SimpleQueue`` (kvdbg.vllm_plugin.graph_hooks), and that thread is blocked in ``get()`` between
captures: the engine's ``put`` then wakes it, a system call that posts the other thread's lock and, where the other
thread sleeps on another core, an interrupt to that core. The stand-ins' wanted row of ``bench/graph_cost.py``
hands its steps to a list and pays none of it; the engine's figures pay it.

Each hand-off is timed on the handing thread (``perf_counter_ns``), ``--pause-ms`` after the last, so the other
thread is asleep again:

    put, nobody waiting   SimpleQueue.put with no thread in get() (a C call, no wake)
    put, a thread waiting SimpleQueue.put to a thread blocked in get()
    pipe write            os.write of one byte to a thread blocked in os.read
    Event.set             threading.Event.set to a thread blocked in wait()

Printed: the median and 90th percentile of each, in µs, and each wake's median over the put with nobody waiting.
Ends with one JSON line (``THREAD-WAKE {...}``); exits 1 if a waiting thread did not get every hand-off.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time


def _timed(hand, handoffs: int, pause_s: float) -> list[int]:
    spent = []
    for i in range(handoffs):
        time.sleep(pause_s)
        start = time.perf_counter_ns()
        hand(i)
        spent.append(time.perf_counter_ns() - start)
    return spent


def _waiting_queue(handoffs: int, pause_s: float) -> tuple[list[int], int]:
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    got = [0]

    def take() -> None:
        while jobs.get() is not None:
            got[0] += 1

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    try:
        return _timed(jobs.put, handoffs, pause_s), got
    finally:
        jobs.put(None)
        taker.join()


def _waiting_pipe(handoffs: int, pause_s: float) -> tuple[list[int], int]:
    read_end, write_end = os.pipe()
    got = [0]

    def take() -> None:
        while True:
            data = os.read(read_end, 64)  # hand-offs the thread was slow to read come together
            got[0] += data.count(b"1")
            if b"x" in data:
                return

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    try:
        return _timed(lambda _: os.write(write_end, b"1"), handoffs, pause_s), got
    finally:
        os.write(write_end, b"x")
        taker.join()
        os.close(read_end)
        os.close(write_end)


def _waiting_event(handoffs: int, pause_s: float) -> tuple[list[int], list[int]]:
    event, stop = threading.Event(), False
    got = [0]

    def take() -> None:
        while not stop:
            event.wait()
            event.clear()
            got[0] += 1  # a set the thread was slow to see may cover the next: counted, not required

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    try:
        return _timed(lambda _: event.set(), handoffs, pause_s), got
    finally:
        stop = True
        event.set()
        taker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handoffs", type=int, default=2000)
    parser.add_argument("--pause-ms", type=float, default=0.5)
    args = parser.parse_args()
    if args.handoffs < 2:
        parser.error("--handoffs must be at least 2")
    if not 0 <= args.pause_ms <= 1000:
        parser.error("--pause-ms must be within 0..1000")
    pause_s = args.pause_ms / 1e3
    alone: queue.SimpleQueue = queue.SimpleQueue()
    runs = {"put, nobody waiting": (_timed(alone.put, args.handoffs, pause_s), [alone.qsize()])}
    runs["put, a thread waiting"] = _waiting_queue(args.handoffs, pause_s)
    runs["pipe write"] = _waiting_pipe(args.handoffs, pause_s)
    runs["Event.set"] = _waiting_event(args.handoffs, pause_s)
    figures = {name: {"median_us": statistics.median(ns) / 1e3, "p90_us": statistics.quantiles(ns, n=10)[-1] / 1e3,
                      "received": got[0]} for name, (ns, got) in runs.items()}
    base = figures["put, nobody waiting"]["median_us"]
    print(f"{args.handoffs} hand-offs each, {args.pause_ms} ms apart; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.2f}")
    for name, fig in figures.items():
        ratio = "" if name == "put, nobody waiting" else \
            f"  ({fig['median_us'] / base:.0f}x the put with nobody waiting)"
        print(f"  {name:22s} median {fig['median_us']:7.2f} us, p90 {fig['p90_us']:7.2f} us{ratio}")
    print("THREAD-WAKE " + json.dumps({"handoffs": args.handoffs, "pause_ms": args.pause_ms, "figures": figures}))
    lost = [name for name, fig in figures.items() if name != "Event.set" and fig["received"] != args.handoffs]
    if lost:
        print(f"not every hand-off was received: {', '.join(lost)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
