"""Attention backends kvdbg replays, one module each; installed as ``kvdbg.backends``.

Modules are imported only when a backend is asked for, so that listing names
costs nothing and an optional dependency (flashinfer) is never imported early.
"""

from __future__ import annotations

import importlib

from kvdbg.errors import OptionError

# --backend name -> module defining BACKEND (a kvdbg.attention.BackendSpec)
BACKEND_MODULES = {
    "reference": "kvdbg.backends.reference",
    "flex": "kvdbg.backends.flex",
    "flashinfer_ts": "kvdbg.backends.flashinfer_ts",
    "vllm_flex": "kvdbg.backends.vllm_flex",
}
# vllm_flex runs the installed vLLM's own code; without vLLM its column says so and nothing else changes.
DEFAULT_ORDER = ("reference", "flex", "flashinfer_ts", "vllm_flex")


def backend_names() -> list[str]:
    return list(BACKEND_MODULES)


def get_backend(name: str):
    """The BackendSpec for ``name``; an unknown name lists the valid ones."""
    module = BACKEND_MODULES.get(name)
    if module is None:
        raise OptionError(f"unknown backend {name!r}; choose from: {', '.join(BACKEND_MODULES)}")
    return importlib.import_module(module).BACKEND
