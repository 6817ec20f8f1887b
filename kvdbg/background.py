"""kvdbg's background threads inside an engine: their torch work stays on their own thread.

torch built with OpenMP gives every thread that runs a parallel operator its
own team of worker threads, as many as the process's torch thread count. An
engine's team usually has one thread per core already. A second team (say,
capture's writer converting a step's pages) takes the process past one
OpenMP thread per core, and from then on GNU OpenMP stops spinning while its
threads wait for work: each of the engine's parallel regions then wakes its
workers through the kernel. The engine's whole step was 2-3 times slower for
the rest of the process on a 2-core vLLM (CPU) from the writer's first
snapshot on, and capture's own hooks twice as slow.

:func:`confine_torch_to_this_thread` sets the calling thread's OpenMP thread
count to one: its parallel operators run inline, and no team is made. It
touches nothing the engine's threads see (the count is the calling thread's
own; ``torch.set_num_threads`` would change the process's, and MKL's).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger("kvdbg.capture")


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
    try:
        set_count = ctypes.CDLL(None).omp_set_num_threads  # the OpenMP runtime torch loaded (Linux, macOS)
    except (AttributeError, OSError, TypeError):
        return f"no OpenMP runtime found; torch may use {before} threads here"
    set_count(1)
    after = torch.get_num_threads()
    if after != 1:  # a runtime that is not torch's answered the call
        return f"torch still uses {after} threads here (another OpenMP runtime answered)"
    return f"torch's parallel operators run on this thread alone (of {before})"
