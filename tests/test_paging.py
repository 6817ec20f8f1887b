"""Paging math of FLASHINFER_TS: hand-computed restrictions, properties, the torch twin, the prims_ts contract."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdbg.errors import OptionError
from kvdbg.ts.window import (
    analyze_window,
    cdiv,
    exact_visible_range,
    kernel_visible_range,
    restrict_to_window,
    ts_mask_type,
    ts_max_kv_len,
    ts_table_width,
    ts_window_left,
    visibility_table,
)
from kvdbg.ts.contract import check_plan, check_request


def test_cdiv():
    assert [cdiv(a, 16) for a in (0, 1, 15, 16, 17, 32)] == [0, 1, 1, 1, 2, 2]


def test_issue_example_9000_4096_q8_ps16():
    r = restrict_to_window(9000, 4096, 8, 16)
    assert (r.span, r.start_page, r.first_kept_token, r.restricted_seq_len) == (4103, 306, 4896, 4104)
    assert (r.pages_total, r.pages_dropped, r.pages_kept, r.table_width) == (563, 306, 257, 258)
    assert r.applies and r.reason == ""
    assert ts_max_kv_len(4096, 8, 16, 32768) == 4120
    table = visibility_table(9000, 4096, 8, 16, causal=False)
    assert [t.extra for t in table.tokens] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [t.missed for t in table.tokens] == [0] * 8
    assert table.tokens[0].position == 8992 and (table.tokens[0].exact_lo, table.tokens[0].kernel_lo) == (4897, 4896)
    assert table.worst_extra == 8 and table.drift == 7


def test_seq_len_shorter_than_window_keeps_everything():
    r = restrict_to_window(1000, 4096, 4, 16)
    assert (r.start_page, r.restricted_seq_len, r.pages_dropped, r.applies) == (0, 1000, 0, False)
    assert "nothing is dropped" in r.reason
    # Exact windows still cover everything, so the kernel sees no extra key.
    table = visibility_table(1000, 4096, 4, 16, causal=False)
    assert table.worst_extra == 0 and table.drift == 0 and table.total_missed == 0


def test_window_start_exactly_on_a_page_boundary():
    # L - span = 4096 = 256 pages: the first token's window starts a page, no extra for it.
    r = restrict_to_window(4096 + 4103, 4096, 8, 16)
    assert (r.start_page, r.first_kept_token, r.restricted_seq_len) == (256, 4096, 4103)
    table = visibility_table(4096 + 4103, 4096, 8, 16, causal=False)
    assert [t.extra for t in table.tokens] == list(range(8))


def test_seq_len_exactly_at_a_page_boundary_q1():
    # L = 8192 (512 pages), q = 1: span = window = 4096, start page 256, no extra token.
    r = restrict_to_window(8192, 4096, 1, 16)
    assert (r.span, r.start_page, r.restricted_seq_len, r.pages_kept, r.table_width) == (4096, 256, 4096, 256, 257)
    assert visibility_table(8192, 4096, 1, 16, causal=False).worst_extra == 0
    # One token later, the window start moves into page 256 and one extra token shows.
    assert visibility_table(8193, 4096, 1, 16, causal=False).worst_extra == 1


@pytest.mark.parametrize("page_size", [4, 8, 16, 32, 64, 128])
def test_page_sizes(page_size):
    r = restrict_to_window(9000, 4096, 8, page_size)
    assert r.start_page == (9000 - 4103) // page_size
    assert r.restricted_seq_len == 9000 - r.start_page * page_size
    assert r.table_width == cdiv(4103, page_size) + 1
    assert r.pages_kept <= r.table_width
    extra_first = (9000 - 4103) % page_size
    table = visibility_table(9000, 4096, 8, page_size, causal=False)
    assert [t.extra for t in table.tokens] == [extra_first + i for i in range(8)]


def test_ts_plan_constants():
    assert ts_table_width(None, 8, 16, 32768) == 2048
    assert ts_table_width(4096, 8, 16, 32768) == 258
    assert ts_max_kv_len(None, 8, 16, 32768) == 32768
    assert (ts_mask_type(True), ts_mask_type(False)) == ("causal", "dense")
    assert ts_window_left(4096, True) == 4095
    assert ts_window_left(4096, False) == -1 and ts_window_left(None, True) == -1


def test_exact_ranges_follow_the_reference_masks():
    assert exact_visible_range(100, 4, 0, None, True) == (0, 97)
    assert exact_visible_range(100, 4, 3, 10, True) == (90, 100)
    assert exact_visible_range(100, 4, 0, None, False) == (0, 100)
    assert exact_visible_range(100, 4, 0, 10, False) == (87, 100)
    assert exact_visible_range(5, 4, 0, 10, False) == (0, 5)
    # Causal with window_left gives each token exactly its own window.
    assert kernel_visible_range(100, 4, 2, 10, True, 16) == exact_visible_range(100, 4, 2, 10, True)
    assert kernel_visible_range(100, 4, 2, 10, False, 16) == (80, 100)


@pytest.mark.parametrize("args", [(-1, 4, 1, 16), (10, 0, 1, 16), (10, 4, 1, 0), (3, 4, 5, 16)])
def test_bad_arguments_raise_option_error(args):
    with pytest.raises(OptionError):
        restrict_to_window(*args)


@settings(max_examples=300, deadline=None)
@given(
    seq_len=st.integers(1, 200_000),
    window=st.integers(1, 70_000),
    query_len=st.integers(1, 64),
    page_size=st.sampled_from([1, 4, 8, 16, 32, 64, 128, 24]),
)
def test_restriction_properties(seq_len, window, query_len, page_size):
    if query_len > seq_len:
        query_len = seq_len
    r = restrict_to_window(seq_len, window, query_len, page_size)
    table = visibility_table(seq_len, window, query_len, page_size, causal=False)
    for tok in table.tokens:
        assert tok.kernel_lo <= tok.exact_lo and tok.kernel_hi >= tok.exact_hi  # superset of the exact window
        assert tok.missed == 0
        assert 0 <= tok.extra <= page_size - 1 + query_len - 1
    assert r.restricted_seq_len <= ts_max_kv_len(window, query_len, page_size, 1 << 30)
    assert r.pages_kept <= r.table_width
    assert r.restricted_seq_len >= query_len
    assert r.first_kept_token % page_size == 0 and r.first_kept_token + r.restricted_seq_len == seq_len
    assert not check_request(request=0, seq_len=r.restricted_seq_len, query_len=query_len,
                             max_kv_len=ts_max_kv_len(window, query_len, page_size, 1 << 30),
                             table_width=r.table_width, page_size=page_size, mask_type="dense")


def test_torch_twin_matches_scalar_rule():
    import torch

    from kvdbg.ts.window_torch import restrict_to_window_tensors

    gen = torch.Generator().manual_seed(0)
    cases = 0
    for page_size in (4, 16, 64):
        for window in (1, 7, 100, 1000):
            for query_len in (0, 1, 3, 8):
                seq_lens = torch.randint(max(query_len, 1), 3000, (32,), generator=gen, dtype=torch.int32)
                width = cdiv(3000, page_size)
                block_table = torch.randint(1, 10_000, (32, width), generator=gen, dtype=torch.int32)
                table_width = ts_table_width(window, query_len, page_size, 3000)
                lens, table, start = restrict_to_window_tensors(
                    seq_lens, block_table, window, query_len, page_size, table_width)
                assert lens.dtype == seq_lens.dtype and table.shape == (32, table_width)
                for b in range(32):
                    r = restrict_to_window(int(seq_lens[b]), window, query_len, page_size)
                    assert (int(start[b]), int(lens[b])) == (r.start_page, r.restricted_seq_len)
                    cols = [min(r.start_page + j, width - 1) for j in range(table_width)]
                    assert table[b].tolist() == block_table[b, cols].tolist()
                    cases += 1
    assert cases == 3 * 4 * 4 * 32


def test_contract_request_messages():
    assert check_request(request=3, seq_len=100, query_len=8, max_kv_len=4120, table_width=7, page_size=16,
                         mask_type="causal") == []
    v = check_request(request=3, seq_len=9000, query_len=8, max_kv_len=4120, table_width=258, page_size=16,
                      mask_type="causal")
    assert [x.code for x in v] == ["seq_len_over_max_kv_len", "table_too_narrow"]
    assert v[0].message == "request 3: seq_len 9000 exceeds the plan's max_kv_len 4120"
    assert v[1].message == "request 3: seq_len 9000 needs 563 pages of 16 but the block table has 258 columns"
    v = check_request(request=0, seq_len=4, query_len=8, max_kv_len=4120, table_width=1, page_size=16,
                      mask_type="causal")
    assert [x.code for x in v] == ["seq_len_below_query_len"] and v[0].request == 0
    # A dense row sees every key below seq_len however short (FlashInfer's run(validate=True) bounds only causal).
    assert check_request(request=0, seq_len=4, query_len=8, max_kv_len=4120, table_width=1, page_size=16,
                         mask_type="dense") == []


def test_contract_plan():
    ok = dict(head_dim=128, page_size=16, q_dtype="bf16", kv_dtype="bfloat16", mask_type="dense", window_left=-1)
    assert check_plan(**ok) == []
    assert check_plan(**{**ok, "q_dtype": "fp8_e4m3", "kv_dtype": "float8_e4m3fn"}) == []
    codes = lambda **kw: [v.code for v in check_plan(**{**ok, **kw})]  # noqa: E731
    assert codes(head_dim=96) == ["head_dim_unsupported"]
    assert codes(page_size=24) == ["page_size_unsupported"]
    assert codes(q_dtype="float16") == ["dtype_mismatch"]
    assert codes(kv_dtype="float32") == ["kv_dtype_unsupported"]
    assert codes(window_left=4095) == ["window_needs_causal"]
    assert codes(window_left=4095, mask_type="causal") == []
    assert codes(head_dim=None, q_dtype=None, kv_dtype=None) == []


def test_causal_window_over_max_kv_len_is_a_finding():
    a = analyze_window(9000, 4096, query_len=8, page_size=16, causal=True)
    assert not a.applies and "causal" in a.reason
    assert a.builder.columns_copied == 258 and a.builder.seq_len == 9000 and a.builder.window_left == 4095
    codes = [f.code for f in a.findings]
    assert codes == ["seq_len_over_max_kv_len", "table_too_narrow", "tokens_missed"]
    assert a.visibility.total_missed == 8 * 4096


def test_short_causal_window_is_clean():
    a = analyze_window(3000, 4096, query_len=8, page_size=16, causal=True)
    assert a.findings == [] and a.visibility.total_missed == 0 and a.visibility.worst_extra == 0


def test_query_longer_than_max_decode_query_len_is_a_noop_batch():
    a = analyze_window(9000, 4096, query_len=8, max_decode_query_len=4)
    assert [f.code for f in a.findings] == ["noop_batch"]
    assert all(t.kernel_hi == t.kernel_lo for t in a.visibility.tokens)


def test_strip_marks_the_old_edge():
    a = analyze_window(9000, 4096, query_len=8)
    kinds = {c.page: c.kind for c in a.strip if c.page is not None}
    assert kinds[305] == "dropped" and kinds[306] == "edge" and kinds[307] == "kept" and kinds[562] == "query"


def test_pure_modules_never_import_torch():
    code = ("import sys, kvdbg.ts.window, kvdbg.ts.contract, kvdbg.render.window, kvdbg.cli.window; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
