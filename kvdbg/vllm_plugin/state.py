"""The plugin's state in one process: the classes it patched, the layers and builders it saw, the CUDA
graph notes it gave. Its hooks are mixed in by role from ``layers``, ``builder_hooks`` and
``step_hooks``; the patches themselves are in ``wrappers``."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvdbg.vllm_plugin.builder_hooks import BuilderHooks
from kvdbg.vllm_plugin.graph_hooks import GRAPH_WRAPPER, GraphHooks
from kvdbg.vllm_plugin.layers import LayerHooks
from kvdbg.vllm_plugin.step_hooks import StepHooks
from kvdbg.vllm_plugin.records import _BuilderFacts, _Declared, _EngineContext, _ImplInfo
from kvdbg.vllm_plugin.vllm_facts import (
    ATTENTION_LAYER_CLASSES, CUDAGRAPH_ADVICE, WORKER_MODULE, _is_mla, _max_graph_size, _resolve_backend,
    cudagraph_note
)
from kvdbg.vllm_plugin.wrappers import (
    _wrap_build, _wrap_cache_update, _wrap_clear_graphs, _wrap_execute_model, _wrap_forward, _wrap_graph_call,
    _wrap_layer_init, _wrap_shutdown
)

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    import torch

    from kvdbg.capture.capturer import CaptureLayer, Capturer, PreUpdate
    from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

logger = logging.getLogger("kvdbg.capture")


class _UncountedReplays:
    """``_PluginState._forward_counts`` while the instance lacks it: a quiet run's replays are uncounted
    (GraphHooks.quiet_replayed took the dict off), and this first read writes them in and puts the dict back.
    Python asks a class's attribute without ``__set__`` only after the instance's own, so reads of the dict on the
    instance pay nothing for it (a ``__getattr__`` would slow every attribute of the state)."""

    def __get__(self, state: Any, owner: Any = None) -> Any:
        if state is None:
            return self
        if state._counts_off is None:
            raise AttributeError("the plugin state's forward counts are missing")
        return state.count_quiet_replays()


class _PluginState(LayerHooks, BuilderHooks, StepHooks, GraphHooks):
    _forward_counts = _UncountedReplays()

    def __init__(self, capturer: "Capturer", requested: list[str] | None = None):
        self.capturer = capturer
        self.requested = list(requested or [])
        self.auto = not self.requested  # wrap the backend of each layer as it is built
        self.wrapped: list[str] = []
        self.missing: list[str] = []
        self.watching: list[str] = []  # layer classes whose constructor is wrapped
        self._backends_seen: set[str] = set()
        self._refusals_said: set[str] = set()
        self._patches: list[tuple[type, str, bool, Any]] = []
        self._impl_info: dict[type, _ImplInfo] = {}
        self._forward_counts: dict[str, int] = {}
        self._pre_updates: dict[str, "PreUpdate"] = {}
        # Per layer name: the inputs it was built from and the CaptureLayer, rebuilt only when they change
        # (vLLM may compute the FP8 scales in the first forward; a new cache layout or dtype is a new layer).
        self._layers: dict[str, tuple[tuple, "CaptureLayer"]] = {}
        self._side_table: OrderedDict[int, tuple[Any, _EngineContext]] = OrderedDict()
        # Host copies of device slot mappings made at build time, by the device tensor's address, each with the
        # tensor's whole identity (data_ptr, shape, stride, dtype, device) and what to wait for: do_kv_cache_update
        # gets the builder's tensor, not its metadata. A build lets go of the copy at its buffer's address with one
        # call (data_ptr): the identity is dearer (five calls, a device object), and builds are on every step.
        self._host_slots: OrderedDict[int, tuple[tuple, "torch.Tensor", Any]] = OrderedDict()
        # Per layer name: the identity of the slot mapping its builder's latest copying build was given, and
        # the layer's forward count then. A copy is taken only for that tensor, before that forward: a runner
        # may rewrite the same buffer without a build (a drafter's own slot mapping) or hand the update a
        # longer view of it (padding).
        self._slots_layers: dict[str, tuple[tuple, int]] = {}
        # Per layer name: what its builder declared, and the layout (or refusal) read from it.
        self._builders: dict[int, Any] = {}  # kept alive so that their ids stay theirs
        self._declared: dict[str, _Declared] = {}
        self._layouts: dict[str, tuple[tuple, Any]] = {}
        self._builder_layers: dict[int, tuple[Any, Any, list[str] | None]] = {}
        self._builder_facts: dict[int, _BuilderFacts] = {}  # per builder (kept alive in _builders)
        self._layout_fast: dict[str, tuple] = {}  # per layer: what engine_layout last checked, and its answer
        self._step_constants: dict[str, tuple] = {}  # per layer: (key, CaptureBackend, provenance) of step_capture
        self._update_in_forward = False  # whether any wrapped backend writes the new K/V inside forward
        self._checked: dict[str, tuple] = {}  # per layer: (layout, the cache tensor it was checked on, its data_ptr)
        self._records: dict[str, tuple[tuple, dict[str, Any]]] = {}  # per layer: its declaration's provenance
        self._graphs_said = False
        self._parallel: dict[str, Any] | None = None  # this process's place among the engine's ranks, read once
        self.sentinel: "SentinelHooks | None" = None  # the sampled check of the engine's own attention
        # Full CUDA graphs (graph_hooks): per graph (vLLM's batch descriptor), the slots of its attention layers
        # capture or the sentinel selects, in order; per layer, the buffers the graphs copy into; per
        # layer, the latest build's context and the step it was for; the graph being recorded; the largest graph
        # size the engine declares.
        self.graphs_watched = False
        self._graph_layers: dict[Any, list[Any]] = {}
        self._graph_names: dict[Any, tuple] = {}  # per graph: (its slots, how many, their names, distinct)
        self._graph_shapes: set[tuple] = set()  # (tokens, rows or None) of every full graph recorded
        self._graph_rows = 0  # the most rows of a recorded full graph's batch (its tokens where it names no rows)
        self._covers: dict[int, tuple[int, bool]] = {}  # per builder: whether its layers are all the graphs' (kvdbg's)
        self._graph_buffers: dict[str, Any] = {}
        self._graph_builds: dict[str, tuple[int, _EngineContext]] = {}
        self._recording: Any = None
        # Full graphs recorded twice (graph_hooks: with kvdbg's copies, and plain for the steps nothing wants):
        # (wrapper id, batch) -> (vLLM's entry, (graph, output) with the copies, (graph, output) without).
        self._graph_variants: dict[tuple, tuple] = {}
        self._recording_plain = False  # vLLM is recording a graph's plain variant: kvdbg records nothing into it
        self._plain_ran = False  # the graph just replayed was a plain variant: its copies' buffers are stale
        self.plain_replays = 0
        # A third variant of a full graph, with kvdbg's staging recorded in after the forward (graph_hooks):
        # (wrapper id, batch) -> ((graph, output), the graph_staging.InGraphProgram it runs); the programs by their
        # buffers; whether vLLM is recording such a variant (the layers' copies recorded again, no slot learnt);
        # the program the graph just replayed ran (None: another variant); the latest build of each builder, whose
        # buffers a staged variant reads.
        self._staged_variants: dict[tuple, tuple] = {}
        self._in_graph_programs: dict[tuple, Any] = {}
        self._recording_again = False
        self._again_failed: str | None = None  # why a layer's copies could not be recorded into a staged variant
        self._in_graph_ran: Any = None
        # A replay chosen with nothing wanted: (batch, layer names, their steps, capture's configuration, the counts'
        # epoch), for after_graph_replay; and whether the last _nothing_wanted's answer holds after the replay too.
        self._quiet: Any = None
        self._quiet_after = False
        # A wanted build's answer for the next choice of graph: (its layers, their step, its context, the counts'
        # epoch then, capture's configuration then); and the epoch, moved on whenever any layer's forward count does.
        self._prepared: Any = None
        # Per (builder, the build's padded tokens, its rows): a graph_hooks._Ticket once a wanted step of that shape was
        # staged inside vLLM's graph; a later wanted build of the shape is then kept as it was given
        # (_pending_build: the ticket, builder, common metadata, metadata, step, counts' epoch, capture's
        # configuration) until the choice of graph hands it to the capture thread or a hook reads it.
        self._tickets: dict[tuple, Any] = {}
        self._pending_build: Any = None
        # Replays of one graph told unwanted ahead (graph_hooks._QuietRun), and per builder whether the run's layers
        # hold all it would ask about: (the run's names, capture's configuration, whether they do).
        self._quiet_run: Any = None
        self._quiet_builders: dict[int, tuple] = {}
        # (builder, "build") lent vLLM's own method while a quiet run lasts (GraphHooks._lend_builders); the worker lent
        # its own execute_model (kept apart: it may stay lent past the run); the worker whose execute_model is patched
        # (its last caller).
        self._lent: list[tuple[Any, str]] = []
        self._worker_lent: Any = None
        self._lending = threading.Lock()
        self._worker: Any = None
        self._wrappers: set = set()  # the methods kvdbg put on vLLM's classes (only those are lent: _lend)
        if capturer is not None:  # new filters may want the next build: what a quiet run lent goes back at once
            capturer.on_reconfigure.append(self._take_builders_back)
        # The quiet run whose replays are not yet written into _forward_counts, and that dict, off the instance
        # meanwhile: GraphHooks.quiet_replayed leaves the counts to their first read (_UncountedReplays).
        self._uncounted: Any = None
        self._counts_off: dict[str, int] | None = None
        self._staged_skip_said = False  # said once: no staged variant, the sentinel checking layers capture leaves out
        self._counts_epoch = 0
        self._covered: dict[Any, tuple] = {}  # per graph: whether a builder's layers hold all the graph's
        self._last_builds: dict[int, tuple] = {}
        self.staged_replays = 0
        # Per graph: (its names, capture's configuration, whether capture's layer filter selects any of them,
        # whether the sentinel's does), so that a step nothing wants is told with one search (graph_hooks).
        self._graph_takers: dict[Any, tuple] = {}
        self._graph_every: dict[Any, tuple] = {}  # per graph: (its names, configuration, capture selects them all)
        self._graph_checked: dict[Any, tuple] = {}  # per graph: (its names, the sentinel checks them all)
        self._sentinel_layers: dict[int, tuple] = {}  # per builder: (its layer names, those the sentinel checks)
        self._max_graph_tokens: int | None = None
        self._forward_context = None
        self._mode_names: dict[Any, str] = {}  # vLLM's CUDA graph runtime modes by their names (graph_call)
        self._graph_thread = None  # the graph capture thread, started with the first wanted graph step
        self._graph_job = None  # the step last handed to it, until the engine's next work waits for its copies
        self._stager = None  # graph_staging.GraphStager, made with the first wanted graph step
        self._stage_layouts: dict = {}  # graph layers (slots) -> the stager's layers and page size (graph_hooks)

    # ---------------------------------------------------------------- patching

    def wrap_backend(self, name: str, *, backend_cls: type | None = None, layer_name: str | None = None) -> None:
        """Wrap the impl and builder of backend ``name`` (``backend_cls`` when the layer gave it; else looked up)."""
        try:
            if backend_cls is not None:
                impl_cls, builder_cls = backend_cls.get_impl_cls(), backend_cls.get_builder_cls()
                source = f"the backend of layer {layer_name}"
            else:
                impl_cls, builder_cls, backend_cls, source = _resolve_backend(name)
        except Exception as exc:
            if isinstance(exc, (ImportError, LookupError)):
                self.missing.append(name)
            logger.warning("kvdbg capture: backend %s not wrapped: %s", name, exc)
            return
        if _is_mla(backend_cls, impl_cls):
            logger.warning("kvdbg capture: backend %s not wrapped: it is an MLA backend, whose cache holds one "
                           "compressed latent vector per token instead of K and V; a snapshot cannot hold it", name)
            return
        if backend_cls is not None and hasattr(backend_cls, "forward_includes_kv_cache_update"):
            info = _ImplInfo(name, bool(backend_cls.forward_includes_kv_cache_update),
                             f"{backend_cls.__name__}.forward_includes_kv_cache_update")
        elif hasattr(impl_cls, "forward_includes_kv_cache_update"):
            info = _ImplInfo(name, bool(impl_cls.forward_includes_kv_cache_update),
                             f"{impl_cls.__name__}.forward_includes_kv_cache_update")
        else:
            info = _ImplInfo(name, False, "not declared; new K/V are taken only from do_kv_cache_update")
        self._impl_info[impl_cls] = info
        self._update_in_forward = any(i.update_in_forward for i in self._impl_info.values())
        self._patch(impl_cls, "forward", _wrap_forward)
        if hasattr(impl_cls, "do_kv_cache_update"):
            self._patch(impl_cls, "do_kv_cache_update", _wrap_cache_update)
        self._patch(builder_cls, "build", _wrap_build)
        self.wrapped.append(name)
        if self.auto:
            logger.info("kvdbg capture: wrapping %s (%s, %s), %s", name, impl_cls.__name__, builder_cls.__name__,
                        source)
        else:
            logger.debug("kvdbg capture: wrapped %s (%s, %s) found via %s", name, impl_cls.__name__,
                         builder_cls.__name__, source)

    def _patch(self, cls: type, attr: str, make_wrapper) -> None:
        current = getattr(cls, attr)
        if getattr(current, "_kvdbg_original", None) is not None:
            return  # two names resolving to one class: wrap it once
        had_own = attr in cls.__dict__
        original = cls.__dict__[attr] if had_own else current
        wrapper = make_wrapper(self, current)
        setattr(cls, attr, wrapper)
        self._patches.append((cls, attr, had_own, original))
        self._wrappers.add(wrapper)

    def watch_layers(self) -> None:
        """Wrap the attention layers' constructors: each new layer's backend is wrapped (auto) or named."""
        found: set[str] = set()
        for module_name, class_name in ATTENTION_LAYER_CLASSES:
            if class_name in found:
                continue
            try:
                layer_cls = getattr(importlib.import_module(module_name), class_name)
            except Exception:  # another vLLM version keeps it elsewhere, or has none
                continue
            found.add(class_name)
            self._patch(layer_cls, "__init__", _wrap_layer_init)
            self.watching.append(f"{module_name}.{class_name}")
        if not self.watching:
            logger.debug("kvdbg capture: no attention layer class found in %s; the backend in use is not reported",
                         ", ".join(m for m, _ in ATTENTION_LAYER_CLASSES))

    def watch_shutdown(self) -> None:
        """Wrap the worker's shutdown: the writer drains there and says its one line, before vLLM kills the process."""
        try:
            wrapper_cls = importlib.import_module(WORKER_MODULE).WorkerWrapperBase
        except Exception:  # another vLLM version: the exit handler still drains, if the process exits normally
            logger.debug("kvdbg capture: no %s.WorkerWrapperBase; capture drains at interpreter exit only",
                         WORKER_MODULE)
            return
        self._patch(wrapper_cls, "shutdown", _wrap_shutdown)
        if hasattr(wrapper_cls, "execute_model"):  # the barrier before a step's first device work (graph_hooks)
            self._patch(wrapper_cls, "execute_model", _wrap_execute_model)

    def watch_graphs(self) -> None:
        """Wrap vLLM's CUDA-graph wrapper: steps replayed from full graphs are captured (graph_hooks)."""
        module_name, class_name = GRAPH_WRAPPER
        try:
            wrapper_cls = getattr(importlib.import_module(module_name), class_name)
        except Exception:  # another vLLM version: full graphs hide their steps, as the note then says
            logger.debug("kvdbg capture: no %s.%s; steps replayed from full CUDA graphs are not captured",
                         module_name, class_name)
            return
        self._patch(wrapper_cls, "__call__", _wrap_graph_call)
        if hasattr(wrapper_cls, "clear_graphs"):
            self._patch(wrapper_cls, "clear_graphs", _wrap_clear_graphs)
        self.graphs_watched = True

    def held_writers(self):
        """The writers (capture's, the sentinel's) do no device work while a CUDA graph is recorded."""
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(self.capturer.held_writer())
        if self.sentinel is not None:
            stack.enter_context(self.sentinel.capturer.held_writer())
        return stack

    def before_shutdown(self) -> None:
        try:
            # vLLM sends SIGTERM to workers still running after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (default 5):
            # drain within that, leaving a second for the rest of the shutdown.
            grace = os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5").strip()
            limit = float(grace) - 1 if grace.replace(".", "", 1).isdigit() else 4.0
            from kvdbg.capture.capturer import EXIT_FLUSH_SECONDS

            total = max(1.0, min(EXIT_FLUSH_SECONDS, limit))
            deadline = time.monotonic() + total
            self.stop_graph_capture(total / 4)  # the last graph step's copies issued, before the writers drain
            if self.sentinel is not None:  # half the time for its checks and its writer, the rest for capture's
                self.sentinel.close(self, total / 2)
            self.capturer.close(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # shutting down must go on whatever happens here
            logger.debug("kvdbg capture: draining at shutdown failed: %s", exc)

    def after_layer_init(self, layer: Any) -> None:
        try:
            backend = getattr(layer, "attn_backend", None)
            name = backend.get_name() if backend is not None and hasattr(backend, "get_name") else None
            if name is None or name in self._backends_seen:
                return
            self._backends_seen.add(name)
            layer_name = getattr(layer, "layer_name", "?")
            if name in self.wrapped:
                logger.debug("kvdbg capture: layer %s uses %s, which is wrapped", layer_name, name)
                return
            if self.auto:
                self.wrap_backend(name, backend_cls=backend, layer_name=layer_name)
                return
            from kvdbg.capture.config import ENV_BACKENDS

            if _is_mla(backend, None):
                logger.warning("kvdbg capture: this engine's attention backend %s (layer %s) is an MLA backend, "
                               "whose cache holds one compressed latent vector per token instead of K and V; "
                               "nothing is captured from it", name, layer_name)
            else:
                logger.warning("kvdbg capture: this engine's attention backend is %s, which is not wrapped "
                               "(%s=%s); nothing is captured from it. Set %s=%s, or unset it to wrap every "
                               "layer's backend", name, ENV_BACKENDS, ",".join(self.requested), ENV_BACKENDS, name)
        except Exception as exc:  # reporting must never stop a model from loading
            logger.debug("kvdbg capture: could not tell the backend of a layer: %s", exc)

    def note_cudagraphs(self, vllm_config: Any) -> None:
        """Say once per process when full CUDA graphs hide steps from Python, which ones, and what to do."""
        if vllm_config is None:
            return
        try:
            compilation = getattr(vllm_config, "compilation_config", None)
            if self._max_graph_tokens is None:
                self._max_graph_tokens = _max_graph_size(compilation)
            if self._graphs_said:
                return
            mode = getattr(compilation, "cudagraph_mode", None)
            if mode is None:
                return
            if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
                return
            for level, line in cudagraph_note(mode, self._max_graph_tokens, recorded=self.graphs_watched):
                self._graphs_said = True
                logger.log(level, "kvdbg capture: %s", line)
        except Exception as exc:  # telling must never cost the engine
            logger.debug("kvdbg capture: could not read the CUDA graph mode: %s", exc)

    def note_graph_recording(self, layer_name: str | None) -> None:
        if self._graphs_said:
            return
        self._graphs_said = True
        logger.warning("kvdbg capture: a CUDA graph is being recorded through layer %s: the steps replayed from it "
                       "run without Python, so kvdbg cannot see or capture them; to capture them, %s", layer_name,
                       CUDAGRAPH_ADVICE)

    def restore(self) -> None:
        self.install_plain_graphs()  # vLLM's replays then write no buffer of kvdbg's
        for cls, attr, had_own, original in reversed(self._patches):
            if had_own:
                setattr(cls, attr, original)
            else:
                delattr(cls, attr)
        self._patches.clear()
        # Then what a quiet run lent (none is lent again: the classes' methods are no longer kvdbg's patches).
        self._wrappers.clear()
        self._take_builders_back()
        self._worker = None
        hooks = getattr(self.capturer, "on_reconfigure", None)
        if hooks is not None and self._take_builders_back in hooks:
            hooks.remove(self._take_builders_back)
