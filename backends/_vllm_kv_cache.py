"""The snapshot's stored pages as the KV cache vLLM's backend reads: its layout, its block ids, its page content.

vLLM gives every layer one logical cache ``[blocks, heads, tokens, content]``
whose physical strides follow a ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``)
that the backend supports; the engine allocates one flat byte buffer and views
it through ``create_kv_cache_views`` (``vllm/v1/kv_cache_interface.py``). kvdbg
does the same, with vLLM's own functions, for a cache of the stored pages::

    vLLM block:  0            1          2          ...
                 null block   stored[0]  stored[1]  ...    (engine page 0 stored: it stays block 0)

What each ``(block, head)`` slot holds is the backend's: token rows of
``[K | V]`` for the standard content, and for CPU_ATTN's vec/vec16 kernels K
transposed then V (``kvdbg.snapshot.layout.CPU_ATTN_K_TRANSPOSED``). FP8 caches are
copied as bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvdbg.snapshot.layout import CPU_ATTN_K_TRANSPOSED, join_kv
from kvdbg.errors import BackendUnavailable

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

# What a (block, head) slot of the cache holds, per backend whose content is not the standard [K | V] rows.
SLOT_CONTENT = {"CPU_ATTN": CPU_ATTN_K_TRANSPOSED}
# Key under which a snapshot's provenance may record the layout the engine resolved (KVCacheLayout name).
CAPTURED_LAYOUT_KEY = "kv_cache_layout"


def renumber(num_pages: int, null_page: int | None, device) -> tuple[torch.Tensor, int, bool]:
    """vLLM block of each stored page: the null block at 0, the others after it in stored order.

    Returns (block index per stored page, blocks in vLLM's cache, whether an all-zero null block was added).
    """
    stored = torch.arange(num_pages, device=device)
    if null_page is None:
        return stored + 1, num_pages + 1, True
    new_index = torch.where(stored < null_page, stored + 1, stored)
    new_index[null_page] = 0
    return new_index, num_pages, False


def supported_layouts(cls: type) -> list[Any]:
    """The layouts vLLM would resolve among for a model served by ``cls`` alone, most preferred first."""
    try:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    except ImportError:
        get_supported_kv_cache_layouts = None
    if get_supported_kv_cache_layouts is not None:
        return list(get_supported_kv_cache_layouts([cls]))
    declared = cls.supported_kv_cache_layouts()
    if declared is None:
        raise BackendUnavailable(f"vLLM's {cls.get_name()} declares no KV-cache layout this vLLM can resolve")
    return list(declared)


def choose_layout(cls: type, meta: "SnapshotMeta") -> tuple[Any, str]:
    """The layout to build the cache in, and why: the engine's own (when the snapshot records one the backend
    supports), else the one vLLM prefers for this backend."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    candidates = supported_layouts(cls)
    captured = meta.capture.get(CAPTURED_LAYOUT_KEY) if isinstance(meta.capture, dict) else None
    if isinstance(captured, str) and captured in KVCacheLayout.__members__:
        layout = KVCacheLayout[captured]
        if layout in candidates:
            return layout, "the layout the engine resolved (capture.kv_cache_layout)"
        raise BackendUnavailable(f"the snapshot says the engine's cache was {captured}, which vLLM's "
                                 f"{cls.get_name()} does not support (it supports "
                                 f"{', '.join(c.name for c in candidates)})")
    return candidates[0], f"vLLM's first choice for {cls.get_name()}"


def resolve_engine_layout(config: Any, cls: type, spec: Any, meta: "SnapshotMeta", chosen: Any, source: str) -> Any:
    """Resolve the model's KV-cache layout on ``config`` as vLLM's engine core does before any builder runs.

    vLLM >= 0.33 resolves one layout per model (``resolve_kv_cache_layout``:
    the workers report their backends' supported layouts, the engine core
    picks, ``cache_config.kv_cache_layout`` records it) and the builders of
    some backends (FLASHINFER) read it back; a config left unresolved makes
    them fail. The layout the engine recorded in the snapshot is adopted as a
    worker adopts the engine core's; otherwise vLLM resolves it. Either way it
    must be the layout kvdbg views the cache with (``chosen``); where vLLM
    resolves another (``VLLM_KV_CACHE_LAYOUT``, a connector's preference) the
    column is unavailable with both names. Returns the layout recorded, or
    None for a vLLM that resolves no layout.
    """
    try:
        from vllm.v1.attention.backends.utils import record_kv_cache_layout, resolve_kv_cache_layout
    except ImportError:  # vLLM before one resolved layout per model: each builder asks nothing
        return None
    cache_config = config.cache_config
    if not hasattr(cache_config, "kv_cache_layout"):
        return None
    captured = meta.capture.get(CAPTURED_LAYOUT_KEY) if isinstance(meta.capture, dict) else None
    if captured == chosen.name:
        record_kv_cache_layout(cache_config, chosen.name)
    reported = [[layout.name for layout in supported_layouts(cls)]]  # one worker, the column's one backend
    resolved = resolve_kv_cache_layout(config, reported, [spec])
    if resolved != chosen:
        raise BackendUnavailable(f"vLLM resolves the KV-cache layout {resolved.name} here (VLLM_KV_CACHE_LAYOUT "
                                 f"or a KV connector's preference), but the cache is viewed as {chosen.name} "
                                 f"({source})")
    return resolved


def allocate(spec: Any, layout: Any, num_blocks: int, layer_name: str, device) -> torch.Tensor:
    """The layer's logical ``[blocks, heads, tokens, content]`` cache, allocated and viewed as vLLM does."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views

    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, num_blocks, 1, layout)
    size = spec.page_size_bytes * num_blocks
    tensor = KVCacheTensor(size=size, layers=[layer_name], layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)[0]


def check_view(view: torch.Tensor, meta: "SnapshotMeta", backend: str) -> None:
    """The view holds one K and one V of ``head_size`` per (block, head, token): content kvdbg can place."""
    layer = meta.layer
    expected = (view.shape[0], layer.num_kv_heads, meta.backend.page_size, 2 * layer.head_size)
    if tuple(view.shape) != expected:
        raise BackendUnavailable(f"vLLM's {backend} packs its cache as {list(view.shape)} per layer, not the "
                                 f"standard K/V content {list(expected)} kvdbg can fill")


def place_pages(view: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, new_index: torch.Tensor,
                content: str | None) -> None:
    """Write the stored pages' K and V ``[pages, Hkv, page_size, D]`` into blocks ``new_index`` of ``view``."""
    if keys.dtype != view.dtype:
        # FP8 pages (e4m3 views of the stored bytes) into vLLM's byte cache; any other pair has equal dtypes.
        keys, values = keys.view(view.dtype), values.view(view.dtype)
    if content == CPU_ATTN_K_TRANSPOSED:
        view[new_index] = join_kv(keys, values, CPU_ATTN_K_TRANSPOSED)
        return
    d = keys.shape[-1]
    view[new_index, :, :, :d] = keys
    view[new_index, :, :, d:] = values


__all__ = ["CAPTURED_LAYOUT_KEY", "SLOT_CONTENT", "allocate", "check_view", "choose_layout", "place_pages",
           "renumber", "supported_layouts"]
