"""The sentinel's checker process: ``python -m kvdbg.sentinel.child FD DEVICE [host|device]``, started by
:class:`kvdbg.sentinel.remote.CheckerProcess` (never by hand), answers checks on the socket FD until the engine's
process stops it or closes its end. Apart from :mod:`kvdbg.sentinel.remote` because it needs the checker, which
imports that module.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Connection

    from kvdbg.sentinel.config import REFERENCE_PLACES

    if len(argv) not in (2, 3) or not argv[0].isdigit() or any(a not in REFERENCE_PLACES for a in argv[2:]):
        print(f"usage: python -m kvdbg.sentinel.child FD DEVICE [{'|'.join(REFERENCE_PLACES)}] (started by kvdbg's "
              "sentinel, not by hand)", file=sys.stderr)
        return 2
    conn = Connection(int(argv[0]))
    # The engine's process says when to stop (or closes its end): a Ctrl-C meant for the engine is not for this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvdbg.sentinel.checker import check_layers, compact
    from kvdbg.sentinel.remote import serve

    def answer(entries, **kwargs):
        return compact(check_layers(entries, **kwargs))

    try:
        return serve(conn, argv[1], answer, *argv[2:])
    except (EOFError, OSError):
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
