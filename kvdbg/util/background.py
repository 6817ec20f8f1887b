"""kvdbg's background threads inside an engine: their torch work stays on their own thread.

torch built with OpenMP gives every thread that runs a parallel operator its
own team of worker threads, as many as the process's torch thread count. An
engine's team usually has one thread per core already. A second team (say,
capture's writer converting a step's pages) takes the process past one
OpenMP thread per core, and from then on GNU OpenMP stops spinning while its
threads wait for work: each of the engine's parallel regions then wakes its
workers through the kernel. In vLLM's CPU build on 2 cores, a captured step
then took 2.6 times as long as with the writer on its own thread, the
engine stayed 1.7 times slower after capture ended, and capture's own hooks
took 1.8 times as long (docs/capture.md, "Cost of capture").

:func:`confine_torch_to_this_thread` sets the calling thread's OpenMP thread
count to one: its parallel operators run inline, and no team is made. It
touches nothing the engine's threads see (the count is the calling thread's
own; ``torch.set_num_threads`` would change the process's, and MKL's).
"""

from __future__ import annotations

import ctypes
import re


def confine_torch_to_this_thread() -> str:
    """Make torch's parallel operators run inline on the calling thread; says what was done (for a log line).

    Call it first thing in a background thread, before any torch work.
    """
    import torch

    # torch sets a thread's OpenMP count from the process's on its first parallel call in that thread; do
    # that now, so that the count set below is not overwritten then.
    before = torch.get_num_threads()
    if before == 1:
        return "torch runs one thread here already"
    tried = 0
    for set_count in _omp_set_num_threads():
        tried += 1
        set_count(1)
        if torch.get_num_threads() == 1:  # torch's runtime answered (another one only set its own count)
            return f"torch's parallel operators run on this thread alone (of {before})"
    if not tried:
        return f"no OpenMP runtime found; torch may use {before} threads here"
    return f"torch still uses {torch.get_num_threads()} threads here: none of the {tried} OpenMP runtime(s) " \
           "found is torch's"


_RUNTIME_NAMES = re.compile(r"/lib(?:g|i)?omp[^/]*\.(?:so|dylib)[^/]*$")


def _omp_set_num_threads():
    """``omp_set_num_threads`` of each OpenMP runtime loaded in the process: the global one first, then each
    library file mapped that is one (a process can hold two, say torch's GNU one and a preloaded Intel one)."""
    try:
        yield ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError, TypeError):  # no global one (or no global namespace: Windows)
        pass
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split(None, 5)[-1].strip() for line in maps if _RUNTIME_NAMES.search(line.strip())})
    except OSError:  # not Linux
        return
    for path in paths:
        try:
            yield ctypes.CDLL(path).omp_set_num_threads  # already loaded: the same library, not a second copy
        except (AttributeError, OSError):
            continue
