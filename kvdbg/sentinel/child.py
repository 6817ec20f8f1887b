"""The sentinel's checker process: ``python -m kvdbg.sentinel.child FD DEVICE [host|device]``, started by
:class:`kvdbg.sentinel.remote.CheckerProcess` (never by hand), answers checks on the socket FD until the engine's
process stops it or closes its end. Apart from :mod:`kvdbg.sentinel.remote` because it needs the checker, which
imports that module.
"""

from __future__ import annotations

import os
import signal
import sys


def policy_name(policy: int) -> str:
    """A scheduling policy's number (``os.sched_getscheduler``) in a word: ``default`` (SCHED_OTHER), ``batch``,
    ``idle``, ``fifo``, ``rr``, else ``policy N``."""
    if policy == getattr(os, "SCHED_OTHER", None):
        return "default"
    names = ("BATCH", "IDLE", "FIFO", "RR")
    return next((name.lower() for name in names if getattr(os, f"SCHED_{name}", None) == policy), f"policy {policy}")


def behind_the_engine() -> str:
    """This process's threads, and those it starts later (torch's among them), scheduled as batch work (Linux's
    ``SCHED_BATCH``), and the policy they run under in words: ``batch``, else which and why. A check sent wakes
    this process's reader; under the default policy the woken thread may take the very core of the engine's
    thread that sent it, which then waits in its socket write while the check runs (on a busy host,
    milliseconds: ``bench/sentinel_send.py --load``). A batch thread takes no core on waking and still gets its
    fair share of a busy CPU, so checks are answered as before, a little later when the cores are all taken.
    The child starts under the engine's policy: one that already takes no core on waking (batch, idle) is kept,
    so that an engine run as idle work does not get a checker that outranks it."""
    if not hasattr(os, "SCHED_BATCH") or not hasattr(os, "sched_setscheduler"):
        return "default (this system has no SCHED_BATCH)"
    try:
        current = os.sched_getscheduler(0)
    except OSError as exc:
        return f"unknown (its policy could not be read: {exc.strerror or exc})"
    name = policy_name(current)
    if current in (os.SCHED_BATCH, getattr(os, "SCHED_IDLE", None)):
        return f"{name} (the engine's, kept)"
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:
        return f"{name} (SCHED_BATCH refused: {exc.strerror or exc})"
    return "batch"


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Connection

    from kvdbg.sentinel.config import REFERENCE_PLACES

    if len(argv) not in (2, 3) or not argv[0].isdigit() or any(a not in REFERENCE_PLACES for a in argv[2:]):
        print(f"usage: python -m kvdbg.sentinel.child FD DEVICE [{'|'.join(REFERENCE_PLACES)}] (started by kvdbg's "
              "sentinel, not by hand)", file=sys.stderr)
        return 2
    conn = Connection(int(argv[0]))
    scheduling = behind_the_engine()  # before any thread starts: each inherits it
    # The engine's process says when to stop (or closes its end): a Ctrl-C meant for the engine is not for this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvdbg.sentinel.checker import check_layers, compact
    from kvdbg.sentinel.remote import serve

    def answer(entries, **kwargs):
        return compact(check_layers(entries, **kwargs))

    try:
        return serve(conn, argv[1], answer, *argv[2:], facts={"scheduling": scheduling})
    except (EOFError, OSError):
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
