"""The kernel library under a vLLM backend, as the vllm column ran it: FlashInfer's version, its wrappers, its builds.

vLLM's FLASHINFER backend plans FlashInfer's paged decode and prefill
wrappers and runs their kernels, which FlashInfer compiles on first use
(JIT) into its cache directory and loads from there afterwards. The column
says which wrappers the step's metadata held and whether this replay built a
kernel or found it built, read from FlashInfer itself (its version, its JIT
directory) around each build and forward, never assumed.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

# vLLM backends whose kernels come from FlashInfer (watched); any other backend's forward is left as it is.
FLASHINFER_BACKENDS = ("FLASHINFER",)


def built_modules(jit_dir: str | os.PathLike | None) -> set[str]:
    """The compiled modules (``.so`` files, relative paths) under FlashInfer's JIT directory; empty if none."""
    if not jit_dir or not os.path.isdir(jit_dir):
        return set()
    found = set()
    for root, _, files in os.walk(jit_dir):
        for name in files:
            if name.endswith(".so"):
                found.add(os.path.relpath(os.path.join(root, name), jit_dir))
    return found


def _wrapper_names(metadata: Any) -> list[str]:
    """FlashInfer objects the step's metadata holds, one level down (vLLM keeps each wrapper on a decode or
    prefill record): their class names, in the order found."""
    names: list[str] = []

    def visit(obj: Any, depth: int) -> None:
        if type(obj).__module__.startswith("flashinfer"):
            names.append(type(obj).__name__)
            return
        if depth == 0 or not hasattr(obj, "__dict__"):
            return
        for value in vars(obj).values():
            visit(value, depth - 1)

    visit(metadata, 2)
    return list(dict.fromkeys(names))


class FlashInferWatch:
    """What FlashInfer did under one column: wrappers planned, kernels built during this replay or found built."""

    def __init__(self) -> None:
        flashinfer = sys.modules.get("flashinfer")  # vLLM's backend module imported it when the column was made
        self.version = getattr(flashinfer, "__version__", None)
        self.path = os.path.dirname(getattr(flashinfer, "__file__", "") or "") or None
        self.jit_dir = self._jit_dir()
        self.wrappers: list[str] = []
        self.built: list[str] = []
        self.build_seconds = 0.0
        self.steps = 0

    @staticmethod
    def _jit_dir() -> str | None:
        env = sys.modules.get("flashinfer.jit.env")
        jit_dir = getattr(env, "FLASHINFER_JIT_DIR", None)
        return None if jit_dir is None else str(jit_dir)

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Note the kernel modules FlashInfer builds inside the block (the builder's plan() builds them, and a
        forward may build more)."""
        if self.jit_dir is None:
            self.jit_dir = self._jit_dir()
        before = built_modules(self.jit_dir)
        start = time.perf_counter()
        yield
        new = sorted(built_modules(self.jit_dir) - before)
        if new:
            self.built.extend(new)
            self.build_seconds += time.perf_counter() - start

    def saw(self, metadata: Any) -> None:
        """The wrappers a step's built metadata holds."""
        self.steps += 1
        for name in _wrapper_names(metadata):
            if name not in self.wrappers:
                self.wrappers.append(name)

    def note(self) -> str:
        where = f" from {self.path}" if self.path else ""
        line = f"FlashInfer {self.version or '(version unknown)'}{where}"
        if self.wrappers:
            line += f": vLLM's builder planned {', '.join(self.wrappers)}"
        if not self.steps:
            return line + "; no step built yet"
        if self.built:
            shown = ", ".join(os.path.basename(b).removesuffix(".so") for b in self.built[:3])
            more = f" and {len(self.built) - 3} more" if len(self.built) > 3 else ""
            return (line + f"; {len(self.built)} kernel module(s) JIT-built during this replay ({shown}{more}; "
                    f"{self.build_seconds:.0f} s in the builds and forwards that made them), then loaded")
        return line + f"; every kernel loaded already built (FlashInfer's JIT cache: {self.jit_dir or 'not found'})"


def watch_for(backend_name: str) -> FlashInferWatch | None:
    return FlashInferWatch() if backend_name in FLASHINFER_BACKENDS else None
