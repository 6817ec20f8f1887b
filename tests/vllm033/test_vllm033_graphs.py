"""The plugin's CUDA-graph hook against vLLM 0.33's own graph wrapper, forward context and batch descriptor.

No graph is recorded here (no GPU): what is checked is that the plugin reads vLLM's objects as vLLM defines them,
telling a graph being recorded, a full graph replayed and a piecewise one (attention in Python) apart.
"""

from __future__ import annotations

import pytest

from kvdbg import vllm_plugin


@pytest.fixture
def state(monkeypatch, tmp_path):
    monkeypatch.setenv("KVDBG_CAPTURE_DIR", str(tmp_path))
    vllm_plugin.unregister()
    vllm_plugin.register()
    yield vllm_plugin._state
    vllm_plugin.unregister()


def wrapper(mode):
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    graph = object.__new__(CUDAGraphWrapper)  # its constructor asks the platform for a graph pool (CUDA)
    graph.runtime_mode, graph.concrete_cudagraph_entries = mode, {}
    return graph


def test_vllms_graph_wrapper_is_wrapped_and_restored(state):
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    assert state.graphs_watched and hasattr(CUDAGraphWrapper.__call__, "_kvdbg_original")
    vllm_plugin.unregister()
    assert not hasattr(CUDAGraphWrapper.__call__, "_kvdbg_original")


def test_recording_replaying_and_piecewise_graphs_are_told_apart(state):
    from vllm.compilation.cuda_graph import CUDAGraphEntry
    from vllm.config import CUDAGraphMode, DeviceConfig, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    full, piecewise = wrapper(CUDAGraphMode.FULL), wrapper(CUDAGraphMode.PIECEWISE)
    batch = BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True)
    assert state.graph_call(full) is None  # no forward context: vLLM runs the model without graphs
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=batch):
        assert state.graph_call(full) == ("record", batch)
        assert state.graph_call(piecewise) is None  # another wrapper's mode: it just runs its runnable
        full.concrete_cudagraph_entries[batch] = CUDAGraphEntry(batch_descriptor=batch)
        assert state.graph_call(full) == ("record", batch)  # an entry, no graph yet
        full.concrete_cudagraph_entries[batch].cudagraph = object()
        assert state.graph_call(full) == ("replay", batch)
    # A full graph of 8 tokens for mixed batches is another graph than the uniform decode one: another key.
    mixed = BatchDescriptor(num_tokens=8, num_reqs=None, uniform=False)
    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=mixed):
        kind, key = state.graph_call(full)
        assert kind == "record" and key == mixed and key != batch and key.num_tokens == 8
    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=batch):
        assert state.graph_call(piecewise) == ("record_pieces", batch)  # writers held; attention stays eager
        piecewise.concrete_cudagraph_entries[batch] = CUDAGraphEntry(batch_descriptor=batch, cudagraph=object())
        assert state.graph_call(piecewise) is None  # attention ran in Python between the pieces
    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=batch):
        assert state.graph_call(full) is None
