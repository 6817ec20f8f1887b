"""Plain-torch paged attention used by the stand-in impls (not part of vLLM; no kernels here)."""

from __future__ import annotations

import torch


def write_cache(key, value, k_pages, v_pages, slot_mapping, *, fp8: bool, k_scale: float, v_scale: float) -> None:
    """What reshape_and_cache_flash does: token t goes to slot_mapping[t]; -1 is padding."""
    page_size = k_pages.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        page, offset = divmod(slot, page_size)
        k, v = key[t], value[t]
        if fp8:
            k = (k.float() / k_scale).to(torch.float8_e4m3fn)
            v = (v.float() / v_scale).to(torch.float8_e4m3fn)
        k_pages[page, :, offset] = k.to(k_pages.dtype)
        v_pages[page, :, offset] = v.to(v_pages.dtype)


def paged_attention(query, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, scale: float, causal: bool,
                    window: int | None, q_scale: float = 1.0, k_scale: float = 1.0, v_scale: float = 1.0):
    """[tokens, Hq, D] float32 attention of each request's query block over its paged K/V."""
    page_size = k_pages.shape[2]
    num_heads, num_kv_heads = query.shape[1], k_pages.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    qsl = query_start_loc.tolist()
    for r, length in enumerate(seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        if end == start or length == 0:
            continue
        pages = block_table[r, : -(-length // page_size)].long()
        k = k_pages[pages].float().permute(0, 2, 1, 3).reshape(-1, num_kv_heads, k_pages.shape[-1])[:length] * k_scale
        v = v_pages[pages].float().permute(0, 2, 1, 3).reshape(-1, num_kv_heads, v_pages.shape[-1])[:length] * v_scale
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start:end].float() * q_scale
        pos = torch.arange(length - (end - start), length, device=query.device).unsqueeze(1)
        keys = torch.arange(length, device=query.device).unsqueeze(0)
        visible = keys <= pos if causal else keys < length
        if window is not None:
            visible &= keys > pos - window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
