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


class _Graph:
    """torch.cuda.CUDAGraph as vLLM's wrapper uses it, on the CPU: recorded once, replays counted."""

    made: list = []

    def __init__(self):
        self.replays = 0
        _Graph.made.append(self)

    def replay(self):
        self.replays += 1


def _graph_capture_on_the_cpu(monkeypatch):
    """vLLM 0.33's CUDAGraphWrapper.__call__ run as it is, its CUDA calls stood in for: recording runs the runnable
    (inside a stream capture that records nothing), replay replays the entry's graph and returns its output."""
    import contextlib

    import torch
    from vllm.compilation import cuda_graph

    _Graph.made = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graph, "current_stream", lambda: None)
    monkeypatch.setattr(cuda_graph, "weak_ref_tensors", lambda t: t)
    monkeypatch.setattr(cuda_graph, "capture_pool", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graph, "validate_cudagraph_capturing_enabled", lambda: None)


def test_a_full_graph_is_recorded_twice_and_steps_nothing_wants_replay_the_one_without_kvdbgs_copies(
        state, monkeypatch):
    """vLLM's own wrapper records its graph; kvdbg's wrapper has it record again without kvdbg's copies, and before
    each replay installs the graph with the copies for a step the step filter selects, the plain one otherwise
    (the output vLLM returns is that graph's)."""
    import torch
    from vllm.compilation.cuda_graph import CUDAGraphOptions, CUDAGraphWrapper
    from vllm.config import CUDAGraphMode, DeviceConfig, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    from kvdbg.capture.config import IntRanges

    _graph_capture_on_the_cpu(monkeypatch)
    name = "model.layers.0.self_attn.attn"
    layer = type("Layer", (), {"layer_name": name})()
    kv_cache = torch.zeros(2, 4, 16, 2, 8)
    recordings = []

    def runnable(x):
        """The model: its attention layer as kvdbg's forward hook sees it while a graph records; each recording's
        output tensor its own (the graph's, which vLLM returns at a replay)."""
        slot = state.record_in_graph(None, layer, x, kv_cache, None)
        recordings.append(slot is not None)
        out = x * 2
        if slot is not None:
            state.record_graph_output(slot, out)
        outputs.append(out)
        return out

    outputs = []

    wrapper = object.__new__(CUDAGraphWrapper)
    wrapper.runnable, wrapper.runtime_mode, wrapper.concrete_cudagraph_entries = runnable, CUDAGraphMode.FULL, {}
    wrapper.cudagraph_options, wrapper.graph_pool, wrapper.is_debugging_mode = CUDAGraphOptions(), None, False
    wrapper.vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    batch = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    x = torch.ones(4, 2, 8)
    state.capturer.reconfigure(steps=IntRanges.of(2, "steps"))
    with set_forward_context(None, wrapper.vllm_config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                             batch_descriptor=batch):
        wrapper(x)
        # Recorded twice: with the copies (the layer's slot learnt), then without (nothing of kvdbg's recorded).
        assert recordings == [True, False] and len(_Graph.made) == 2
        copying, plain = _Graph.made
        entry = wrapper.concrete_cudagraph_entries[batch]
        assert entry.cudagraph is copying and [s.name for s in state._graph_layers[batch]] == [name]
        replayed = []
        for step in range(4):
            before = (copying.replays, plain.replays)
            out = wrapper(x)
            replayed.append("copies" if copying.replays > before[0] else "plain" if plain.replays > before[1]
                            else None)
            assert out is outputs[0 if replayed[-1] == "copies" else 1]  # the output of the graph replayed
        # Steps 0, 1 and 3 nothing wants: the plain graph; step 2 the filter selects: the graph with the copies.
        assert replayed == ["plain", "plain", "copies", "plain"]
        assert state.plain_replays == 3 and state._forward_counts[name] == 4
        # vLLM lets its graphs go (after profiling their memory): kvdbg's variants go with them; recorded anew.
        wrapper.clear_graphs()
        assert not state._graph_variants
        wrapper(x)
        assert len(_Graph.made) == 4 and len(state._graph_variants) == 1
    # Without a layer of kvdbg's in the graph there is nothing to leave out: recorded once.
    recordings.clear()
    other = BatchDescriptor(num_tokens=2, num_reqs=2, uniform=True)
    state.capturer.reconfigure(layers=None)
    monkeypatch.setattr(state.capturer, "layer_selected", lambda n: False)
    with set_forward_context(None, wrapper.vllm_config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                             batch_descriptor=other):
        wrapper(torch.ones(2, 2, 8))
    assert recordings == [False] and len(_Graph.made) == 5


def test_a_failed_second_recording_leaves_the_graph_with_the_copies_for_every_step(state, monkeypatch, caplog):
    import torch
    from vllm.compilation.cuda_graph import CUDAGraphOptions, CUDAGraphWrapper
    from vllm.config import CUDAGraphMode, DeviceConfig, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    _graph_capture_on_the_cpu(monkeypatch)
    layer = type("Layer", (), {"layer_name": "model.layers.0.self_attn.attn"})()
    kv_cache = torch.zeros(2, 4, 16, 2, 8)
    calls = []

    def runnable(x):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of graph memory")
        slot = state.record_in_graph(None, layer, x, kv_cache, None)
        if slot is not None:
            state.record_graph_output(slot, x + 1)
        return x + 1

    wrapper = object.__new__(CUDAGraphWrapper)
    wrapper.runnable, wrapper.runtime_mode, wrapper.concrete_cudagraph_entries = runnable, CUDAGraphMode.FULL, {}
    wrapper.cudagraph_options, wrapper.graph_pool, wrapper.is_debugging_mode = CUDAGraphOptions(), None, False
    wrapper.vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    batch = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    with set_forward_context(None, wrapper.vllm_config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                             batch_descriptor=batch):
        wrapper(torch.ones(4, 2, 8))
        copying = _Graph.made[0]
        assert wrapper.concrete_cudagraph_entries[batch].cudagraph is copying and not state._graph_variants
        wrapper(torch.ones(4, 2, 8))
    assert copying.replays == 1 and state.plain_replays == 0
    assert "a second time, without kvdbg's copies, failed (RuntimeError: out of graph memory)" in caplog.text
