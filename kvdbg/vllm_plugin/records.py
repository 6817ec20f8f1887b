"""The records the plugin's hooks hand each other: what a builder and an impl declared, and the engine-level
metadata of one build (host copies for capture, device clones for the sentinel)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdbg.vllm_plugin.vllm_facts import _step_refusal

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    import torch



logger = logging.getLogger("kvdbg.capture")


@dataclass
class _ImplInfo:
    backend_name: str
    update_in_forward: bool  # the backend writes the step's K/V inside forward (older vLLM backends)
    update_source: str


@dataclass(frozen=True)
class _BuilderFacts:
    """What one metadata builder's configuration says about every batch it builds (read once per builder)."""

    max_model_len: int | None
    max_decode_query_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    spec_block_size: int | None
    builder: str


def _builder_facts(builder: Any) -> _BuilderFacts:
    vllm_config = getattr(builder, "vllm_config", None)
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    return _BuilderFacts(
        max_model_len=getattr(getattr(vllm_config, "model_config", None), "max_model_len", None),
        max_decode_query_len=getattr(builder, "query_len", None),
        max_num_seqs=getattr(scheduler_config, "max_num_seqs", None),
        max_num_batched_tokens=getattr(scheduler_config, "max_num_batched_tokens", None),
        spec_block_size=getattr(getattr(builder, "kv_cache_spec", None), "block_size", None),
        builder=type(builder).__name__,
    )


@dataclass(slots=True)
class _HostMetadata:
    """Host copies of a device build's metadata, issued on the engine's stream when the builder built.

    Capture reads these, after ``ready``, instead of the device tensors: a read of those in a layer's hook
    would wait for every kernel the engine queued before it, where the build's copies are usually done.
    """

    block_table: "torch.Tensor"
    seq_lens: "torch.Tensor"
    query_start_loc: "torch.Tensor"
    slot_mapping: "torch.Tensor | None"  # the step's tokens; only for a backend that updates inside forward
    causal: Any
    ready: Any  # HostCopiesReady


@dataclass(slots=True)
class _EngineContext:
    """The engine-level metadata of one build, copied before the builder restricts anything.

    Made on every build of a captured step, so its constant part is the builder's :class:`_BuilderFacts`.
    On a device, ``host`` holds host copies for capture; the tensors here are device clones when the
    sentinel may check the step (its checks run on the device), else the host copies again. A ``deferred``
    context (a build a full graph will likely replay) holds the runner's own buffers, padding rows included,
    until :meth:`BuilderHooks.resolve` copies them or the staging program does.
    """

    owner_id: int
    block_table: "torch.Tensor"
    seq_lens: "torch.Tensor"
    query_start_loc: "torch.Tensor"
    slot_mapping: "torch.Tensor | None"
    causal: Any
    facts: _BuilderFacts
    refused: str | None = None  # why this batch's mask cannot be stored (a feature of the step, not the layer)
    host: _HostMetadata | None = None
    stage: Any = None  # graph_staging.StageHint: what staging a replayed graph's step needs from this build
    # A build that a full CUDA graph will likely replay: nothing copied yet, the tensors above are the runner's
    # (see BuilderHooks.after_build). Whoever reads the step first resolves it: the staging program copies the
    # metadata as the graph read it; an eager forward or cache update copies it then (BuilderHooks.resolve).
    deferred: "_Deferred | None" = None

    @property
    def builder(self) -> str:
        return self.facts.builder

    @property
    def max_model_len(self) -> int | None:
        return self.facts.max_model_len


@dataclass(slots=True)  # never changed once made; not frozen: a frozen dataclass is slower to make, on every build
class _Deferred:
    """What a deferred build's copies need: the builder, the runner's buffers as the build was given them (block
    table, lengths, query offsets, padding rows included), its slot mapping (copied whole for the cache update's
    hook, as at any build) and its staging hint, which tells its real requests (the rows copied)."""

    builder: Any
    rows: tuple
    slot_mapping: Any
    hint: Any  # graph_staging.StageHint


@dataclass(frozen=True)
class _Declared:
    """What the engine declared, through one metadata builder, about the caches of that builder's layers."""

    spec: Any  # builder.kv_cache_spec
    layout: Any  # the resolved KVCacheLayout member, or None
    missing: str | None  # why the layout is unknown, when it is
    decode_context_parallel_size: int
    builder: str


def deferred_context(builder: Any, common: Any, metadata: Any, facts: _BuilderFacts, buffers: tuple,
                     hint: Any) -> _EngineContext:
    """The context of a build a full CUDA graph will likely replay: the runner's own ``buffers`` (block table, lengths,
    query offsets, as the build was given them), nothing copied (see :class:`_Deferred`); ``hint``: its staging hint.
    Made by the build on the engine's thread, or, for a step handed on its shape's ticket, by the graph capture
    thread (``graph_hooks.GraphHooks._ticket_job``)."""
    ctx = _EngineContext(id(metadata), *buffers, None, common.causal, facts, _step_refusal(common),
                         deferred=_Deferred(builder, buffers, common.slot_mapping, hint))
    ctx.stage = hint
    return ctx
