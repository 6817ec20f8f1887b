"""Engine KV-cache layouts kvdbg captures from, declared per backend, and their conversion to snapshot layouts.

A snapshot stores pages in one of the format's layouts (``kvdbg.format.LAYOUTS``).
An engine cache may hold them otherwise: vLLM's CPU_ATTN keeps a
``[pages, Hkv, page_size, 2*D]`` tensor whose bytes are *not* token rows of
``[K | V]``. Two caches of the same shape can thus mean different things, so a
layout is never inferred from a shape: the capturing side names the engine
layout, and capture converts the copied pages to the snapshot layout.

CPU_ATTN, ``vec`` and ``vec16`` kernel variants (vLLM 0.32, checked by writing
known K/V with ``cpu_attn_reshape_and_cache`` and reading the bytes back)::

    one (page, head) slot of the cache: 2 * page_size * D elements, in memory order

    | K transposed: D rows of page_size keys | V: page_size rows of D values |
    |  k[0][d=0] k[1][d=0] ... k[N-1][d=0]   |  v[0][0..D-1]                |
    |  k[0][d=1] ...                         |  v[1][0..D-1]                |
    |  ...                                   |  ...                         |

    kvdbg's ``pages,heads,tokens,2*dim``: row t of the slot is [k[t][0..D-1] | v[t][0..D-1]]

The ``amx`` variant packs keys and values differently (not decoded by kvdbg):
it is refused, as is every variant not listed in :data:`CPU_ATTN_VERIFIED`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvdbg.cache import CPU_ATTN_K_TRANSPOSED, join_kv, split_kv
from kvdbg.errors import KvdbgError
from kvdbg.format import LAYOUT_KV_PLANES, LAYOUT_VLLM

# CPU_ATTN kernel variants ("isa", set by vLLM's CPU_ATTN builder on every layer)
# whose page layout kvdbg has verified against the engine's own cache writer.
CPU_ATTN_VERIFIED = {"vec": CPU_ATTN_K_TRANSPOSED, "vec16": CPU_ATTN_K_TRANSPOSED}

# vLLM backends whose page layout does not depend on a kernel variant.
FIXED_BACKEND_LAYOUTS = {"FLASHINFER_TS": LAYOUT_VLLM, "FLEX_ATTENTION": LAYOUT_VLLM}

# Every backend name kvdbg can capture from (the others are refused, not captured wrongly).
CAPTURABLE_BACKENDS = tuple(sorted([*FIXED_BACKEND_LAYOUTS, "CPU_ATTN"]))


class LayoutError(KvdbgError):
    """The engine's KV layout is unknown to kvdbg or does not match the cache tensor."""


@dataclass(frozen=True)
class EngineLayout:
    """How an engine cache tensor holds its pages, and how to turn copied pages into a snapshot layout."""

    name: str
    snapshot_layout: str  # the format layout the converted pages are in
    page_dim: int  # dimension of the engine tensor that indexes pages
    token_dim: int  # dimension whose length is the page size
    to_snapshot: Callable[[torch.Tensor], torch.Tensor] | None  # None: the pages are stored as they are
    description: str

    def expected_shape(self, num_kv_heads: int, head_size: int) -> str:
        if self.page_dim == 0:
            return f"[pages, {num_kv_heads}, page_size, {2 * head_size}]"
        return f"[2, pages, page_size, {num_kv_heads}, {head_size}]"

    def check(self, kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
        """Raise LayoutError unless ``kv_cache`` has this layout's shape (and strides, where they matter)."""
        shape = tuple(kv_cache.shape)
        if self.page_dim == 0:
            ok = len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size
        else:
            ok = len(shape) == 5 and shape[0] == 2 and shape[3] == num_kv_heads and shape[4] == head_size
        if not ok:
            raise LayoutError(f"kv_cache has shape {list(shape)}, not {self.expected_shape(num_kv_heads, head_size)} "
                              f"as layout {self.name!r} requires")
        if self.to_snapshot is not None:
            # The conversion reads each (page, head) slot in memory order, as the kernel does.
            tokens, width = shape[2], shape[3]
            if kv_cache.stride(3) != 1 or kv_cache.stride(2) != width:
                raise LayoutError(f"kv_cache strides {list(kv_cache.stride())}: layout {self.name!r} needs each "
                                  f"(page, head) slot of {tokens}x{width} elements contiguous")

    def convert(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages copied out of the engine cache (engine layout) → the same pages in :attr:`snapshot_layout`."""
        return pages if self.to_snapshot is None else self.to_snapshot(pages)


def _cpu_attn_to_vllm(pages: torch.Tensor) -> torch.Tensor:
    keys, values = split_kv(pages.contiguous(), CPU_ATTN_K_TRANSPOSED, pages.shape[-1] // 2)
    return join_kv(keys, values, LAYOUT_VLLM)


def vllm_to_cpu_attn(pages: torch.Tensor) -> torch.Tensor:
    """The inverse of the CPU_ATTN conversion: ``pages,heads,tokens,2*dim`` pages as CPU_ATTN's kernel stores them."""
    keys, values = split_kv(pages, LAYOUT_VLLM, pages.shape[-1] // 2)
    return join_kv(keys, values, CPU_ATTN_K_TRANSPOSED)


ENGINE_LAYOUTS: dict[str, EngineLayout] = {
    LAYOUT_VLLM: EngineLayout(LAYOUT_VLLM, LAYOUT_VLLM, 0, 2, None, "token rows of [K | V] per (page, head)"),
    LAYOUT_KV_PLANES: EngineLayout(LAYOUT_KV_PLANES, LAYOUT_KV_PLANES, 1, 2, None, "K and V planes of [page, token, head, dim]"),
    CPU_ATTN_K_TRANSPOSED: EngineLayout(
        CPU_ATTN_K_TRANSPOSED, LAYOUT_VLLM, 0, 2, _cpu_attn_to_vllm,
        "vLLM CPU_ATTN (vec, vec16): per (page, head), K transposed [D, page_size] then V [page_size, D]; "
        "converted to pages,heads,tokens,2*dim at capture",
    ),
}


def engine_layout(name: str) -> EngineLayout:
    """The layout registered under ``name``; LayoutError listing the known ones otherwise."""
    layout = ENGINE_LAYOUTS.get(name)
    if layout is None:
        raise LayoutError(f"kv_layout {name!r} is not a layout kvdbg knows; known: {', '.join(ENGINE_LAYOUTS)}")
    return layout


def backend_layout(backend_name: str, kernel_variant: str | None = None) -> str:
    """The engine layout of a vLLM backend's cache, given the kernel variant where the layout depends on it.

    Raises LayoutError (a one-line reason) for a backend or variant kvdbg has not verified.
    """
    if backend_name in FIXED_BACKEND_LAYOUTS:
        return FIXED_BACKEND_LAYOUTS[backend_name]
    if backend_name == "CPU_ATTN":
        if kernel_variant in CPU_ATTN_VERIFIED:
            return CPU_ATTN_VERIFIED[kernel_variant]
        raise LayoutError(
            f"CPU_ATTN's {kernel_variant!r} kernel variant stores pages in a layout kvdbg has not verified "
            f"(verified: {', '.join(CPU_ATTN_VERIFIED)}); nothing is captured from it"
            + (" (a bfloat16 model with a block size multiple of 32 on an AMX CPU selects 'amx'; "
               "a float16 model selects 'vec')" if kernel_variant == "amx" else "")
        )
    raise LayoutError(f"kvdbg does not know the KV-cache layout of backend {backend_name}; it can capture "
                      f"{', '.join(CAPTURABLE_BACKENDS)}")


__all__ = ["CAPTURABLE_BACKENDS", "CPU_ATTN_K_TRANSPOSED", "CPU_ATTN_VERIFIED", "ENGINE_LAYOUTS", "EngineLayout",
           "FIXED_BACKEND_LAYOUTS", "LayoutError", "backend_layout", "engine_layout", "vllm_to_cpu_attn"]
