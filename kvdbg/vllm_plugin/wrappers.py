"""The patches the plugin puts on vLLM's classes: each wraps one method, times itself into the
capturer's engine time, and calls the plugin state's hook; a hook that fails never fails the engine."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from kvdbg.vllm_plugin.graph_hooks import GraphSlot
from kvdbg.vllm_plugin.vllm_facts import _clock

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    from kvdbg.vllm_plugin.state import _PluginState

logger = logging.getLogger("kvdbg.capture")


# The hooks time themselves (wall time: what the engine waited, the interpreter lock included) into the
# capturer's EngineTime, which the exit line reports: the calls that copied for a step apart from the others.


def _wrap_forward(state: _PluginState, original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if state._graph_job is not None:  # a graph step's capture still owes copies of what this may overwrite
            state.await_graph_capture()
        start = _clock()
        output = kwargs.get("output", args[0] if args else None)
        pending = state.before_forward(self, layer, query, key, value, kv_cache, attn_metadata, output)
        spent = _clock() - start
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        account = state.capturer.engine_time
        if type(pending) is GraphSlot:  # a graph is recorded (start-up): no step of its own
            state.after_forward(pending, output, result)
        elif pending is not None:
            start = _clock()
            state.after_forward(pending, output, result)
            account.captured_ns += spent + _clock() - start
            account.steps += 1
        else:
            account.other_ns += spent
            account.other_calls += 1
        if state.sentinel is not None:
            state.sentinel.after_forward(state, self, layer, query, key, value, kv_cache, attn_metadata,
                                         output if output is not None else result)
        return result

    forward._kvdbg_original = original
    return forward


def _account(state: _PluginState, copied: bool, ns: int) -> None:
    account = state.capturer.engine_time
    if copied:
        account.captured_ns += ns
    else:
        account.other_ns += ns
        account.other_calls += 1


def _wrap_layer_init(state: _PluginState, original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        state.after_layer_init(self)

    __init__._kvdbg_original = original
    return __init__


def _wrap_cache_update(state: _PluginState, original):
    @functools.wraps(original)
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        if state._graph_job is not None:
            state.await_graph_capture()
        start = _clock()
        copied = state.before_cache_update(self, layer, key, value, kv_cache, slot_mapping)
        _account(state, copied, _clock() - start)
        if state.sentinel is not None:
            state.sentinel.before_cache_update(state, self, layer, key, value, kv_cache, slot_mapping)
        return original(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    do_kv_cache_update._kvdbg_original = original
    return do_kv_cache_update


def _wrap_shutdown(state: _PluginState, original):
    @functools.wraps(original)
    def shutdown(self, *args, **kwargs):
        state.before_shutdown()
        return original(self, *args, **kwargs)

    shutdown._kvdbg_original = original
    return shutdown


def _wrap_execute_model(state: _PluginState, original):
    """The worker's step: before anything of it reaches the device. vLLM's model runner writes cache pages before
    any build of the step (it zeroes newly allocated blocks for hybrid and mixed-precision caches, copies blocks
    for a prefix hit on a part of a block, a KV connector loads or saves blocks), and a freed block that a handed
    graph step read may be one of them."""

    @functools.wraps(original)
    def execute_model(self, *args, **kwargs):
        if state._graph_job is not None:
            state.await_graph_capture()
        if state._worker is not self:  # a quiet run lends it vLLM's own method (graph_hooks._lend_builders)
            state._worker = self
        return original(self, *args, **kwargs)

    execute_model._kvdbg_original = original
    return execute_model


def _wrap_build(state: _PluginState, original):
    @functools.wraps(original)
    def build(self, *args, **kwargs):
        if state._graph_job is not None:
            state.await_graph_capture()
        metadata = original(self, *args, **kwargs)
        start = _clock()
        common = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
        copied = state.after_build(self, common, metadata)
        _account(state, copied, _clock() - start)
        return metadata

    build._kvdbg_original = original
    return build


def _forward_state():
    """What a model's forward moves on in vLLM's forward context (the MoE layers' running index, where vLLM keeps
    one), as a function that puts it back: a graph recorded twice runs its forward twice in one context."""
    try:
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
    except Exception:  # noqa: BLE001 - no context: nothing to put back
        return None
    if not hasattr(context, "moe_layer_index"):
        return None
    index = context.moe_layer_index
    return lambda: setattr(context, "moe_layer_index", index)


def _wrap_clear_graphs(state: _PluginState, original):
    """vLLM's CUDAGraphWrapper.clear_graphs: kvdbg's variants of the graphs go with vLLM's (graph_hooks)."""

    @functools.wraps(original)
    def clear_graphs(self, *args, **kwargs):
        state.forget_graphs(self)
        return original(self, *args, **kwargs)

    clear_graphs._kvdbg_original = original
    return clear_graphs


def _wrap_graph_call(state: _PluginState, original):
    """vLLM's CUDAGraphWrapper.__call__: once per step and graph, not per layer (graph_hooks says why)."""

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        start = _clock()
        if state._pending_build is not None:  # a build kept on its shape's ticket: its graph told with no choice
            # (no quiet run goes on past such a build: quiet_replay would refuse it)
            fast = state.ticket_replay(self)
            if fast is not None:
                spent = _clock() - start
                result = original(self, *args, **kwargs)
                start = _clock()
                copied = state.ticket_replayed(fast)
                _account(state, copied, spent + _clock() - start)
                return result
        else:
            run = state.quiet_replay(self)
            if run is not None:  # a step told unwanted ahead: the plain graph installed, the forwards counted after
                spent = _clock() - start
                result = original(self, *args, **kwargs)
                start = _clock()
                state.quiet_replayed(run)
                _account(state, False, spent + _clock() - start)
                return result
        what = state.graph_call(self)
        if what is None:
            return original(self, *args, **kwargs)
        kind, batch = what
        if kind in ("record", "record_pieces"):
            state.before_graph_recording()  # the sentinel's worker idle first (graph_hooks says why)
        if kind == "record_pieces":  # attention stays in Python; the writers still keep off the device
            with state.held_writers():
                return original(self, *args, **kwargs)
        if kind == "record":
            forward_state = _forward_state()
            state.begin_graph_recording(batch)
            try:
                with state.held_writers():
                    result = original(self, *args, **kwargs)
            finally:
                state.end_graph_recording()
            # Once more without kvdbg's copies: the graph the steps nothing wants replay (graph_hooks).
            state.record_plain_graph(self, batch, lambda: original(self, *args, **kwargs), forward_state)
            # And once with kvdbg's staging after the forward: the graph a wanted step replays (graph_hooks).
            state.record_staged_graph(self, batch, lambda: original(self, *args, **kwargs), forward_state)
            return result
        state.choose_graph(self, batch)
        state.before_graph_replay()
        result = original(self, *args, **kwargs)
        start = _clock()
        copied = state.after_graph_replay(batch)
        _account(state, copied, _clock() - start)
        return result

    __call__._kvdbg_original = original
    return __call__
