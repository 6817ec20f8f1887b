"""FLASHINFER_TS builder: uniform blocks, no-op batches, plan cache, buffers, window restriction; and its findings."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.backends import flashinfer_ts as ts
from kvdbg.snapshot.cache import working_cache
from kvdbg.snapshot.layout import split_kv
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.ts.window import restrict_to_window
from kvdbg.replayer.runner import common_metadata, replay
from kvdbg.snapshot.store import with_meta
from kvdbg.moves.synth import SynthSpec, synth_snapshot


def _snap(**kw):
    kw.setdefault("head_size", 64)
    kw.setdefault("num_heads", 4)
    kw.setdefault("num_kv_heads", 2)
    return synth_snapshot(SynthSpec(**kw))


def _emulated(snap):
    return ts.create(snap.meta, ReplayOptions(force_emulation=True))


def _build_and_run(snap, common=None, inst=None):
    """The builder, the emulated kernel and the findings, as when the engine ran FLASHINFER_TS on this batch.

    ``has_engine_output`` marks the batch as one the engine's FLASHINFER_TS really ran, so batch shapes it
    would otherwise never run (prefill-shaped, ragged) are judged, not skipped as not applicable.
    """
    inst = inst or _emulated(snap)
    common = common or replace(common_metadata(snap, 0), has_engine_output=True)
    md = inst.builder.build(common)
    layer = snap.meta.layer
    out = torch.full((common.num_actual_tokens, layer.num_heads, layer.head_size), float("nan"),
                     dtype=inst.output_dtype)
    inst.impl.forward(snap.steps[0].query, working_cache(snap), md, out)
    return inst, md, out, inst.findings(common, md)


def _codes(findings, severity=None):
    return sorted({f.code for f in findings if severity is None or f.severity == severity})


# --------------------------------------------------------------------------- uniform blocks and no-op batches


def test_ragged_batch_rounds_down_and_leaves_the_rest_unwritten():
    snap = _snap(seq_lens=(40, 60), query_lens=(2, 3))
    inst, md, out, findings = _build_and_run(snap)
    assert (md.query_len, md.num_actual_tokens, md.plan_key) == (2, 4, (2, 2, True))
    written = ~torch.isnan(out.float()).any(dim=(1, 2))
    assert written.tolist() == [True, True, True, True, False]
    by_code = {f.code: f for f in findings}
    assert by_code["ragged_leftover_tokens"].details["first_unwritten"] == 4
    assert by_code["ragged_leftover_tokens"].details["unwritten"] == 1
    # Request 0 has 2 tokens in [0, 2) and matches its block; request 1's [2, 5) does not.
    assert by_code["non_uniform_query_blocks"].details["misassigned_requests"] == [1]
    assert all(f.severity == "error" for f in findings if f.code != "window_restriction_extra_keys")


def test_non_uniform_blocks_name_every_misassigned_request():
    snap = _snap(seq_lens=(40, 60), query_lens=(1, 3))
    _, md, _, findings = _build_and_run(snap)
    assert md.query_len == 2
    (f,) = [f for f in findings if f.code == "non_uniform_query_blocks"]
    assert f.details["misassigned_requests"] == [0, 1] and f.details["query_lens"] == [1, 3]
    assert "requests 0 (tokens 0..0, kernel block 0..1)" in f.message


def test_query_len_above_max_decode_query_len_is_a_noop_batch():
    snap = _snap(seq_lens=(40, 60), query_len=5, max_decode_query_len=4)
    inst, md, out, findings = _build_and_run(snap)
    assert md.query_len == 0 and md.num_actual_tokens == 0 and md.wrapper is None and md.plan is None
    assert torch.isnan(out.float()).all()
    assert inst.builder.plan_calls == 0
    assert _codes(findings) == ["noop_batch"]
    assert "exceeds max_decode_query_len 4" in findings[0].message and findings[0].severity == "error"


def test_fewer_tokens_than_requests_is_a_noop_batch():
    snap = _snap(seq_lens=(40, 60, 80, 90), query_lens=(1, 1, 1, 0))
    _, md, out, findings = _build_and_run(snap)
    assert md.query_len == 0 and torch.isnan(out.float()).all()
    assert _codes(findings) == ["noop_batch"] and "round down to 0" in findings[0].message


# --------------------------------------------------------------------------- plans and buffers


def test_plans_cached_per_num_reqs_query_len_causal():
    snap = _snap(seq_lens=(40, 60, 80))
    inst = _emulated(snap)
    common = common_metadata(snap, 0)
    md1 = inst.builder.build(common)
    md2 = inst.builder.build(common)
    assert inst.builder.plan_calls == 1 and md1.plan is md2.plan
    two = replace(common, num_reqs=2, num_actual_tokens=2, query_start_loc=common.query_start_loc[:3])
    md3 = inst.builder.build(two)
    assert inst.builder.plan_calls == 2 and md3.plan.batch_size == 2
    dense = replace(common, causal=False)
    md4 = inst.builder.build(dense)
    assert inst.builder.plan_calls == 3 and md4.plan.mask_type == "dense"
    # max_kv_len does not depend on the batch: one constant for every plan.
    assert {m.plan.max_kv_len for m in (md1, md3, md4)} == {snap.meta.backend.max_model_len}
    assert sorted(inst.builder.plans) == [(2, 1, True), (3, 1, False), (3, 1, True)]


def test_buffers_sized_from_scheduler_limits_and_overflow_is_reported():
    snap = _snap(seq_lens=(40, 60, 80), query_len=2)
    backend = replace(snap.meta.backend, max_num_seqs=2, max_num_batched_tokens=4)
    snap = with_meta(snap, backend=backend)
    inst, md, out, findings = _build_and_run(snap)
    # max(max_num_seqs 2, 4 // max_decode_query_len 2) = 2 rows for 3 requests.
    assert md.buffer_rows == 2 and md.overflow is not None
    assert torch.isnan(out.float()).all()
    assert _codes(findings) == ["buffer_overflow"]
    assert findings[0].details == {"num_reqs": 3, "buffer_rows": 2}
    roomy = with_meta(snap, backend=replace(backend, max_num_batched_tokens=64))
    _, md, out, findings = _build_and_run(roomy)
    assert md.buffer_rows == 32 and md.overflow is None and not _codes(findings, "error")
    assert not torch.isnan(out.float()).any()
    assert "buffer overflow cannot be checked" in " ".join(_emulated(_snap(seq_lens=(40,))).describe().notes)


def test_buffer_width_follows_window_and_max_model_len():
    snap = _snap(seq_lens=(40,), max_model_len=4096, page_size=16)
    assert _emulated(snap).builder.buffer_width == 256
    snap = _snap(seq_lens=(40,), sliding_window=100, query_len=3, causal=False, page_size=16)
    assert _emulated(snap).builder.buffer_width == math.ceil((100 + 3 - 1) / 16) + 1


# --------------------------------------------------------------------------- the window restriction


def test_dense_window_restriction_matches_the_paging_math():
    lens, window, q, ps = (9000, 100, 4200, 4110), 4096, 8, 16
    snap = _snap(seq_lens=lens, query_len=q, causal=False, sliding_window=window, page_size=ps,
                 num_heads=2, num_kv_heads=1)
    inst = _emulated(snap)
    common = common_metadata(snap, 0)
    md = inst.builder.build(common)
    assert md.restricted and md.block_table.shape == (4, inst.builder.buffer_width)
    for r, length in enumerate(lens):
        expect = restrict_to_window(length, window, q, ps)
        assert int(md.seq_lens[r]) == expect.restricted_seq_len
        assert int(md.start_page[r]) == expect.start_page
        kept = expect.pages_kept
        assert md.block_table[r, :kept].tolist() == common.block_table[r, expect.start_page:expect.start_page + kept].tolist()
        row = inst.explain(common, md)[r]
        assert row["restricted_seq_len"] == expect.restricted_seq_len
        assert row["first_kept_token"] == expect.first_kept_token and row["pages_kept"] == kept
        assert row["mask_type"] == "dense" and row["window_left"] == -1
        assert row["max_kv_len"] == window + q + ps and row["plan_key"] == [4, q, False]
    assert int(md.start_page[0]) > 0 and int(md.start_page[1]) == 0
    findings = inst.findings(common, md)
    assert not _codes(findings, "error")
    extra = {f.request: f for f in findings if f.code == "window_restriction_extra_keys"}
    assert extra[0].severity == "warning" and extra[0].details["drift"] == q - 1


def test_causal_window_long_request_gets_a_truncated_table_and_findings():
    window, ps = 64, 16
    snap = _snap(seq_lens=(300, 70, 81, 50), causal=True, sliding_window=window, page_size=ps)
    inst, md, out, findings = _build_and_run(snap)
    width = math.ceil((window + 1 - 1) / ps) + 1  # 5 columns
    max_kv_len = window + 1 + ps  # 81
    assert not md.restricted and md.block_table.shape == (4, width)
    assert md.seq_lens.tolist() == [300, 70, 81, 50]  # unrestricted
    errors = {(f.code, f.request): f for f in findings if f.severity == "error"}
    assert set(errors) == {("seq_len_over_max_kv_len", 0), ("table_too_narrow", 0), ("table_too_narrow", 2)}
    assert errors[("seq_len_over_max_kv_len", 0)].details == {"seq_len": 300, "max_kv_len": max_kv_len}
    assert errors[("table_too_narrow", 0)].details == {"seq_len": 300, "pages_needed": 19, "table_width": width}
    # 81 == max_kv_len is accepted, but needs 6 pages of the 5 the window-sized buffer holds.
    assert errors[("table_too_narrow", 2)].details["pages_needed"] == 6
    nan_rows = torch.isnan(out.float()).any(dim=(1, 2)).tolist()
    assert nan_rows == [True, False, True, False]  # undefined on the kernel: left unwritten
    row = inst.explain(common_metadata(snap, 0), md)[0]
    assert row["table_width"] == width and row["restricted_seq_len"] == 300 and row["window_left"] == window - 1


# --------------------------------------------------------------------------- findings: each reachable, silent when clean


@pytest.mark.parametrize("kw", [
    dict(seq_lens=(9, 77, 200)),
    dict(seq_lens=(9, 77, 200), causal=False, query_len=4),
    dict(seq_lens=(30, 50), causal=True, sliding_window=64),
    dict(seq_lens=(300, 50), causal=False, sliding_window=64, query_len=2),
    dict(seq_lens=(40, 90), fp8=True),
])
def test_clean_inputs_have_no_errors(kw):
    snap = _snap(**kw)
    _, _, out, findings = _build_and_run(snap)
    assert _codes(findings, "error") == []
    assert not torch.isnan(out.float()).any()


def test_page_outside_cache_names_the_column_and_leaves_the_request_unwritten():
    snap = _snap(seq_lens=(40, 60))
    common = common_metadata(snap, 0)
    table = common.block_table.clone()
    table[1, 2] = common.num_pages + 3
    _, _, out, findings = _build_and_run(snap, replace(common, block_table=table))
    (f,) = [f for f in findings if f.code == "page_outside_cache"]
    assert f.request == 1 and f.details["column"] == 2 and f.details["stored_index"] == common.num_pages + 3
    assert f.details["engine_page"] == int(common.block_table_engine[1, 2])
    assert torch.isnan(out[1].float()).all() and not torch.isnan(out[0].float()).any()


def test_null_page_zero_is_a_valid_page_for_this_kernel():
    snap = _snap(seq_lens=(40, 60), use_page_zero=True)
    _, _, out, findings = _build_and_run(snap)
    assert _codes(findings, "error") == [] and not torch.isnan(out.float()).any()


def test_seq_len_shorter_than_the_uniform_block():
    snap = _snap(seq_lens=(1, 60), query_lens=(1, 3))
    _, md, out, findings = _build_and_run(snap)
    codes = {(f.code, f.request) for f in findings}
    assert ("seq_len_below_query_len", 0) in codes and md.query_len == 2
    assert torch.isnan(out[:2].float()).all()


@pytest.mark.parametrize("kw, code, words", [
    (dict(head_size=96), "head_dim_unsupported", "head_dim 96"),
    (dict(page_size=12), "page_size_unsupported", "page_size 12"),
    (dict(dtype="float32"), "q_dtype_unsupported", "float32"),
])
def test_a_layer_plan_rejects_is_unavailable_never_an_emulated_pass(kw, code, words):
    """plan() raises on these: no output exists to compare, so the column is unavailable with the reason."""
    snap = _snap(seq_lens=(40,), **kw)
    reason = ts.BACKEND.unsupported_reason(snap.meta)
    assert reason is not None and "plan() rejects" in reason and words in reason
    result = replay(snap, ["reference", "flex", "flashinfer_ts"])
    status = {s.name: s for s in result.backends}["flashinfer_ts"]
    assert not status.available and status.reason == reason
    assert all("flashinfer_ts" not in step.runs for step in result.steps)


def test_view_strides_are_checked():
    page = torch.zeros(3, 2, 16, 128, dtype=torch.bfloat16)
    k, v = split_kv(page, LAYOUT_VLLM, 64, fp8=False)
    assert ts.view_violations(k, v, 64) == []
    odd = torch.zeros(3, 2, 64, 16, dtype=torch.bfloat16).transpose(-1, -2)
    codes = [x.code for x in ts.view_violations(odd, odd, 64)]
    assert "kv_head_dim_not_contiguous" in codes
    narrow = torch.zeros(3, 2, 16, 68, dtype=torch.bfloat16)[..., :64]  # 136-byte token stride
    assert [x.code for x in ts.view_violations(narrow, narrow, 64)] == ["kv_stride_misaligned"] * 2


def test_replay_end_to_end_reports_findings_and_explain():
    snap = _snap(seq_lens=(300, 50), causal=True, sliding_window=64)
    result = replay(snap, ["reference", "flashinfer_ts"])
    run = result.steps[0].runs["flashinfer_ts"]
    assert run.info.emulated and run.info.kernel == ts.EMULATED_KERNEL and run.info.notes[0].startswith("real kernel not run")
    assert {"seq_len_over_max_kv_len", "table_too_narrow"} <= {f.code for f in run.findings}
    assert run.explain[0]["seq_len"] == 300 and run.explain[1]["seq_len"] == 50
