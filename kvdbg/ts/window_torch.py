"""Vectorised twin of :func:`kvdbg.ts.window.restrict_to_window` for the FLASHINFER_TS backend (imports torch)."""

from __future__ import annotations

import torch

from kvdbg.errors import OptionError

__all__ = ["restrict_to_window_tensors"]


def restrict_to_window_tensors(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    window: int,
    query_len: int,
    page_size: int,
    table_width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Restrict every request of a dense windowed batch to its window's pages.

    Returns ``(restricted_seq_lens, restricted_block_table, start_page)`` with
    shapes ``[B]``, ``[B, table_width]``, ``[B]``. Column ``j`` of the result is
    column ``start_page + j`` of ``block_table``, clamped to its last column as
    the FLASHINFER_TS builder does, so columns past a request's pages repeat
    entries the kernel never reads. Dtypes follow the inputs.
    """
    if window is None or window < 1:
        raise OptionError(f"window must be >= 1, got {window!r}")
    if query_len < 0 or page_size < 1 or table_width < 0:
        raise OptionError(
            f"need query_len >= 0, page_size >= 1, table_width >= 0; got {query_len}, {page_size}, {table_width}"
        )
    if block_table.dim() != 2 or seq_lens.dim() != 1 or block_table.shape[0] != seq_lens.shape[0]:
        raise OptionError(
            f"block_table {tuple(block_table.shape)} and seq_lens {tuple(seq_lens.shape)} do not describe "
            "the same requests"
        )
    span = window + query_len - 1
    start_page = torch.clamp_min(torch.div(seq_lens.to(torch.int64) - span, page_size, rounding_mode="floor"), 0)
    cols = torch.arange(table_width, device=block_table.device, dtype=torch.int64)
    idx = (start_page.unsqueeze(1) + cols.unsqueeze(0)).clamp_max(max(block_table.shape[1] - 1, 0))
    if block_table.shape[1] == 0:
        restricted_table = block_table.new_zeros((block_table.shape[0], table_width))
    else:
        restricted_table = block_table.gather(1, idx)
    restricted_lens = (seq_lens.to(torch.int64) - start_page * page_size).to(seq_lens.dtype)
    return restricted_lens, restricted_table, start_page
