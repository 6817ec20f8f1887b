"""The debugging moves, each a replay with a changed input or a different look at it: poison,
shrink, sweep, diff, attention weights, pictures' key grids, ``window SNAP``'s source, the repro script,
synthetic snapshots and the bug report.

May import :mod:`kvdbg.replayer` and everything below it; never the capture, sentinel, fleet, vLLM
plugin, rendering or CLI packages.
"""
