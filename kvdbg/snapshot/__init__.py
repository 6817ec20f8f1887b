"""The snapshot model: the metadata schema (``meta``) and the file with its checks (``format``), both
without torch; the value rules of ids, lengths and layer values (``rules``, no torch: ``store`` validates with them, and so does `kvdbg window
SNAP`), the K/V layouts of the page tensor (``layout``), loading and saving (``store``), the working cache
a replay writes into (``cache``), page maps (``pagemap``), tensor-parallel ranks and their merge (``ranks``,
``merge``), the header summary (``info``).

May import :mod:`kvdbg.errors`, :mod:`kvdbg.util`, :mod:`kvdbg.judge`, :mod:`kvdbg.ts`.

``kvdbg.snapshot`` was one module before it was a package: the names users imported from it
(``Snapshot``, ``Step``, ``load_snapshot``, ``save_snapshot``, ``open_snapshot``) are re-exported
here, loaded on first use so that importing the package imports no torch.
"""

_REEXPORTS = {
    "Snapshot": "kvdbg.snapshot.store",
    "Step": "kvdbg.snapshot.store",
    "load_snapshot": "kvdbg.snapshot.store",
    "save_snapshot": "kvdbg.snapshot.store",
    "open_snapshot": "kvdbg.snapshot.store",
}


def __getattr__(name: str):
    module = _REEXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvdbg.snapshot' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
