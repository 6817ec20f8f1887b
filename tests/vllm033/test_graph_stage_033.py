"""tests/gpu/graph_stage.py against vLLM 0.33's own classes: every name, attribute and signature the GPU stage uses.

The stage runs once on a GPU; what can be checked here is that its probes wrap what vLLM 0.33 defines, with the
signatures it calls them with, that the engine arguments are vLLM's, that vLLM's FULL mode pads the stage's batches
to the graphs the stage expects, and that the probes read vLLM's forward context as vLLM sets it.
"""

from __future__ import annotations

import dataclasses
import inspect
import types

import pytest
import torch

from tests.gpu import graph_plan, graph_stage


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_wrapped_methods_have_the_signatures_the_probes_call():
    from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionImpl, TritonAttentionMetadata, TritonAttentionMetadataBuilder)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert _params(TritonAttentionImpl.forward)[:8] == ["self", "layer", "query", "key", "value", "kv_cache",
                                                        "attn_metadata", "output"]
    assert _params(TritonAttentionMetadataBuilder.build_for_cudagraph_capture) == ["self", "common_attn_metadata"]
    assert "seq_lens" in {f.name for f in dataclasses.fields(TritonAttentionMetadata)}
    assert _params(GPUModelRunner.execute_model)[:2] == ["self", "scheduler_output"]
    assert callable(CUDAGraphWrapper.__call__)
    source = inspect.getsource(CUDAGraphWrapper.__init__)
    assert "self.runtime_mode" in source and "self.concrete_cudagraph_entries" in source
    assert "cudagraph" in {f.name for f in dataclasses.fields(CUDAGraphEntry)}
    # The fault's private buffer replaces what the capture build returns: vLLM's own build sets it to 1 first.
    assert "seq_lens.fill_(1)" in inspect.getsource(TritonAttentionMetadataBuilder.build_for_cudagraph_capture)


def test_triton_attn_takes_full_graphs_and_an_fp8_cache():
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionMetadataBuilder

    assert TritonAttentionMetadataBuilder._cudagraph_support == AttentionCGSupport.ALWAYS
    assert "fp8" in TritonAttentionBackend.supported_kv_cache_dtypes
    # FULL: one set of graphs for decode and mixed batches alike (no separate decode routine).
    full = CUDAGraphMode[graph_stage.GRAPH_MODE]
    assert full.decode_mode() == CUDAGraphMode.FULL and full.mixed_mode() == CUDAGraphMode.FULL
    assert not full.separate_routine() and not full.requires_piecewise_compilation()
    for mode in graph_stage.PIECEWISE_MODES:
        assert CUDAGraphMode[mode].requires_piecewise_compilation()


def test_the_engine_arguments_are_vllms():
    from vllm.config import CompilationConfig
    from vllm.config.kernel import KernelConfig
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    compilation_fields = {f.name for f in dataclasses.fields(CompilationConfig)}
    for spec in graph_stage.all_specs().values():
        kwargs = graph_stage.engine_kwargs(spec, "/model", cpu=False)
        assert set(kwargs) <= fields, set(kwargs) - fields
        assert set(kwargs["compilation_config"]) <= compilation_fields
        CompilationConfig(**kwargs["compilation_config"])  # vLLM's own validation of the values
    KernelConfig(ir_op_priority=graph_stage.engine_kwargs(graph_stage.all_specs()["plain-graph"], "/m",
                                                          cpu=False)["kernel_config"]["ir_op_priority"])


def test_the_engine_api_the_stage_drives():
    from vllm import LLM, SamplingParams
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_input_batch import InputBatch

    assert "self.llm_engine" in inspect.getsource(LLM.__init__)
    assert "self.vllm_config" in inspect.getsource(LLMEngine.__init__)
    assert _params(LLMEngine.add_request)[:4] == ["self", "request_id", "prompt", "params"]
    assert callable(LLMEngine.step) and callable(LLMEngine.has_unfinished_requests)
    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert {"request_id", "finished", "outputs"} <= set(inspect.signature(RequestOutput.__init__).parameters)
    assert "token_ids" in {f.name for f in dataclasses.fields(CompletionOutput)}
    scheduler = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens"} <= scheduler
    assert {"req_id", "num_computed_tokens"} <= {f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_ids", "num_computed_tokens"} <= {f.name for f in dataclasses.fields(CachedRequestData)}
    assert isinstance(InputBatch.req_ids, property) and isinstance(InputBatch.num_reqs, property)


def _dispatcher():
    from vllm.config import CompilationConfig, CUDAGraphMode, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    config = VllmConfig(device_config=DeviceConfig(device="cpu"), scheduler_config=SchedulerConfig.default_factory(
        max_num_seqs=graph_plan.MAX_NUM_SEQS, max_num_batched_tokens=graph_plan.MAX_NUM_BATCHED_TOKENS,
        max_model_len=128))
    # On this CPU machine vLLM turns graphs off while it builds the config; the dispatcher is set up as on a GPU.
    config.compilation_config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL, mode=0,
                                                  cudagraph_capture_sizes=list(graph_plan.CAPTURE_SIZES),
                                                  max_cudagraph_capture_size=max(graph_plan.CAPTURE_SIZES))
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL)
    return dispatcher


def test_vllm_pads_the_stages_batches_to_the_graphs_the_stage_expects():
    """The plan's batches, as vLLM 0.33's dispatcher keys them under FULL: the graph of graph_plan.padded()."""
    from vllm.config import CUDAGraphMode

    dispatcher = _dispatcher()
    for plan in (graph_plan.COMPARE_PLAN, graph_plan.FAULT_PLAN):
        for shape in graph_plan.simulate(plan):
            uniform = shape.kind == "decode"
            mode, batch = dispatcher.dispatch(shape.num_tokens, uniform_decode=uniform)
            assert mode == CUDAGraphMode.FULL, shape
            assert batch.num_tokens == graph_plan.padded(shape.num_tokens)
            assert batch.num_reqs == min(batch.num_tokens, graph_plan.MAX_NUM_SEQS) >= len(shape.rows)
    # The faulty graph is the one of FAULT_GRAPH_SIZE tokens, whichever kind of batch: decode and mixed share it.
    assert dispatcher.dispatch(5, uniform_decode=True)[1] == dispatcher.dispatch(5, uniform_decode=False)[1]
    assert dispatcher.dispatch(graph_plan.MAX_NUM_BATCHED_TOKENS + 1)[0] == CUDAGraphMode.NONE


def _graph_wrapper(mode):
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    wrapper = object.__new__(CUDAGraphWrapper)  # its constructor asks the platform for a graph pool (CUDA)
    wrapper.runtime_mode, wrapper.concrete_cudagraph_entries = mode, {}
    return wrapper


def test_the_probe_tells_recording_and_replays_apart_from_vllms_forward_context():
    from vllm.compilation.cuda_graph import CUDAGraphEntry
    from vllm.config import CUDAGraphMode, DeviceConfig, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    full, piecewise = _graph_wrapper(CUDAGraphMode.FULL), _graph_wrapper(CUDAGraphMode.PIECEWISE)
    batch = BatchDescriptor(num_tokens=8, num_reqs=8, uniform=False)
    assert graph_stage.graph_kind(full) == (None, None)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=batch):
        assert graph_stage.graph_kind(full) == ("record", batch)
        assert graph_stage.graph_kind(piecewise) == (None, None)
        full.concrete_cudagraph_entries[batch] = CUDAGraphEntry(batch_descriptor=batch, cudagraph=object())
        assert graph_stage.graph_kind(full) == ("replay", batch)
    with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=batch):
        piecewise.concrete_cudagraph_entries[batch] = CUDAGraphEntry(batch_descriptor=batch, cudagraph=object())
        assert graph_stage.graph_kind(piecewise) == ("pieces", batch)


@pytest.fixture
def restored():
    """vLLM's classes as they were after the test (the probes patch them for good in an engine's process)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    saved = [(cls, name, cls.__dict__[name]) for cls, name in (
        (TritonAttentionImpl, "forward"), (CUDAGraphWrapper, "__call__"), (GPUModelRunner, "execute_model"),
        (TritonAttentionMetadataBuilder, "build_for_cudagraph_capture"))]
    yield
    for cls, name, value in saved:
        setattr(cls, name, value)


def test_the_probes_count_a_served_step_from_what_vllm_hands_its_runner(restored):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    plan = graph_plan.COMPARE_PLAN
    probes = graph_stage.Probes(plan, ["model.layers.0.self_attn.attn"])
    calls = []

    def runs_a_forward(runner, scheduler_output, intermediate_tensors=None):
        TritonAttentionImpl.forward(None, None, None, None, None, None, "metadata", None)
        return "output"

    GPUModelRunner.execute_model = runs_a_forward
    TritonAttentionImpl.forward = lambda *args, **kwargs: calls.append(args)
    probes.install(TritonAttentionImpl)
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["B-1a2b3c4d", "A-5e6f7a8b", None],
                                                                     num_reqs=2))
    scheduled = types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id="B-1a2b3c4d", num_computed_tokens=0)],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=["A-5e6f7a8b"], num_computed_tokens=[30]),
        num_scheduled_tokens={"A-5e6f7a8b": 1, "B-1a2b3c4d": 3})
    assert GPUModelRunner.execute_model(runner, scheduled) == "output"  # start-up: not a served step
    assert probes.steps == [] and probes.outside["forward"] == 1
    probes.serving = True
    assert GPUModelRunner.execute_model(runner, scheduled) == "output"
    (step,) = probes.steps
    assert step["rows"] == [["B", 3, 3, False], ["A", 1, 31, True]] and step["forward_calls"] == 1
    assert step["graphs"] == [] and len(calls) == 2


def test_the_fault_gives_only_the_recording_of_its_graph_a_private_seq_lens(restored):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder

    def vllms_capture_build(builder, common_attn_metadata):  # as vLLM's: the runner's buffer, set to 1
        return types.SimpleNamespace(seq_lens=common_attn_metadata.seq_lens.fill_(1))

    TritonAttentionMetadataBuilder.build_for_cudagraph_capture = vllms_capture_build
    probes = graph_stage.Probes(graph_plan.FAULT_PLAN, ["l0"], fault_size=graph_plan.FAULT_GRAPH_SIZE)
    probes.install(TritonAttentionImpl)
    build = TritonAttentionMetadataBuilder.build_for_cudagraph_capture
    for tokens in (16, 8, 4):
        runners = torch.full((min(tokens, 8),), 7, dtype=torch.int32)
        common = types.SimpleNamespace(num_actual_tokens=tokens, num_reqs=min(tokens, 8), seq_lens=runners)
        metadata = build(None, common)
        assert (metadata.seq_lens is runners) == (tokens != graph_plan.FAULT_GRAPH_SIZE)
        runners.fill_(30)  # the runner refreshes its buffer for a real step; the private one stays as recorded
        if tokens == graph_plan.FAULT_GRAPH_SIZE:
            assert metadata.seq_lens.tolist() == [1] * 8
    assert probes.fault == [{"num_tokens": 8, "num_reqs": 8, "stale_seq_lens": [1] * 8}]
