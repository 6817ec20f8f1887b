"""Capture from a CUDA engine: asynchronous device-to-host copies, the same snapshot as from the host, no waiting."""

from __future__ import annotations

import time

import pytest
import torch

from kvdbg.capture import buffers as capture_buffers
from kvdbg.capture.capturer import Capturer
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.snapshot.store import load_snapshot
from tests.test_capture import Engine, same_bytes

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def on_device(engine: Engine, *, metadata_on_device: bool):
    layer, backend, tensors = engine.args()
    moved = {name: getattr(tensors, name).cuda() for name in ("query", "key", "value", "kv_cache")}
    if metadata_on_device:
        moved.update({name: getattr(tensors, name).cuda()
                      for name in ("block_table", "seq_lens", "query_start_loc", "slot_mapping")})
    for name, t in moved.items():
        setattr(tensors, name, t)
    return layer, backend, tensors, engine.output.cuda()


def capture_one(directory, layer, backend, tensors, output) -> str:
    capturer = Capturer(directory, queue_bytes="auto")
    capturer.finish(capturer.begin(layer, backend, tensors, step=3, rank=0), output)
    assert capturer.close(60) and len(capturer.written) == 1
    return capturer.written[0]


@pytest.fixture(params=["current-stream", "side-stream"])
def pages_path(request, monkeypatch):
    """Both ways pages reach the host: a small step's on the engine's stream, a larger one's on the side stream."""
    if request.param == "side-stream":
        monkeypatch.setattr(capture_buffers, "SIDE_STREAM_MIN_BYTES", 0)
    else:
        def no_side_stream(device):
            raise AssertionError("a small step's pages took the side stream")
        monkeypatch.setattr(capture_buffers, "_side_stream", no_side_stream)
    return request.param


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
@pytest.mark.parametrize("metadata_on_device", [False, True], ids=["host-metadata", "device-metadata"])
def test_a_cuda_step_gives_the_snapshot_a_host_step_gives(tmp_path, layout, metadata_on_device, pages_path):
    engine = Engine(layout=layout, dtype="bfloat16")
    host = load_snapshot(capture_one(tmp_path / "host", *engine.args(), engine.output))
    device = load_snapshot(capture_one(tmp_path / "cuda", *on_device(engine, metadata_on_device=metadata_on_device)))
    for name, t in host.tensors().items():
        assert same_bytes(device.tensors()[name], t), name
    assert device.meta.capture["device"].startswith("cuda") and device.meta.capture["gpu"]


def test_pages_larger_than_a_slice_are_gathered_in_slices(tmp_path, monkeypatch):
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    host = load_snapshot(capture_one(tmp_path / "host", *engine.args(), engine.output))
    page_bytes = engine.cache[0].numel() * engine.cache.element_size()
    monkeypatch.setattr(capture_buffers, "GATHER_CHUNK_BYTES", 2 * page_bytes)  # two pages a slice
    monkeypatch.setattr(capture_buffers, "SIDE_STREAM_MIN_BYTES", 0)  # slices are the side stream's
    device = load_snapshot(capture_one(tmp_path / "cuda", *on_device(engine, metadata_on_device=False)))
    assert same_bytes(device.kv_cache, host.kv_cache)


def test_the_engine_thread_does_not_wait_for_the_device(tmp_path, pages_path):
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    layer, backend, tensors, output = on_device(engine, metadata_on_device=False)
    capturer = Capturer(tmp_path, queue_bytes="auto")
    capturer.finish(capturer.begin(layer, backend, tensors, step=0, rank=0), output)  # warm: streams, pinned pool
    assert capturer.flush(60)
    # The step's own kernels below, once before: CUDA loads a kernel on its first launch, and that load waits for
    # the device, which would be counted against the capture.
    tensors.kv_cache.clone().add_(0)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(2e9))  # the engine's stream is busy for a while (about a second)
    end.record()
    t0 = time.perf_counter()
    pending = capturer.begin(layer, backend, tensors, step=1, rank=0)
    before = tensors.kv_cache.clone()  # what the capture must hold: the cache at this point of the stream
    tensors.kv_cache.add_(1)  # the step's own cache update, queued after the capture on the same stream
    capturer.finish(pending, output)
    returned = time.perf_counter() - t0
    torch.cuda.synchronize()
    busy = start.elapsed_time(end) / 1e3
    assert returned < busy / 4, (returned, busy)
    assert capturer.close(60)
    snap = load_snapshot(capturer.written[-1])
    assert same_bytes(snap.kv_cache, before.index_select(0, snap.page_ids.long().cuda()).cpu())


def test_copies_on_a_stream_the_engine_left_before_finish_are_waited_for(tmp_path, pages_path):
    """begin on one stream, finish on another: the writer still waits for the first stream's copies."""
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    layer, backend, tensors, output = on_device(engine, metadata_on_device=False)
    capturer = Capturer(tmp_path, queue_bytes="auto")
    capturer.finish(capturer.begin(layer, backend, tensors, step=0, rank=0), output)  # warm
    assert capturer.flush(60)
    tensors.kv_cache.clone().add_(0)
    torch.cuda.synchronize()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        torch.cuda._sleep(int(1e9))  # the first stream is busy: its copies run well after finish returns
        pending = capturer.begin(layer, backend, tensors, step=1, rank=0)
        before = tensors.kv_cache.clone()
        tensors.kv_cache.add_(1)
    with torch.cuda.stream(second):  # idle: an event recorded only here would complete at once
        capturer.finish(pending, output)
    assert capturer.close(60)
    torch.cuda.synchronize()
    snap = load_snapshot(capturer.written[-1])
    assert same_bytes(snap.kv_cache, before.index_select(0, snap.page_ids.long().cuda()).cpu())
