"""kvdbg: inspect, replay and debug paged KV caches of LLM serving engines.

The package imports nothing heavy at start: torch-backed names are loaded on
first use so that ``kvdbg --help``, ``info`` and ``window`` stay instant.
"""

from kvdbg._version import __version__

_LAZY = {
    "Snapshot": "kvdbg.snapshot.store",
    "Step": "kvdbg.snapshot.store",
    "save_snapshot": "kvdbg.snapshot.store",
    "load_snapshot": "kvdbg.snapshot.store",
    "open_snapshot": "kvdbg.snapshot.format",
    "SynthSpec": "kvdbg.moves.synth",
    "synth_snapshot": "kvdbg.moves.synth",
    "SnapshotError": "kvdbg.errors",
    "KvdbgError": "kvdbg.errors",
    # the main job and the debugging moves (kvdbg.api: torch is imported by each call, not here)
    "replay": "kvdbg.api",
    "page_map": "kvdbg.api",
    "window": "kvdbg.api",
    "shrink": "kvdbg.api",
    "poison": "kvdbg.api",
    "sweep": "kvdbg.api",
    "diff": "kvdbg.api",
    "attention": "kvdbg.api",
    "error_pictures": "kvdbg.api",
    "Capturer": "kvdbg.capture.capturer",
    "Finding": "kvdbg.judge.findings",
    "CODES": "kvdbg.judge.findings",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvdbg' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
