"""kvdbg.snapshot.layout: layout views, FP8 scaling and the stored-page lookup, on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from kvdbg.snapshot.layout import (
    FP8_MAX,
    KV_VIEW_LAYOUTS,
    dequantize_fp8,
    join_kv,
    kv_head_dim,
    page_dim,
    quantize_fp8,
    split_kv,
    stored_index,
)
from kvdbg.errors import OptionError
from kvdbg.snapshot.format import LAYOUT_VLLM, LAYOUTS


@pytest.mark.parametrize("layout", KV_VIEW_LAYOUTS)
def test_split_kv_views_what_join_kv_wrote_in_every_layout(layout):
    pages, heads, page_size, head_size = 3, 2, 4, 8
    keys = torch.randn(pages, heads, page_size, head_size, generator=torch.Generator().manual_seed(1))
    values = torch.randn(pages, heads, page_size, head_size, generator=torch.Generator().manual_seed(2))
    cache = join_kv(keys, values, layout)
    k, v = split_kv(cache, layout, head_size)
    assert torch.equal(k, keys) and torch.equal(v, values)
    # Views of the cache, not copies: a write through K lands in the cache.
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    k[1, 0, 2, 5] = 100.0
    assert torch.equal(split_kv(cache, layout, head_size)[0][1, 0, 2, 5], torch.tensor(100.0))
    assert cache.shape[page_dim(layout)] == pages and cache.shape[kv_head_dim(layout)] == heads


def test_the_format_layouts_are_all_viewable_and_an_unknown_one_is_named():
    assert set(LAYOUTS) <= set(KV_VIEW_LAYOUTS)
    with pytest.raises(OptionError, match="'pages,tokens' is not a layout kvdbg reads"):
        split_kv(torch.zeros(1, 1, 1, 2), "pages,tokens", 1)


def test_fp8_bytes_are_viewed_as_e4m3():
    cache = quantize_fp8(torch.tensor([[[[1.0, -2.0]]]]), 1.0).view(torch.uint8)
    k, v = split_kv(cache, LAYOUT_VLLM, 1, fp8=True)
    assert k.dtype == torch.float8_e4m3fn and float(k) == 1.0 and float(v) == -2.0
    assert split_kv(cache, LAYOUT_VLLM, 1)[0].dtype == torch.uint8  # not an FP8 layer: bytes as they are


def test_quantize_saturates_at_fp8_max_and_keeps_nan():
    q = quantize_fp8(torch.tensor([1000.0, -1000.0, 0.5, float("nan")]), 0.5)
    assert q.dtype == torch.float8_e4m3fn
    out = q.float()
    assert out[0] == FP8_MAX and out[1] == -FP8_MAX and out[2] == 1.0 and torch.isnan(out[3])


def test_dequantize_scales_in_the_wide_dtype_and_never_writes_its_input():
    x = quantize_fp8(torch.tensor([3.0, -0.25]), 1.0)
    scale = 0.1
    f64 = dequantize_fp8(x.view(torch.uint8), scale, torch.float64)
    assert f64.dtype == torch.float64 and f64.tolist() == [3.0 * scale, -0.25 * scale]
    bf16 = dequantize_fp8(x, scale, torch.bfloat16)
    assert torch.equal(bf16, (x.float() * scale).to(torch.bfloat16))
    already = torch.tensor([2.0])
    assert dequantize_fp8(already, 3.0, torch.float32).item() == 6.0 and already.item() == 2.0


def test_stored_index_maps_engine_ids_and_marks_missing_pages():
    page_ids = torch.tensor([40, 7, 12], dtype=torch.int32)
    table = torch.tensor([[7, 12, 5], [40, 0, 7]])
    assert stored_index(page_ids, table).tolist() == [[1, 2, -1], [0, -1, 1]]
    assert stored_index(page_ids[:0], table).tolist() == [[-1] * 3] * 2
