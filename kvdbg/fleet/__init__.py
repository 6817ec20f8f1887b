"""Many snapshots at once: a fleet run (``runs``), worker processes per CPU or GPU (``workers``), Ray
tasks (``ray_executor``), the results file (``results``) and the grouping of failures (``triage``).

May import :mod:`kvdbg.replayer` and everything below it.
"""
