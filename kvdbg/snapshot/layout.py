"""The page tensor's geometry: K/V views of every layout, FP8 scaling, the stored-page lookup.

Every layout's geometry, the FP8 rule and the engine-page -> stored-page
lookup live here once; the snapshot, its working cache, the replay core, the
backends, synth, shrink and capture call them. Nothing here knows a Snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvdbg.errors import OptionError
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

__all__ = ["CPU_ATTN_K_TRANSPOSED", "FP8_MAX", "KV_VIEW_LAYOUTS", "as_fp8", "dequantize_fp8", "finite_pages", "holds_fp8", "read_value_magnitudes", "join_kv", "kv_head_dim", "kv_views", "page_dim", "quantize_fp8", "split_kv", "stored_index"]

# float8_e4m3fn's largest finite value: vLLM's FP8 cache write saturates here.
FP8_MAX = 448.0

# vLLM CPU_ATTN's page layout (vec, vec16 kernel variants), an engine layout that capture converts
# (kvdbg.capture.engine_layouts declares which backend uses it).
CPU_ATTN_K_TRANSPOSED = "cpu_attn:pages,heads,[dim,tokens]k+[tokens,dim]v"

# Every layout split_kv can view: the snapshot format's two, and the engine layout capture reads.
KV_VIEW_LAYOUTS = (LAYOUT_VLLM, LAYOUT_KV_PLANES, CPU_ATTN_K_TRANSPOSED)


# --------------------------------------------------------------------------- layouts and K/V views

# Dimension of a cache tensor that indexes pages, and the one that indexes KV heads, per layout.
_PAGE_DIM = {LAYOUT_VLLM: 0, LAYOUT_KV_PLANES: 1, CPU_ATTN_K_TRANSPOSED: 0}
_HEAD_DIM = {LAYOUT_VLLM: 1, LAYOUT_KV_PLANES: 3, CPU_ATTN_K_TRANSPOSED: 1}


def _known(layout: str) -> str:
    if layout not in KV_VIEW_LAYOUTS:
        raise OptionError(f"kv_layout {layout!r} is not a layout kvdbg reads; known: {', '.join(KV_VIEW_LAYOUTS)}")
    return layout


def page_dim(layout: str) -> int:
    """The dimension of a cache in ``layout`` that indexes pages."""
    return _PAGE_DIM[_known(layout)]


def kv_head_dim(layout: str) -> int:
    """The dimension of a cache in ``layout`` that indexes KV heads."""
    return _HEAD_DIM[_known(layout)]


def split_kv(cache: torch.Tensor, layout: str, head_size: int, *,
             fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as views ``[pages, Hkv, page_size, D]`` of a cache in ``layout``; nothing is copied.

    ``pages,heads,tokens,2*dim`` (vLLM)::

        cache[p, h, t] = | k[0..D-1] | v[0..D-1] |     K, V: the two halves, token stride 2*D

    ``2,pages,tokens,heads,dim``::

        cache[0, p, t, h] = k,  cache[1, p, t, h] = v   K, V: the planes, heads and tokens swapped

    CPU_ATTN (vec, vec16), one (page, head) slot of ``2*page_size*D`` elements in memory order::

        | K transposed: D rows of page_size keys | V: page_size rows of D values |

    The CPU_ATTN views need each slot contiguous (``EngineLayout.check`` makes
    sure of it). With ``fp8``, a cache held as uint8 bytes is viewed as e4m3.
    """
    _known(layout)
    if fp8:
        cache = as_fp8(cache)
    if layout == LAYOUT_VLLM:
        return cache[..., :head_size], cache[..., head_size:]
    if layout == LAYOUT_KV_PLANES:
        return cache[0].permute(0, 2, 1, 3), cache[1].permute(0, 2, 1, 3)
    pages, heads, page_size, _ = cache.shape  # CPU_ATTN
    slots = cache.view(pages, heads, 2, page_size * head_size)
    keys = slots[:, :, 0].view(pages, heads, head_size, page_size).transpose(-1, -2)
    return keys, slots[:, :, 1].view(pages, heads, page_size, head_size)


def join_kv(keys: torch.Tensor, values: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of :func:`split_kv`: a new contiguous cache in ``layout`` from K and V ``[pages, Hkv, ps, D]``."""
    _known(layout)
    if layout == LAYOUT_VLLM:
        return torch.cat([keys, values], dim=-1).contiguous()
    if layout == LAYOUT_KV_PLANES:
        return torch.stack([keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)]).contiguous()
    pages, heads, page_size, head_size = keys.shape  # CPU_ATTN
    slot = page_size * head_size
    joined = torch.stack([keys.transpose(-1, -2).reshape(pages, heads, slot), values.reshape(pages, heads, slot)],
                         dim=2)
    return joined.reshape(pages, heads, page_size, 2 * head_size).contiguous()


def kv_views(meta: "SnapshotMeta", cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[pages, Hkv, page_size, D]`` of a cache in ``meta``'s layout and dtype (no copy)."""
    return split_kv(cache, meta.kv_layout, meta.layer.head_size, fp8=meta.layer.is_fp8)


# --------------------------------------------------------------------------- FP8


def as_fp8(t: torch.Tensor) -> torch.Tensor:
    """FP8 values held as uint8 bytes, viewed as float8_e4m3fn (any other tensor as it is)."""
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def holds_fp8(t: torch.Tensor) -> bool:
    """Whether ``t`` holds e4m3 values: float8_e4m3fn, or their bytes as uint8 (an FP8 snapshot's query, say)."""
    return t.dtype in (torch.float8_e4m3fn, torch.uint8)


def read_value_magnitudes(meta: "SnapshotMeta", cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, query_lens: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest finite dequantised |v| each request reads per KV head, and how many keys it reads.

    ``block_table`` [num_reqs, width] indexes ``cache``'s pages (-1: not stored, skipped); a request reads
    keys ``[first, L)``, ``first = max(0, L - q - w + 1)`` under a sliding window ``w`` (``query_lens``
    given), else 0. Returns float64 ``[num_reqs, Hkv]`` and int64 ``[num_reqs]``, on the CPU. One request's
    pages are gathered at a time, so the memory is that of its keys.
    """
    _, v_view = kv_views(meta, cache)  # [pages, Hkv, ps, D]; an FP8 cache comes viewed as e4m3
    page_size, num_kv_heads = v_view.shape[2], v_view.shape[1]
    lens = [int(x) for x in seq_lens.tolist()]
    qlens = [0] * len(lens) if query_lens is None else [int(x) for x in query_lens.tolist()]
    window = meta.layer.sliding_window
    table = block_table.to("cpu", torch.int64)
    out = torch.zeros(len(lens), num_kv_heads, dtype=torch.float64)
    keys = torch.zeros(len(lens), dtype=torch.int64)
    scale = float(meta.layer.v_scale) if meta.layer.is_fp8 else 1.0
    for r, length in enumerate(lens):
        first = max(0, length - qlens[r] - window + 1) if window is not None and query_lens is not None else 0
        keys[r] = max(0, length - first)
        if length <= first:
            continue
        cols = torch.arange(first // page_size, -(-length // page_size))
        cols = cols[cols < table.shape[1]]
        ids = table[r, cols]
        cols, ids = cols[ids >= 0], ids[ids >= 0]
        if not len(ids):
            continue
        values = v_view[ids.to(v_view.device)].float().abs()  # [n, Hkv, ps, D]
        position = cols.to(values.device).view(-1, 1) * page_size + torch.arange(page_size, device=values.device)
        read = ((position >= first) & (position < length)).view(len(ids), 1, page_size, 1)
        values = torch.where(read & torch.isfinite(values), values, torch.zeros_like(values))
        out[r] = values.amax(dim=(0, 2, 3)).to("cpu", torch.float64) * scale
    return out, keys


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at +-FP8_MAX as vLLM's cache write and attention layer quantise."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype`` for e4m3 values (or their uint8 bytes).

    The product is taken in fp32, or in float64 when ``dtype`` is float64, in a
    fresh tensor (scaled in place, so no second buffer of its size).
    """
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    out = as_fp8(x).to(wide, copy=True)
    if scale != 1.0:
        out.mul_(scale)
    return out.to(dtype)


def finite_pages(*page_tensors: torch.Tensor) -> torch.Tensor:
    """[pages] bool: every element of the page is finite in each of ``page_tensors`` ([pages, ...] each).

    One fp32 sum per page, read in 64 MiB slices with no gather; only a page
    whose sum is not finite is looked at element-wise, since finite values can
    sum past fp32's range.
    """
    num_pages = page_tensors[0].shape[0]
    flags = torch.ones(num_pages, dtype=torch.bool, device=page_tensors[0].device)
    page_bytes = max(1, page_tensors[0][:1].numel() * page_tensors[0].element_size())
    step = max(1, (64 << 20) // page_bytes)
    for first in range(0, num_pages, step):
        for pages in page_tensors:
            pages = as_fp8(pages[first:first + step])
            sums = pages.reshape(pages.shape[0], -1).sum(dim=1, dtype=torch.float32) \
                if pages.dtype.is_floating_point and pages.element_size() > 1 else \
                pages.float().reshape(pages.shape[0], -1).sum(dim=1)
            flags[first:first + step] &= torch.isfinite(sums)
    suspect = (~flags).nonzero().flatten()
    if suspect.numel():
        flags[suspect] = torch.stack([torch.isfinite(as_fp8(pages[suspect]).float()).reshape(suspect.numel(), -1)
                                      .all(dim=1) for pages in page_tensors]).all(dim=0)
    return flags


# --------------------------------------------------------------------------- stored pages


def stored_index(page_ids: torch.Tensor, engine_ids: torch.Tensor) -> torch.Tensor:
    """Index into the stored pages of each engine page id (``page_ids``: engine id of each stored page).

    -1 where a page is not stored. The result has ``engine_ids``' shape, int64, on ``page_ids``' device.
    """
    ids = page_ids.to(torch.int64)
    flat = engine_ids.to(torch.int64).to(ids.device).reshape(-1)
    if len(ids) == 0:
        return torch.full(tuple(engine_ids.shape), -1, dtype=torch.int64, device=ids.device)
    order = torch.argsort(ids)
    sorted_ids = ids[order]
    pos = torch.searchsorted(sorted_ids, flat).clamp_max(len(ids) - 1)
    found = sorted_ids[pos] == flat
    out = torch.where(found, order[pos], torch.full_like(flat, -1))
    return out.reshape(engine_ids.shape)
