"""Attention backends kvdbg replays, one module each; installed as ``kvdbg.backends``.

Modules are imported only when a backend is asked for, so that listing names
costs nothing and an optional dependency (flashinfer) is never imported early.
"""

from __future__ import annotations

import importlib

from kvdbg.errors import OptionError

# --backend name -> module defining BACKEND (a kvdbg.backends.base.BackendSpec)
BACKEND_MODULES = {
    "reference": "kvdbg.backends.reference",
    "flex": "kvdbg.backends.flex",
    "flashinfer_ts": "kvdbg.backends.flashinfer_ts",
    "vllm": "kvdbg.backends.vllm_native",
    "vllm_flex": "kvdbg.backends.vllm_flex",
}
# vllm runs the installed vLLM's own code for the snapshot's backend; where vLLM cannot run it, its column
# says why and nothing else changes. vllm_flex (vLLM's FLEX_ATTENTION on any snapshot) runs when named.
DEFAULT_ORDER = ("reference", "flex", "flashinfer_ts", "vllm")


# What users type for a backend: kvdbg's names, the engine's names the tables print beside them
# (FLEX_ATTENTION, FLASHINFER_TS), and the library's own name. Matched case-insensitively, - or _.
BACKEND_ALIASES = {"flex_attention": "flex", "flashinfer": "flashinfer_ts", "ref": "reference"}


def backend_names() -> list[str]:
    return list(BACKEND_MODULES)


def resolve_backend(name: str, option: str = "--backend") -> str:
    """The kvdbg backend ``name`` means; an unknown one lists the valid names and suggests the nearest."""
    import difflib

    names = tuple(BACKEND_MODULES)
    key = name.strip().lower().replace("-", "_")
    if key in names:
        return key
    if key in BACKEND_ALIASES:
        return BACKEND_ALIASES[key]
    close = difflib.get_close_matches(key, list(names) + list(BACKEND_ALIASES), n=1, cutoff=0.6)
    hint = f"; did you mean {BACKEND_ALIASES.get(close[0], close[0])}?" if close else ""
    raise OptionError(f"{option}: unknown backend {name!r}{hint} (choose from: {', '.join(names)}; "
                      "engine names FLEX_ATTENTION and FLASHINFER_TS work too)")


def get_backend(name: str):
    """The BackendSpec for ``name``; an unknown name lists the valid ones."""
    module = BACKEND_MODULES.get(name)
    if module is None:
        raise OptionError(f"unknown backend {name!r}; choose from: {', '.join(BACKEND_MODULES)}")
    return importlib.import_module(module).BACKEND
