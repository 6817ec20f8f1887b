"""kvdbg.capture.prepare: one step -> what a snapshot holds, as pure functions that raise typed errors."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvdbg.capture.build import build_snapshot, complete_capture, snapshot_file_size
from kvdbg.capture.prepare import (
    CaptureInputError,
    CapturePlan,
    PendingCapture,
    plan_capture,
    prepare_capture,
    save_pre_update,
)
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM, parse_meta
from kvdbg.snapshot.store import save_snapshot
from tests.test_capture import PAD_ROWS, Engine, page_dim, same_bytes


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
def test_prepare_returns_the_step_and_touches_nothing(tmp_path, layout, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = Engine(layout=layout)
    pending = prepare_capture(*engine.args(), step=7, rank=3, rank_source="test", engine="engine 1.0",
                              info={"where": "unit test"}, notes="n")
    assert isinstance(pending, PendingCapture) and os.listdir(tmp_path) == []
    want = engine.snap
    assert torch.equal(pending.plan.page_ids, want.page_ids.long())
    assert same_bytes(pending.pages, want.kv_cache)  # these layouts need no conversion
    assert pending.num_tokens == want.steps[0].num_tokens
    assert same_bytes(pending.plan.step.query, want.steps[0].query)  # padding rows dropped
    snapshot = complete_capture(pending)
    assert torch.equal(snapshot.page_ids.long(), want.page_ids.long()) and snapshot.page_ids.dtype == torch.int32
    meta = snapshot.meta
    assert meta.layer == want.meta.layer and meta.backend == want.meta.backend and meta.notes == "n"
    assert (meta.capture["rank"], meta.capture["rank_source"], meta.capture["engine"]) == (3, "test", "engine 1.0")
    assert meta.capture["where"] == "unit test" and meta.capture["query_rows_given"] == pending.num_tokens + PAD_ROWS
    assert parse_meta(meta.to_json()) == meta


def test_the_engine_thread_only_copies_and_the_copies_do_not_alias_the_engine():
    """Everything a later step could overwrite is a copy once begin returns; the metadata is built later."""
    engine = Engine()
    layer, backend, tensors = engine.args()
    pending = prepare_capture(layer, backend, tensors, step=3)
    want = complete_capture(prepare_capture(layer, backend, tensors, step=3), engine.output)
    # The engine reuses every buffer for the next step.
    for t in (tensors.query, tensors.key, tensors.value, tensors.block_table, tensors.seq_lens, engine.cache):
        t.zero_() if t.is_floating_point() else t.fill_(0)
    tensors.slot_mapping.fill_(-1)
    pending.attach_output(engine.output)
    engine.output.zero_()
    got = build_snapshot(pending)
    for name, t in want.tensors().items():
        assert same_bytes(got.tensors()[name], t), name


def test_the_plan_bounds_the_file_before_any_page_is_copied(tmp_path):
    engine = Engine()
    plan = plan_capture(*engine.args(), step=7)
    assert isinstance(plan, CapturePlan)
    # Pages are read only by gather(): what the cache holds then is what is stored.
    dim = page_dim(engine.snap.meta.kv_layout)
    engine.cache.index_fill_(dim, plan.page_ids, 2.0)
    pending = plan.gather()
    assert bool((pending.pages == 2.0).all())
    snapshot = complete_capture(pending, engine.output)
    size = snapshot_file_size(snapshot)
    assert plan.lower_bound_bytes <= size == os.path.getsize(save_snapshot(snapshot, tmp_path / "s.safetensors"))


@pytest.mark.parametrize("change, says", [
    (dict(query=torch.zeros(2, 4, 16, dtype=torch.bfloat16)), "query has shape [2, 4, 16], expected [>= "),
    (dict(seq_lens=torch.zeros(2, dtype=torch.int32)), "seq_lens has shape [2], expected [3] like block_table"),
    (dict(query_start_loc=torch.zeros(3, dtype=torch.int32)), "query_start_loc has shape [3], expected [4]"),
    (dict(causal=1), "causal must be a bool, got int"),
    (dict(slot_mapping=None), "key, value and slot_mapping come together; only key, value given"),
    (dict(key=torch.zeros(40, 3, 16, dtype=torch.bfloat16)), "key has shape [40, 3, 16], expected"),
    (dict(kv_cache=torch.zeros(4, 3, 16, 32, dtype=torch.bfloat16)), "kv_cache has shape [4, 3, 16, 32]"),
])
def test_malformed_steps_raise_an_error_naming_the_field(change, says):
    engine = Engine()
    with pytest.raises(CaptureInputError) as info:
        prepare_capture(*engine.args(**change))
    assert says in str(info.value)


def test_the_backend_must_agree_with_the_cache():
    engine = Engine()
    layer, backend, tensors = engine.args()
    with pytest.raises(CaptureInputError, match="page_size is 32 but kv_cache holds pages of 16 tokens"):
        prepare_capture(layer, dataclasses.replace(backend, page_size=32), tensors)
    with pytest.raises(CaptureInputError, match="num_gpu_blocks is 3 but kv_cache holds"):
        prepare_capture(layer, dataclasses.replace(backend, num_gpu_blocks=3), tensors)


def test_a_page_outside_the_cache_is_named():
    engine = Engine()
    table = engine.tensors.block_table.clone()
    table[1, 0] = engine.snap.meta.backend.num_gpu_blocks
    with pytest.raises(CaptureInputError, match=f"refers to page {int(table[1, 0])}, outside the cache"):
        prepare_capture(*engine.args(block_table=table))


def test_wrong_types_are_a_callers_error():
    engine = Engine()
    layer, backend, tensors = engine.args()
    with pytest.raises(TypeError, match="layer must be a CaptureLayer, got dict"):
        prepare_capture(dataclasses.asdict(layer), backend, tensors)
    with pytest.raises(TypeError, match="backend must be a CaptureBackend, got str"):
        prepare_capture(layer, "FLASHINFER_TS", tensors)


def test_complete_adds_the_output_or_names_what_is_wrong():
    engine = Engine()
    pending = prepare_capture(*engine.args())
    with pytest.raises(CaptureInputError, match="output has dtype float32, expected the model dtype bfloat16"):
        complete_capture(pending, engine.output.float())
    with pytest.raises(CaptureInputError, match=r"output has shape \[2, 4, 16\], expected \[>= 3"):
        complete_capture(pending, engine.output[:2])
    flat = engine.output.reshape(engine.output.shape[0], -1)  # [tokens, Hq*D], as vLLM's buffer is
    with pytest.raises(CaptureInputError, match=r"output has shape \[\d+, 63\], expected \[>= 3, 4, 16\]"):
        complete_capture(pending, flat[:, :63])
    snapshot = complete_capture(pending, flat)
    assert snapshot.steps[0].output.shape == (pending.num_tokens, 4, 16)
    assert same_bytes(snapshot.steps[0].output, engine.output[: pending.num_tokens])
    # A runner's padded buffer: the rows past the step's tokens are not kept.
    padded = torch.cat([flat, torch.full_like(flat[:2], float("nan"))])
    snapshot = complete_capture(prepare_capture(*engine.args()), padded)
    assert same_bytes(snapshot.steps[0].output, engine.output[: pending.num_tokens])


def test_pre_update_restores_only_the_pages_the_update_wrote():
    engine = Engine()
    t = engine.tensors
    before = engine.cache.clone()
    pre = save_pre_update(engine.layer, key=t.key, value=t.value, slot_mapping=t.slot_mapping, kv_cache=engine.cache,
                          step=7)
    slots = t.slot_mapping[t.slot_mapping >= 0].long()
    assert torch.equal(pre.page_ids, torch.unique(slots // engine.snap.meta.backend.page_size))
    engine.cache.index_fill_(0, pre.page_ids, 5.0)  # the engine's cache update
    snapshot = complete_capture(prepare_capture(*engine.args(key=None, value=None, slot_mapping=None,
                                                             pre_update=pre), step=7))
    assert same_bytes(snapshot.kv_cache, before.index_select(0, snapshot.page_ids.long()))
    assert snapshot.meta.capture["pre_update_pages_restored"] == len(pre.page_ids)
    other = dataclasses.replace(pre, page_size=32)
    with pytest.raises(CaptureInputError, match="pre_update was saved from a cache of another layout or page size"):
        prepare_capture(*engine.args(key=None, value=None, slot_mapping=None, pre_update=other))
    with pytest.raises(CaptureInputError, match="slot_mapping holds slot"):
        save_pre_update(engine.layer, key=t.key, value=t.value, slot_mapping=t.slot_mapping + 10**6,
                        kv_cache=engine.cache)


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
def test_an_undeclared_layout_is_inferred_from_the_shape_and_said_so(layout):
    engine = Engine(layout=layout)
    layer = dataclasses.replace(engine.layer, kv_layout=None)
    snapshot = complete_capture(prepare_capture(layer, engine.backend, engine.tensors))
    assert snapshot.meta.kv_layout == layout
    assert snapshot.meta.capture["kv_layout_source"] == "inferred from the cache shape"
    with pytest.raises(CaptureInputError, match=r"kv_cache has shape \[7, 16\], which is neither"):
        prepare_capture(layer, engine.backend, dataclasses.replace(engine.tensors, kv_cache=torch.zeros(7, 16)))


def test_the_page_buffers_are_reused_by_identity_among_free_buffers_of_other_sizes():
    from kvdbg.capture.buffers import POOLED_MIN_BYTES, HostBuffers

    pool = HostBuffers()
    small = torch.zeros(POOLED_MIN_BYTES, dtype=torch.uint8)
    large = torch.zeros(3 * POOLED_MIN_BYTES, dtype=torch.uint8)
    pool.give(small)
    pool.give(large)
    # Two free buffers of different sizes (a long capture's pages grow): the one that fits is handed back.
    assert pool.take(2 * POOLED_MIN_BYTES) is large
    assert pool.take(POOLED_MIN_BYTES) is small
    assert pool.free_bytes == 0 and pool.take(POOLED_MIN_BYTES) is not small


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("ids", [[3, 4, 5, 9, 10, 20], [7], list(range(0, 40, 2))])
def test_a_pooled_gather_copies_runs_of_pages_or_selects_them_alike(dim, ids, monkeypatch):
    from kvdbg.capture import buffers as capture_buffers
    from kvdbg.capture.buffers import MAX_RUNS, HostBuffers, StepCopies, _runs

    monkeypatch.setattr(capture_buffers, "POOLED_MIN_BYTES", 1)  # pool (and so copy by runs) even these pages
    monkeypatch.setattr(capture_buffers, "RUNS_MIN_BYTES", 1)
    shape = [2, 2, 4, 8, 16]
    shape[dim] = 40
    cache = torch.randn(shape)
    index = torch.tensor(ids, dtype=torch.int64)
    runs = _runs(index)
    count = 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))  # runs of consecutive ids
    assert (runs is None) == (count > MAX_RUNS)  # every second page of 40: twenty runs, too many to copy apart
    if runs is not None:
        assert sum(count for _, _, count in runs) == len(ids)
    copies = StepCopies(cache.device, HostBuffers())
    assert torch.equal(copies.gather(cache, dim, index), cache.index_select(dim, index))


@pytest.mark.parametrize("pinned", [False, True])
def test_a_kept_page_buffer_fits_the_next_steps_whose_sequences_grew(pinned):
    from kvdbg.capture.buffers import POOLED_MIN_BYTES, HostBuffers, _headroom

    if pinned and not torch.cuda.is_available():
        # The size rule alone: pinned buffers are made to the power of two the caching host allocator uses.
        assert _headroom(3 * POOLED_MIN_BYTES + 1, True) == 4 * POOLED_MIN_BYTES
        return
    pool = HostBuffers()
    first = pool.take(40 * POOLED_MIN_BYTES, pinned=pinned)
    assert first.numel() > 40 * POOLED_MIN_BYTES  # made with headroom
    pool.give(first)
    # A later step holds a page or two more: the same buffer serves it.
    assert pool.take(40 * POOLED_MIN_BYTES + 2 * 65536, pinned=pinned) is first
    assert _headroom(40 * POOLED_MIN_BYTES, False) <= 40 * POOLED_MIN_BYTES * 9 // 8


def test_a_span_is_one_copy_when_it_is_one_dense_run_of_memory_in_any_order_of_axes():
    """StepCopies.block takes a staged span to the host in one copy when its elements are one dense run of memory:
    a vLLM cache is a permuted view (TRITON_ATTN's LBNHC: pages outermost, heads and tokens swapped in the view),
    and so is its staged copy; a span of pages inside the K and V planes is two runs, gathered instead."""
    from kvdbg.capture.buffers import in_memory_order
    from kvdbg.vllm_plugin.graph_staging import _laid_out_like

    base = torch.arange(6 * 16 * 2 * 8, dtype=torch.float32).view(6, 16, 2, 8)
    physical, back = in_memory_order(base)
    assert physical.data_ptr() == base.data_ptr() and back == (0, 1, 2, 3) and physical.is_contiguous()
    cache = base.permute(0, 2, 1, 3)  # [pages, heads, tokens, dim] seen, [pages, tokens, heads, dim] in memory
    assert not cache.is_contiguous()
    for span in (cache, cache.narrow(0, 2, 3)):
        physical, back = in_memory_order(span)
        assert physical.is_contiguous() and torch.equal(physical.permute(*back), span)
        assert physical.data_ptr() == span.data_ptr()  # a view: one copy of it is one run
    assert in_memory_order(cache.narrow(2, 0, 8)) is None  # some tokens of each page: many runs
    planes = torch.zeros(2, 6, 16, 8)  # K and V planes outermost, pages inside
    assert in_memory_order(planes.narrow(1, 2, 3)) is None
    staged = _laid_out_like(cache, 0, 4)  # the staging program's buffer lies as the cache does
    assert staged.stride() != staged.contiguous().stride() and in_memory_order(staged.narrow(0, 1, 2)) is not None


def test_a_copy_issued_ahead_is_handed_back_as_it_is_and_only_its_own():
    """StepCopies.ahead: a later copy of that host tensor, or of a view of it, is the tensor itself (on a device it
    is still being written; the writer waits for the step's events), any other host tensor is cloned as ever."""
    from kvdbg.capture.buffers import StepCopies

    copies = StepCopies(torch.device("cpu"))
    source = torch.arange(24.0).view(6, 4)
    early = copies.ahead(source)
    assert early.data_ptr() != source.data_ptr() and torch.equal(early, source)
    view = early[:3]
    assert copies.copy(view) is view
    other = torch.ones(3, 4)
    again = copies.copy(other)
    assert again is not other and torch.equal(again, other)
    assert StepCopies(torch.device("cpu")).copy(view) is not view  # another step's copies: cloned
    assert not copies.span_ahead(source, 0, 0, 6)  # on the host a span is read where it lies, nothing ahead
