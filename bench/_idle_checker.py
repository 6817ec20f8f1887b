"""graph_cost.py's ``--worker-check idle|spin`` on the checker process's path: kvdbg's checker process with its
check replaced, started by the engine's sentinel in place of ``python -m kvdbg.sentinel.child``:

    python bench/_idle_checker.py idle|spin MS FD DEVICE [host|device]

The child still receives every message and rebuilds each check's tensors from the engine's shared buffers (the
real child's work before its check), then, in place of the check: ``idle`` sleeps MS ms, ``spin`` keeps one CPU
core busy in Python for MS ms. Neither touches the device. Each answers with nothing compared. A step after a
draw that still costs what it did with the real check loses that time to the send, or to the child's being there
at all, not to the check's work; one that costs it only with ``spin`` loses it to the CPU work beside the engine.
"""

from __future__ import annotations

import os
import signal
import sys
import time

MODES = ("idle", "spin")


def nothing_compared(entries: list, step) -> list:
    """Each layer's result of a check that compared nothing (no pair, no non-finite value looked for)."""
    from kvdbg.judge.compare import default_tolerance
    from kvdbg.sentinel.checker import CheckResult

    return [CheckResult(layer=layer.name, step=step, tolerance=default_tolerance(layer.dtype)) for layer, _ in entries]


def stand_in(mode: str, ms: float):
    """A ``check_layers`` that does no check: it waits, or spins, ``ms`` and compares nothing."""
    from kvdbg.sentinel.checker import compact

    def check_layers(entries, *args, step=None, **kwargs):
        end = time.perf_counter() + ms / 1e3
        if mode == "idle":
            time.sleep(ms / 1e3)
        else:
            while time.perf_counter() < end:
                pass
        # in the form kvdbg's child answers in (kvdbg.sentinel.child): the engine reads what it reads from that one
        return compact(nothing_compared(entries, step))

    return check_layers


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Connection

    if len(argv) < 4 or argv[0] not in MODES:
        print("usage: python bench/_idle_checker.py idle|spin MS FD DEVICE [host|device]", file=sys.stderr)
        return 2
    mode, ms = argv[0], float(argv[1])
    conn = Connection(int(argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvdbg.sentinel.remote import serve

    try:
        return serve(conn, argv[3], stand_in(mode, ms), *argv[4:])
    except (EOFError, OSError):
        return 0


def command(mode: str, ms: float) -> list[str]:
    """The command the engine's sentinel starts in place of kvdbg's child (the FD, device and place follow)."""
    return [sys.executable, os.path.abspath(__file__), mode, str(ms)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
