"""Give freed tensor memory back to the system at once (glibc), for a command's own process.

A CPU replay allocates temporaries of a few MiB to a few hundred MiB, phase
after phase (the input scan, the reference's chunks, flex's calls). glibc's
malloc raises its mmap threshold to the size of each large block freed, so
later blocks of that size come from the heap instead, where freed space stays
resident until the heap's top is trimmed: the same replay peaked 100-300 MiB
apart from run to run on the 2-core machine (docs/benchmarks.md). A fixed
threshold keeps every block of 1 MiB or more in a mapping of its own, unmapped
on free: peak RSS is what is live, not what was once. Small blocks keep the
heap. The cost is a fresh mapping per large block (page faults), lost in a
replay's arithmetic.

Process-wide, so only the command line applies it (kvdbg.cli), never the
library: an engine running kvdbg's sentinel keeps its own malloc settings.
"""

from __future__ import annotations

import sys

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LARGE_BLOCK = 1 << 20
_applied: bool | None = None


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 1 MiB (and its trim threshold at 2 MiB); False where there is no glibc."""
    global _applied
    if _applied is None:
        _applied = False
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                libc = ctypes.CDLL("libc.so.6")
                _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK)) and \
                    bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * LARGE_BLOCK))
            except (OSError, AttributeError):  # musl and others: no mallopt, nothing to do
                _applied = False
    return _applied
