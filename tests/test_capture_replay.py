"""Capture from a real forward of kvdbg's own backends, then replay the file: the engine's output, to a few ulps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvdbg.capture.capturer import CaptureBackend, CaptureLayer, Capturer, StepTensors
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.replayer.runner import replay
from kvdbg.snapshot.store import Snapshot, load_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from tests.helpers import assert_close_ulps


def engine_state(spec: SynthSpec) -> Snapshot:
    """A snapshot that holds the engine's *whole* cache (every page id stored), as a live engine has it."""
    snap = synth_snapshot(spec)
    total = snap.meta.backend.num_gpu_blocks
    page_dim = 0 if snap.meta.kv_layout == LAYOUT_VLLM else 1
    shape = list(snap.kv_cache.shape)
    shape[page_dim] = total
    # Pages the step never touches hold garbage, as in a real engine; capture must leave them out.
    if snap.kv_cache.element_size() == 1:  # FP8 pages: any byte pattern
        full = torch.randint(0, 255, shape, dtype=torch.uint8).view(snap.kv_cache.dtype)
    else:
        full = torch.randn(shape).to(snap.kv_cache.dtype)
    full.index_copy_(page_dim, snap.page_ids.to(torch.int64), snap.kv_cache)
    return dataclasses.replace(snap, kv_cache=full, page_ids=torch.arange(total, dtype=torch.int32))


def layer_forward(engine: Snapshot, backend: str, capturer: Capturer, tmp_path) -> tuple[torch.Tensor, str]:
    """What a vLLM layer call does around an attention impl: capture, cache update + forward, finish."""
    meta, step = engine.meta, engine.steps[0]
    layer, be = meta.layer, meta.backend
    pending = capturer.begin(
        CaptureLayer(name=layer.name, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                     head_size=layer.head_size, scale=layer.scale, dtype=layer.dtype,
                     kv_cache_dtype=layer.kv_cache_dtype, kv_layout=meta.kv_layout,
                     sliding_window=layer.sliding_window, q_scale=layer.q_scale, k_scale=layer.k_scale,
                     v_scale=layer.v_scale),
        CaptureBackend(name=be.name, max_model_len=be.max_model_len, max_decode_query_len=be.max_decode_query_len,
                       page_size=be.page_size, num_gpu_blocks=be.num_gpu_blocks),
        StepTensors(query=step.query, key=step.key, value=step.value, slot_mapping=step.slot_mapping,
                    kv_cache=engine.kv_cache, block_table=step.block_table, seq_lens=step.seq_lens,
                    query_start_loc=step.query_start_loc, causal=layer.causal),
        step=0, rank=0,
    )
    assert pending is not None
    # The engine runs the backend on its whole cache (cache update first, then attention).
    result = replay(engine, [backend], required=[backend])
    output = result.steps[0].runs[backend].output.to(getattr(torch, layer.dtype))
    path = capturer.finish(pending, output)
    assert path is not None
    return output, path


@pytest.mark.parametrize(
    "backend,spec",
    [
        ("flashinfer_ts", SynthSpec(seq_lens=(300, 45, 129), query_len=4, causal=False, sliding_window=64,
                                    num_heads=8, num_kv_heads=2, head_size=64, seed=11)),
        ("flashinfer_ts", SynthSpec(seq_lens=(70, 33), query_len=2, causal=True, fp8=True, k_scale=0.03,
                                    v_scale=0.04, q_scale=0.05, num_heads=4, num_kv_heads=1, head_size=64, seed=12)),
        ("reference", SynthSpec(seq_lens=(50, 90), query_len=3, layout=LAYOUT_KV_PLANES, use_page_zero=True,
                                num_heads=4, num_kv_heads=2, head_size=32, seed=13)),
        ("flex", SynthSpec(seq_lens=(50, 90), query_len=1, causal=True, num_heads=4, num_kv_heads=2,
                           head_size=32, seed=14)),
    ],
)
def test_capture_then_replay_gives_the_engine_output(tmp_path, backend, spec):
    engine = engine_state(spec)
    capturer = Capturer(tmp_path)
    engine_out, path = layer_forward(engine, backend, capturer, tmp_path)
    snap = load_snapshot(path)
    # Compaction: only the pages the step reads or writes, not the engine's whole cache.
    assert snap.num_pages < engine.num_pages
    assert torch.equal(snap.steps[0].output.view(torch.uint8), engine_out.view(torch.uint8))
    replayed = replay(snap, [backend], required=[backend]).steps[0].runs[backend].output
    # The engine ran over its whole cache, the replay over the snapshot's pages: a float kernel output,
    # equal within a few ulps of its dtype (bit for bit on one machine, not promised across CPUs).
    assert_close_ulps(replayed.to(engine_out.dtype), engine_out)
