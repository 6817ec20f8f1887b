"""kvdbg.capture.capturer: engine tensors -> snapshot, budgets, filters, and never raising into the engine."""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import pytest
import torch

from kvdbg.capture.capturer import (
    CaptureBackend,
    CaptureInputError,
    CaptureLayer,
    Capturer,
    StepTensors,
    capture_step,
    infer_kv_layout,
    snapshot_file_size,
)
from kvdbg.snapshot.layout import split_kv
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.snapshot.store import load_snapshot, referenced_pages
from kvdbg.moves.synth import SynthSpec, synth_snapshot

PAD_ROWS = 3  # CUDA-graph padding: rows past query_start_loc[-1] that must not be stored


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def page_dim(layout: str) -> int:
    return 0 if layout == LAYOUT_VLLM else 1


class Engine:
    """A synthetic engine step: a full-size cache with the step's pages at their ids and garbage elsewhere."""

    def __init__(self, **spec):
        spec.setdefault("seq_lens", (20, 45, 70))
        spec.setdefault("num_heads", 4)
        spec.setdefault("num_kv_heads", 2)
        spec.setdefault("head_size", 16)
        spec.setdefault("stale_tail", 2)
        self.snap = synth_snapshot(SynthSpec(**spec))
        meta = self.snap.meta
        dim = page_dim(meta.kv_layout)
        shape = list(self.snap.kv_cache.shape)
        shape[dim] = meta.backend.num_gpu_blocks
        gen = torch.Generator().manual_seed(99)
        if self.snap.kv_cache.dtype == torch.uint8:
            cache = torch.randint(0, 120, shape, dtype=torch.uint8, generator=gen)
        else:
            cache = torch.randn(shape, generator=gen).to(self.snap.kv_cache.dtype)
        cache.index_copy_(dim, self.snap.page_ids.long(), self.snap.kv_cache)
        self.cache = cache
        step = self.snap.steps[0]
        hq, d = meta.layer.num_heads, meta.layer.head_size
        model_dtype = getattr(torch, meta.layer.dtype)
        self.output = torch.randn(step.num_tokens + PAD_ROWS, hq, d, generator=gen).to(model_dtype)

        def pad(t, fill=0):
            extra = torch.full((PAD_ROWS,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
            return torch.cat([t, extra])

        # Built once per layer, as an engine integration does.
        self.layer = CaptureLayer(
            name=meta.layer.name,
            num_heads=hq,
            num_kv_heads=meta.layer.num_kv_heads,
            head_size=d,
            scale=meta.layer.scale,
            dtype=model_dtype,
            kv_cache_dtype="fp8" if meta.layer.is_fp8 else "auto",
            kv_layout=meta.kv_layout,
            sliding_window=meta.layer.sliding_window,
            q_scale=meta.layer.q_scale,
            k_scale=meta.layer.k_scale,
            v_scale=meta.layer.v_scale,
        )
        self.backend = CaptureBackend(
            name=meta.backend.name,
            max_model_len=meta.backend.max_model_len,
            max_decode_query_len=meta.backend.max_decode_query_len,
            page_size=meta.backend.page_size,
            num_gpu_blocks=meta.backend.num_gpu_blocks,
        )
        # The step's tensors, with CUDA-graph padding rows.
        self.tensors = StepTensors(
            query=pad(step.query),
            key=pad(step.key),
            value=pad(step.value),
            slot_mapping=pad(step.slot_mapping, -1),
            kv_cache=self.cache,
            block_table=step.block_table,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            causal=meta.layer.causal,
        )

    def args(self, **tensors) -> tuple:
        """(layer, backend, tensors) for begin/capture, with some of the step's tensors replaced."""
        return self.layer, self.backend, dataclasses.replace(self.tensors, **tensors)


STEP = dict(step=7, rank=0)


CASES = {
    "vllm-bf16": dict(layout=LAYOUT_VLLM, dtype="bfloat16"),
    "kv-planes-fp16-window": dict(layout=LAYOUT_KV_PLANES, dtype="float16", sliding_window=24, causal=False, query_len=2),
    "vllm-fp8-uint8": dict(layout=LAYOUT_VLLM, fp8=True, fp8_storage="uint8", k_scale=0.5, v_scale=0.25, q_scale=2.0),
}


@pytest.mark.parametrize("case", CASES)
def test_capture_reproduces_every_tensor(tmp_path, case):
    engine = Engine(**CASES[case])
    path = capture_step(tmp_path, *engine.args(), output=engine.output, **STEP)
    assert path is not None and os.path.dirname(path) == str(tmp_path)
    got = load_snapshot(path)
    want, step = engine.snap, engine.snap.steps[0]
    num_tokens = step.num_tokens

    # Only referenced pages, engine ids kept, bytes untouched.
    assert torch.equal(got.page_ids.long(), referenced_pages([step], want.meta.backend.page_size))
    assert torch.equal(got.page_ids.long(), want.page_ids.long())
    assert got.num_pages < want.meta.backend.num_gpu_blocks
    assert same_bytes(got.kv_cache, want.kv_cache)
    expected_pages = engine.cache.index_select(page_dim(want.meta.kv_layout), got.page_ids.long())
    assert same_bytes(got.kv_cache, expected_pages)

    s = got.steps[0]
    for name in ("block_table", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(s, name), getattr(step, name)), name
    assert same_bytes(s.query, step.query)
    assert same_bytes(s.key, step.key) and same_bytes(s.value, step.value)
    assert torch.equal(s.slot_mapping, step.slot_mapping)
    assert same_bytes(s.output, engine.output[:num_tokens])

    assert got.meta.layer == want.meta.layer
    assert got.meta.backend == want.meta.backend
    assert got.meta.kv_layout == want.meta.kv_layout
    capture = got.meta.capture
    assert capture["step"] == 7 and capture["rank"] == 0
    assert capture["torch"] == torch.__version__
    assert capture["time"].endswith("+00:00")
    assert capture["stored_pages"] == got.num_pages
    assert capture["query_rows_given"] == num_tokens + PAD_ROWS
    assert capture["kv_cache_engine_shape"] == list(engine.cache.shape)


def test_file_size_prediction_is_exact(tmp_path):
    engine = Engine()
    capturer = Capturer(tmp_path)
    pending = capturer.begin(*engine.args(), **STEP)
    path = capturer.finish(pending, engine.output)
    assert os.path.getsize(path) == capturer.bytes_written
    assert snapshot_file_size(load_snapshot(path)) == os.path.getsize(path)


def test_begin_copies_what_the_forward_may_overwrite(tmp_path):
    engine = Engine()
    step = engine.snap.steps[0]
    kept = {n: t.clone() for n, t in step.tensors().items()}
    kept_pages = engine.snap.kv_cache.clone()
    capturer = Capturer(tmp_path)
    pending = capturer.begin(*engine.args(), **STEP)
    # An in-place kernel (or the next step) scribbles over every engine buffer.
    for name in ("query", "key", "value", "kv_cache", "block_table", "seq_lens", "query_start_loc", "slot_mapping"):
        getattr(engine.tensors, name).zero_()
    path = capturer.finish(pending, engine.output)
    got = load_snapshot(path)
    assert same_bytes(got.kv_cache, kept_pages)
    for name in ("block_table", "seq_lens", "query_start_loc", "query", "key", "value", "slot_mapping"):
        assert same_bytes(getattr(got.steps[0], name), kept[name]), name


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
def test_pre_update_restores_pages_the_cache_update_overwrote(tmp_path, layout):
    engine = Engine(layout=layout)
    tensors = engine.tensors
    before = engine.cache.clone()
    capturer = Capturer(tmp_path)
    pre = capturer.save_pre_update(engine.layer, key=tensors.key, value=tensors.value,
                                   slot_mapping=tensors.slot_mapping, kv_cache=engine.cache, step=7)
    assert pre is not None and len(pre.page_ids) > 0
    # The engine's cache update: every slot's page now holds the new K.
    dim = page_dim(layout)
    engine.cache.index_fill_(dim, pre.page_ids, 3.0)
    assert not torch.equal(engine.cache, before)
    path = capturer.capture(*engine.args(key=None, value=None, slot_mapping=None, pre_update=pre),
                            output=engine.output, **STEP)
    got = load_snapshot(path)
    assert same_bytes(got.kv_cache, before.index_select(dim, got.page_ids.long()))
    assert torch.equal(got.steps[0].slot_mapping, engine.snap.steps[0].slot_mapping)
    assert same_bytes(got.steps[0].key, engine.snap.steps[0].key)
    assert got.meta.capture["pre_update_pages_restored"] == len(pre.page_ids)


class CopyInFlight:
    """A host copy still in flight from a device, as after ``to("cpu", non_blocking=True)``: the host tensors
    hold garbage until ``synchronize()``, which lands the values (once; a second call counts but copies nothing)."""

    def __init__(self, **sources):
        self.sources = sources
        self.hosts = {name: torch.full_like(t, 10_000) for name, t in sources.items()}  # past any page or length
        self.calls = 0

    def synchronize(self):
        if self.calls == 0:
            for name, host in self.hosts.items():
                host.copy_(self.sources[name])
        self.calls += 1


def test_metadata_in_flight_is_read_only_after_its_event(tmp_path):
    """Host copies issued ahead (the vLLM plugin's, at build time) are waited for before capture reads them:
    before the cache update for the slots, and before the forward for the block table and lengths."""
    engine = Engine()
    t = engine.tensors
    before = engine.cache.clone()
    capturer = Capturer(tmp_path)
    slots = CopyInFlight(slot_mapping=t.slot_mapping)
    pre = capturer.save_pre_update(engine.layer, key=t.key, value=t.value, slot_mapping=slots.hosts["slot_mapping"],
                                   kv_cache=engine.cache, step=7, ready=slots)
    assert pre is not None and slots.calls == 1
    engine.cache.index_fill_(0, pre.page_ids, 3.0)  # the engine's cache update
    meta = CopyInFlight(block_table=t.block_table, seq_lens=t.seq_lens, query_start_loc=t.query_start_loc)
    path = capturer.capture(*engine.args(key=None, value=None, slot_mapping=None, pre_update=pre,
                                         metadata_copied=True, metadata_ready=meta, **meta.hosts),
                            output=engine.output, **STEP)
    assert meta.calls == 1
    got, want = load_snapshot(path), engine.snap
    for name in ("block_table", "seq_lens", "query_start_loc", "slot_mapping"):
        assert torch.equal(getattr(got.steps[0], name), getattr(want.steps[0], name)), name
    assert torch.equal(got.page_ids.long(), want.page_ids.long())
    assert same_bytes(got.kv_cache, before.index_select(0, got.page_ids.long()))


def _cache_update(engine, layout, key, value, slot_mapping):
    """The engine's cache update: each token's K and V into its slot, through kvdbg's views of the layout."""
    page_size = engine.snap.meta.backend.page_size
    keys, values = split_kv(engine.cache, layout, engine.layer.head_size)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            keys[slot // page_size, :, slot % page_size] = key[token]
            values[slot // page_size, :, slot % page_size] = value[token]


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
@pytest.mark.parametrize("queue_bytes", [0, "auto"])
def test_the_writer_reads_the_written_slots_back_and_refuses_a_layer_that_does_not_hold_them(tmp_path, caplog, layout,
                                                                                             queue_bytes):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    engine = Engine(layout=layout)
    t = engine.tensors
    capturer = Capturer(tmp_path, queue_bytes=queue_bytes)

    def step(index, update):
        pre = capturer.save_pre_update(engine.layer, key=t.key, value=t.value, slot_mapping=t.slot_mapping,
                                       kv_cache=engine.cache, step=index, rank=0, check_written=True)
        assert pre is not None or index == 2  # by step 2 the layer is refused
        update(engine, layout, t.key, t.value, t.slot_mapping)
        capturer.capture(*engine.args(key=None, value=None, slot_mapping=None, pre_update=pre),
                         output=engine.output, step=index, rank=0)
        assert capturer.flush(10)

    step(0, _cache_update)
    (path,) = capturer.written
    assert load_snapshot(path).meta.capture["kv_layout_read_back"] == (
        f"passed: the {int((t.slot_mapping >= 0).sum())} slots do_kv_cache_update wrote read back through {layout} "
        "as the K/V it was given")
    step(1, lambda engine, layout, key, value, slots: _cache_update(engine, layout, value, key, slots))  # K, V swapped
    step(2, _cache_update)  # the layer stays refused
    assert len(capturer.written) == 1 and capturer.dropped == {"refused": 2}
    assert capturer.layer_refused(engine.layer.name).startswith(f"read through layout '{layout}', slot ")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "from step 1 on, found by the writer" in warnings[0], warnings
    assert capturer.active  # other layers are still captured
    capturer.close(10)


class PreCopiesInFlight:
    """A pre-update's copies still in flight (as on another stream than the forward's): its K/V hold garbage until
    ``wait()``, which lands them; the other methods pass through to the real copies."""

    def __init__(self, pre):
        self.real, self.pre = pre.copies, pre
        self.kv = (pre.key.clone(), pre.value.clone())
        pre.key.fill_(-7.0)
        pre.value.fill_(-7.0)
        self.waited = 0

    def wait(self):
        if not self.waited:
            self.pre.key.copy_(self.kv[0])
            self.pre.value.copy_(self.kv[1])
        self.waited += 1
        self.real.wait()

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_the_read_back_waits_for_the_pre_update_copies_it_reads(tmp_path):
    """The written slots are compared with the K/V the update was given only once those copies have landed."""
    engine = Engine(layout=LAYOUT_VLLM)
    t = engine.tensors
    capturer = Capturer(tmp_path, queue_bytes="auto")
    pre = capturer.save_pre_update(engine.layer, key=t.key, value=t.value, slot_mapping=t.slot_mapping,
                                   kv_cache=engine.cache, step=3, rank=0, check_written=True)
    pre.copies = in_flight = PreCopiesInFlight(pre)
    _cache_update(engine, LAYOUT_VLLM, t.key, t.value, t.slot_mapping)
    capturer.capture(*engine.args(key=None, value=None, slot_mapping=None, pre_update=pre), output=engine.output,
                     step=3, rank=0)
    assert capturer.close(10)
    assert in_flight.waited and not capturer.dropped and not capturer.layer_refused(engine.layer.name)
    got = load_snapshot(capturer.written[0])
    assert got.meta.capture["kv_layout_read_back"].startswith("passed")
    assert same_bytes(got.steps[0].key, engine.snap.steps[0].key)


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
def test_an_engine_under_inference_mode_is_captured_by_the_background_writer(tmp_path, layout):
    # The copies made in the engine's thread are then inference tensors, which the writer updates in place
    # (the pre-update pages put back) on its own thread, outside the engine's inference mode.
    engine = Engine(layout=layout)
    t = engine.tensors
    before = engine.cache.clone()
    capturer = Capturer(tmp_path, queue_bytes="auto")
    with torch.inference_mode():
        pre = capturer.save_pre_update(engine.layer, key=t.key, value=t.value, slot_mapping=t.slot_mapping,
                                       kv_cache=engine.cache, step=3, rank=0, check_written=True)
        _cache_update(engine, layout, t.key, t.value, t.slot_mapping)
        capturer.capture(*engine.args(key=None, value=None, slot_mapping=None, pre_update=pre),
                         output=engine.output, step=3, rank=0)
    assert capturer.close(10) and capturer.dropped == {} and not capturer.failures
    (path,) = capturer.written
    got = load_snapshot(path)
    assert same_bytes(got.kv_cache, before.index_select(page_dim(layout), got.page_ids.long()))
    assert got.meta.capture["kv_layout_read_back"].startswith("passed")


def test_capture_without_new_kv(tmp_path):
    engine = Engine()
    got = load_snapshot(capture_step(tmp_path, *engine.args(key=None, value=None, slot_mapping=None), **STEP))
    assert not got.steps[0].has_update and got.steps[0].output is None


# --------------------------------------------------------------------------- budgets and failures


def records(caplog):
    return [r for r in caplog.records if r.name == "kvdbg.capture"]


def test_byte_cap_too_small_writes_nothing(tmp_path, caplog):
    engine = Engine()
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    capturer = Capturer(tmp_path / "snaps", max_bytes=1000)
    assert capturer.capture(*engine.args(), output=engine.output, **STEP) is None
    assert capturer.capture(*engine.args(), output=engine.output, **STEP) is None
    assert not (tmp_path / "snaps").exists()
    logged = records(caplog)
    assert len(logged) == 1 and "1000" in logged[0].getMessage()
    assert capturer.active  # a smaller step could still fit


def test_byte_cap_admits_exactly_what_fits(tmp_path):
    engine = Engine()
    size = os.path.getsize(capture_step(tmp_path / "probe", *engine.args(), output=engine.output, **STEP))
    capturer = Capturer(tmp_path / "snaps", max_bytes=size, rank=0)  # same provenance, same size
    assert capturer.capture(*engine.args(), output=engine.output, **STEP) is not None
    assert capturer.capture(*engine.args(), output=engine.output, **STEP) is None
    assert capturer.bytes_written == size and len(os.listdir(tmp_path / "snaps")) == 1


def test_count_cap_turns_capture_off(tmp_path):
    engine = Engine()
    capturer = Capturer(tmp_path, max_snapshots=2)
    paths = [capturer.capture(*engine.args(), output=engine.output, **STEP) for _ in range(3)]
    assert paths[2] is None and len(set(paths[:2])) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths[:2])
    assert not capturer.active


def test_unwritable_directory_logs_once_and_never_raises(tmp_path, caplog):
    engine = Engine()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    capturer = Capturer(blocker / "snaps")
    for _ in range(3):
        assert capturer.capture(*engine.args(), output=engine.output, **STEP) is None
    logged = records(caplog)
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert "cannot create capture directory" in logged[0].getMessage()
    assert not capturer.active


@pytest.mark.parametrize("change, field_named", [
    (dict(query=torch.zeros(5, 3, 16, dtype=torch.bfloat16)), "query"),
    (dict(block_table=torch.zeros(3, dtype=torch.int32)), "block_table"),
    (dict(seq_lens=torch.tensor([20, 45], dtype=torch.int32)), "seq_lens"),
    (dict(kv_cache=torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)), "kv_cache"),
    (dict(causal=torch.tensor([True, False, True])), "causal"),
    (dict(key=None), "key, value and slot_mapping come together"),
])
def test_malformed_step_is_skipped_not_raised(tmp_path, caplog, change, field_named):
    engine = Engine()
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    capturer = Capturer(tmp_path / "snaps")
    assert capturer.capture(*engine.args(**change), output=engine.output, **STEP) is None
    logged = records(caplog)
    assert len(logged) == 1 and field_named in logged[0].getMessage()
    assert capturer.active and not (tmp_path / "snaps").exists()
    # The next, well-formed step is still captured.
    assert capturer.capture(*engine.args(), output=engine.output, **STEP) is not None


@pytest.mark.parametrize("change, field_named", [
    (dict(k_scale=float("nan")), "layer.k_scale"),
    (dict(scale=0.0), "layer.scale"),
    (dict(num_kv_heads=3), "multiple of layer.num_kv_heads"),
    (dict(dtype=torch.int8), "model_dtype"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
    (dict(kv_layout="pages,tokens"), "kv_layout 'pages,tokens' is not a layout kvdbg knows"),
    (dict(sliding_window="wide"), "sliding_window"),
])
def test_a_malformed_layer_is_refused_when_built(change, field_named):
    engine = Engine()
    with pytest.raises(CaptureInputError, match=re.escape(field_named)):
        dataclasses.replace(engine.layer, **change)


def test_wrong_argument_types_are_reported_not_raised(tmp_path, caplog):
    engine = Engine()
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    capturer = Capturer(tmp_path)
    as_dict = dataclasses.asdict(engine.tensors)
    assert capturer.capture(engine.layer, engine.backend, as_dict, output=engine.output, **STEP) is None
    errors = [r for r in records(caplog) if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "tensors must be a StepTensors, got dict" in errors[0].getMessage()
    assert not capturer.active  # a caller's bug repeats on every step


def test_block_table_outside_the_cache_is_skipped(tmp_path):
    engine = Engine()
    table = engine.tensors.block_table.clone()
    table[0, 0] = engine.snap.meta.backend.num_gpu_blocks + 5
    assert capture_step(tmp_path, *engine.args(block_table=table), **STEP) is None
    assert os.listdir(tmp_path) == []


def test_wrong_output_shape_is_skipped(tmp_path):
    engine = Engine()
    capturer = Capturer(tmp_path)
    assert capturer.capture(*engine.args(), output=engine.output[:, :2], **STEP) is None
    assert capturer.failures and os.listdir(tmp_path) == []


def test_disabled_or_filtered_capturer_writes_nothing(tmp_path):
    engine = Engine()
    off = Capturer(tmp_path / "off")
    off.disable("test")
    assert off.capture(*engine.args(), output=engine.output, **STEP) is None
    other_layer = Capturer(tmp_path / "layer", layers="*.layers.9.*")
    assert other_layer.capture(*engine.args(), output=engine.output, **STEP) is None
    other_step = Capturer(tmp_path / "step", steps="0-6,8-")
    assert other_step.capture(*engine.args(), output=engine.output, **STEP) is None
    other_rank = Capturer(tmp_path / "rank", ranks="1-3")
    assert other_rank.capture(*engine.args(), output=engine.output, **STEP) is None
    assert not any((tmp_path / d).exists() for d in ("off", "layer", "step", "rank"))
    assert Capturer(tmp_path / "on", layers="re:layers\\.0\\.", steps="7", ranks="0").capture(*engine.args(), **STEP)


def test_names_are_unique_across_capturers(tmp_path):
    engine = Engine()
    first = capture_step(tmp_path, *engine.args(), **STEP)
    second = capture_step(tmp_path, *engine.args(), **STEP)
    assert first and second and first != second
    assert os.path.basename(first).startswith("model.layers.0.self_attn.attn-step7-rank0-")
    assert len(os.listdir(tmp_path)) == 2


# --------------------------------------------------------------------------- configuration


def test_infer_kv_layout():
    assert infer_kv_layout(torch.empty(9, 2, 16, 32), 2, 16) == LAYOUT_VLLM
    assert infer_kv_layout(torch.empty(2, 9, 16, 2, 16), 2, 16) == LAYOUT_KV_PLANES


def test_select_layers_applies_from_now_on(tmp_path):
    capturer = Capturer(tmp_path, layers="*.layers.0.*")
    assert capturer.wants("model.layers.0.attn") and not capturer.wants("model.layers.1.attn")
    capturer.select_layers("*.layers.1.*")
    assert not capturer.wants("model.layers.0.attn") and capturer.wants("model.layers.1.attn")
    capturer.select_layers(None)
    assert capturer.wants("model.layers.0.attn")
