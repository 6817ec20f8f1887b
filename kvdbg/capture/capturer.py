"""Capture one attention layer's decode step from a live engine into a snapshot, never raising into the engine.

The engine describes each layer once (:class:`CaptureLayer`) and its backend
settings (:class:`CaptureBackend`), then per step calls
``Capturer.begin(layer, backend, tensors, step=..., rank=...)`` just before the
attention backend's forward (the cache still holds the state the step starts
from), runs the forward, and calls :meth:`Capturer.finish` with the output
buffer. The engine's thread only copies (:mod:`kvdbg.capture.prepare`,
:mod:`kvdbg.capture.buffers`): the query, the new K/V with their slots, the
engine-level metadata and only the pages the step reads or writes. Metadata,
the reader's checks, the layout conversion and the write happen in a
background writer thread (or in the caller's, with ``queue_bytes=0``;
:mod:`kvdbg.capture.build`, :mod:`kvdbg.capture.writer`). Files
are written with :func:`kvdbg.snapshot.store.save_snapshot` (atomic, never
clobbering) under the budgets of a frozen :class:`CaptureConfig`.

:class:`Capturer` is the shell around that work: it holds the budgets, the
failure policy and the writer (the writing half, :class:`kvdbg.capture.writer.CaptureWriter`,
is its base class; this module holds the filters, the policy, the engine's calls
and the exit line). Any failure is logged once per kind on the
``kvdbg.capture.capturer`` logger; a failure that would recur on every step (an
unwritable directory, a bug) turns capture off. A requested step that is not
written is counted by reason, and :meth:`Capturer.close` (at engine shutdown,
or at exit) says so in one line. docs/capture.md describes the API, the vLLM
plugin and its variables.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import operator
import os
import queue
import threading
import weakref
from collections import Counter
from typing import Any, Callable, Mapping

import torch

from kvdbg.capture.buffers import HostBuffers
from kvdbg.capture.build import current_rank, package_version, snapshot_file_size
from kvdbg.capture.config import (ENV_MAX, ENV_MAX_BYTES, ENV_QUEUE_BYTES, CaptureConfig, LayerFilter,
                                  auto_queue_bytes)
from kvdbg.capture.inputs import (
    CaptureBackend,
    CaptureInputError,
    CaptureLayer,
    StepTensors,
    infer_kv_layout,
    resolve_kv_layout,
)
from kvdbg.capture.prepare import PendingCapture, PreUpdate, plan_capture, save_pre_update
from kvdbg.capture.temp_files import TEMP_PREFIX, stale_temp_files, temp_file_prefix
from kvdbg.capture.writer import CaptureWriter, _tell, _WriteFailed, writer_niceness
from kvdbg.errors import SnapshotError

logger = logging.getLogger("kvdbg.capture")

__all__ = [
    "CaptureBackend",
    "CaptureConfig",
    "CaptureInputError",
    "CaptureLayer",
    "Capturer",
    "EngineTime",
    "LayerFilter",
    "PendingCapture",
    "PreUpdate",
    "StepTensors",
    "TEMP_PREFIX",
    "capture_step",
    "infer_kv_layout",
    "package_version",
    "resolve_kv_layout",
    "snapshot_file_size",
    "stale_temp_files",
    "temp_file_prefix",
    "writer_niceness",
]

# How long close() waits for the writer at interpreter exit.
EXIT_FLUSH_SECONDS = 30.0

# A step without a number whose call before the cache update was counted as not written (its begin is not).
_BEFORE_UPDATE = object()

# Why a requested step was not written (the keys of Capturer.dropped), as the exit line says it.
DROP_REASONS = {
    "queue": "over the writer's memory budget",
    "max_bytes": f"over {ENV_MAX_BYTES}",
    "input": "not storable (see the warning)",
    "refused": "refused by a check (see the warning)",
    "write": "the write failed",
    "internal": "a kvdbg error",
    "off": "capture was off",
    "max_snapshots": f"past {ENV_MAX}",
    "exit": "still waiting at shutdown",
}


def _stream_capturing(t: Any) -> bool:
    # A CUDA graph being recorded forbids the host syncs a capture needs; the
    # step is replayed later without Python, so there is nothing to take anyway.
    return isinstance(t, torch.Tensor) and t.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass
class EngineTime:
    """What capture's hooks took from the engine's thread (wall time, as the engine felt it), kept by an
    engine plugin that times its hooks: the hook calls that copied for a step, and the others (filters
    that said no, step counting, metadata kept for the sentinel alone). ``steps``: the steps copied at
    their forward."""

    captured_ns: int = 0
    steps: int = 0
    other_ns: int = 0
    other_calls: int = 0
    # Steps replayed from full CUDA graphs are captured by the plugin's graph capture thread: the engine's thread
    # only hands each wanted step over, then, before the next step can overwrite what it copies, waits (mostly
    # not at all) until that thread has issued its copies.
    handed: int = 0
    waited_ns: int = 0
    waits: int = 0
    # Of the handed steps, those staged on the device first (kvdbg.vllm_plugin.graph_staging): the next step does
    # not wait for them.
    staged: int = 0
    # Of those, the steps staged by vLLM's own graph (its variant with kvdbg's staging recorded in): no torch call
    # on the engine's thread.
    in_graph: int = 0
    # Staging graphs recorded (once per size, on the engine's thread: the first wanted step of a size pays it).
    staging_graphs: int = 0
    staging_ms: float = 0.0

    def describe(self) -> str:
        """One clause for the exit line ('' when no hook was timed)."""
        if not self.steps and not self.other_calls and not self.handed:
            return ""
        parts = []
        if self.steps:
            parts.append(f"{_ms(self.captured_ns)} copying {self.steps} step(s) "
                         f"({self.captured_ns / self.steps / 1e3:,.0f} us each)")
        if self.other_calls:
            parts.append(f"{_ms(self.other_ns)} in {self.other_calls:,} other hook call(s) "
                         f"({self.other_ns / self.other_calls / 1e3:,.1f} us each)")
        if self.handed:
            staged = f" ({self.staged} staged on the device first" if self.staged else ""
            if self.staged:
                staged += f", {self.in_graph} of them inside vLLM's graph)" if self.in_graph else ")"
            if self.staging_graphs:
                staged += (f", {self.staging_graphs} staging graph(s) recorded in {self.staging_ms:,.1f} ms, once "
                           "per size")
            parts.append(f"{self.handed} graph step(s) handed to the capture thread{staged}, {_ms(self.waited_ns)} "
                         f"waiting for its copies before {self.waits} next step(s)")
        return "engine's thread: " + ", ".join(parts)


def _ms(ns: int) -> str:
    return f"{ns / 1e6:,.1f} ms"


class Capturer(CaptureWriter):
    """Capture into one directory under a :class:`CaptureConfig`: filters, budgets, failure policy, writer.

    ``Capturer(directory, **config_fields)`` or ``Capturer(config)``. Nothing
    here raises into the caller: failures are logged once per kind on the
    ``kvdbg.capture.capturer`` logger and counted in :attr:`failures`; requested steps
    that were not written are counted by reason in :attr:`dropped`.
    """

    def __init__(self, config: CaptureConfig | str | os.PathLike, **fields):
        if isinstance(config, CaptureConfig):
            self.config = dataclasses.replace(config, **fields) if fields else config
        else:
            self.config = CaptureConfig(directory=config, **fields)
        # Budget state: files written, their bytes, bytes reserved by writes under way, steps with the writer,
        # and of those the steps given up at close (counted as dropped; the writer releases them unwritten).
        self.written: list[str] = []
        self.bytes_written = 0
        self._bytes_reserved = 0
        self._in_flight = 0
        self._writing = 0
        self._given_up = 0
        self._held = 0  # > 0 while the engine records a CUDA graph: the writer starts no step (held_writer)
        self._queued_bytes = 0
        self._queue_budget: int | None = None
        self._queue_budget_why = ""
        # Failure state.
        self.failures: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.disabled_reason: str | None = None
        self._logged: set[str] = set()
        self._off_seen: dict[str, Any] = {}
        self._refused: dict[str, str] = {}  # layers whose written slots did not read back: why
        self._queue: queue.SimpleQueue | None = None
        self._writer: threading.Thread | None = None
        self._names = itertools.count()
        self._layer_cache: dict[str, bool] = {}
        self._cleaned: set[str] = set()
        # Guards the budgets and the counters shared with the writer; re-entrant because a budget check
        # that drops a step counts it while the lock is held.
        self._lock = threading.RLock()
        self._buffers = HostBuffers()
        self.engine_time = EngineTime()
        self._rank: tuple[int, str] | None = None
        self._closed = False
        # Called after each reconfigure (the vLLM plugin: builds it no longer hooks may be wanted under new filters).
        self.on_reconfigure: list[Callable[[], None]] = []
        _OPEN.add(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Capturer":
        """A capturer configured by the ``KVDBG_CAPTURE_*`` variables; OptionError naming a bad one."""
        return cls(CaptureConfig.from_env(environ), **overrides)

    def reconfigure(self, **changes) -> None:
        """Replace fields of the configuration from now on (a step already handed to the writer keeps its directory).

        A new ``queue_bytes`` applies from the next step; switching the writer
        off waits for nothing (steps already handed over are still written).
        """
        self.config = dataclasses.replace(self.config, **changes)
        self._layer_cache = {}
        if "queue_bytes" in changes or "max_bytes" in changes:
            self._queue_budget = None
        for hook in list(self.on_reconfigure):
            hook()

    def select_layers(self, layers) -> None:
        """Change which layers are captured from now on (a pattern as in ``KVDBG_CAPTURE_LAYERS``, or a callable)."""
        self.reconfigure(layers=layers)

    def describe(self) -> str:
        return self.config.describe()

    # ---------------------------------------------------------------- state

    @property
    def active(self) -> bool:
        return self.disabled_reason is None

    def disable(self, reason: str, *, level: int = logging.INFO) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.log(level, "kvdbg capture turned off: %s", reason)

    def rank(self, rank: int | None = None) -> int:
        if rank is not None:
            return rank
        if self.config.rank is not None:
            return self.config.rank
        return self._process_rank()[0]

    def _process_rank(self) -> tuple[int, str]:
        # Asked on every step, so read once: an engine initialises torch.distributed before its first
        # forward, and a process's rank does not change after.
        if self._rank is None:
            self._rank = current_rank()
        return self._rank

    def layer_selected(self, layer_name: str) -> bool:
        hit = self._layer_cache.get(layer_name)
        if hit is None:
            hit = self._layer_cache[layer_name] = bool(self.config.layers(layer_name))
        return hit

    def takes_no_step(self, lo: int, hi: int) -> bool:
        """Whether the step filter takes no step from ``lo`` to ``hi`` (both included): then no layer's step there
        is selected, wanted or counted, and a hook may skip its layers at once (a build, a graph's replay)."""
        steps = self.config.steps
        return steps is not None and not steps.meets(lo, hi)

    def selects(self, layer_name: str, step: int | None = None, rank: int | None = None) -> bool:
        """Whether the filters (layers, steps, ranks) take this step; budgets and state aside, nothing counted."""
        return self._filtered_in(layer_name, step, rank)

    def _filtered_in(self, layer_name: str, step: int | None, rank: int | None) -> bool:
        return self.layer_selected(layer_name) and self.selects_step(step, rank)

    def selects_step(self, step: int | None, rank: int | None = None) -> bool:
        """Whether the step and rank filters take ``step`` (for a layer the layer filter selects; nothing counted)."""
        config = self.config
        if config.steps is not None and step not in config.steps:
            return False
        return config.ranks is None or self.rank(rank) in config.ranks

    def wants_all(self, count: int, step: int) -> bool | None:
        """Whether ``count`` layers that the layer filter selects would each be captured now at ``step``, told at
        once (a replayed graph's layers, all at one step): True or False when it can tell without a call per layer
        (on, nothing refused, room for them all under the snapshot limit); None: ask :meth:`wants` layer by layer."""
        if not self.takes_all(count):
            return None
        return self.selects_step(step)

    def takes_all(self, count: int) -> bool:
        """Whether ``count`` layers' steps that the filters take would each be captured now: on, nothing refused,
        room for them all under the snapshot limit (:meth:`wants_all` for a step known to be taken)."""
        if self.disabled_reason is not None or self._refused:
            return False
        limit = self.config.max_snapshots
        return limit is None or len(self.written) + self._in_flight + count <= limit

    def wants(self, layer_name: str, step: int | None = None, rank: int | None = None) -> bool:
        """Whether a step of this layer would be captured now (filters and count budget).

        A step the filters select while capture is off is counted once in
        ``dropped["off"]``: it was asked for and will not be written.
        """
        return self._wants(layer_name, step, rank, before_update=False)

    def _wants(self, layer_name: str, step: int | None, rank: int | None, *, before_update: bool) -> bool:
        if not self._filtered_in(layer_name, step, rank):
            return False
        if self._refused and layer_name in self._refused:
            self._count_unserved(layer_name, step, "refused", before_update)
            return False
        config = self.config
        if self.active and config.max_snapshots is not None \
                and len(self.written) + self._in_flight >= config.max_snapshots:
            if self._in_flight:  # the steps with the writer take the last places
                self._count_unserved(layer_name, step, "max_snapshots", before_update)
                return False
            self.disable(f"wrote {len(self.written)} snapshots, the limit ({ENV_MAX}={config.max_snapshots})")
        if not self.active:
            self._count_unserved(layer_name, step, "off", before_update)
            return False
        return True

    def _count_unserved(self, layer_name: str, step: int | None, reason: str, before_update: bool = False) -> None:
        # Once per step, whichever of the engine's hooks asks first. A step without a number is told from the
        # next by the pair of calls one step makes: the one before the cache update, then begin's.
        seen = self._off_seen.get(layer_name, self)
        if step is None:
            self._off_seen[layer_name] = _BEFORE_UPDATE if before_update else self
            if seen is _BEFORE_UPDATE and not before_update:  # the same step's begin, after its pre-update
                return
            self._drop(reason)
        elif seen != step:
            self._off_seen[layer_name] = step
            self._drop(reason)

    def _drop(self, reason: str, count: int = 1) -> None:
        with self._lock:  # the engine's thread and the writer's both count
            self.dropped[reason] += count

    # ---------------------------------------------------------------- failure policy

    def report(self, exc: BaseException, where: str = "", *, step_lost: bool = False) -> None:
        """Log a failure once per kind; turn capture off when it would repeat every step.

        With ``step_lost`` the failure cost a requested step, counted in :attr:`dropped`.
        """
        if isinstance(exc, (CaptureInputError, SnapshotError)):
            kind, fatal = "input", False
        elif isinstance(exc, _WriteFailed):
            kind, fatal = "write", True
        else:
            kind, fatal = "internal", True
        key = f"{kind}:{type(exc).__name__}"
        self.failures[key] += 1
        if step_lost:
            self._drop(kind)
        prefix = f"{where}: " if where else ""
        if fatal:
            detail = f"{prefix}{exc}"
            if key not in self._logged:
                self._logged.add(key)
                # One record carries both the error and the decision, with the traceback for bugs.
                logger.error("kvdbg capture turned off: %s", detail, exc_info=kind == "internal")
                self.disabled_reason = self.disabled_reason or detail
            else:
                self.disable(detail, level=logging.DEBUG)
            return
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("kvdbg capture skipped %s%s (further errors of this kind are not logged)", prefix, exc)

    def _note_once(self, key: str, message: str) -> None:
        self.failures[key] += 1
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("%s (logged once; the count is in the exit line)", message)

    def _fits(self, size: int, layer_name: str, step: int | None, *, exact: bool) -> bool:
        max_bytes = self.config.max_bytes
        if max_bytes is None or self.bytes_written + self._bytes_reserved + size <= max_bytes:
            return True
        self._drop("max_bytes")
        self._note_once(
            "budget:bytes",
            f"kvdbg capture skipped layer {layer_name} step {step}: the snapshot "
            f"{'takes' if exact else 'would take at least'} {size} bytes, over the "
            f"{max_bytes - self.bytes_written - self._bytes_reserved} "
            f"bytes left of {ENV_MAX_BYTES}={max_bytes}; smaller steps may still be captured",
        )
        return False

    def queue_budget(self) -> int:
        """Bytes of snapshots the background writer may hold (``auto`` is resolved on first use)."""
        if self._queue_budget is None:
            configured = self.config.queue_bytes
            if configured == "auto":
                self._queue_budget, why = auto_queue_bytes(self.config.max_bytes)
                self._queue_budget_why = f"{ENV_QUEUE_BYTES}=auto: {why}"
            else:
                self._queue_budget, self._queue_budget_why = int(configured), f"{ENV_QUEUE_BYTES}={configured}"
        return self._queue_budget

    @property
    def host_buffers(self) -> HostBuffers:
        """The pool of host buffers this capturer's copies take (reused between steps)."""
        return self._buffers

    def queue_would_take(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would fit the background writer's queue now (nothing counted or said: the
        capture of each layer still asks on its own)."""
        return not self.config.background or self._queued_bytes + nbytes <= self.queue_budget()

    def _queue_has_room(self, nbytes: int, where: str) -> bool:
        budget = self.queue_budget()
        if self._queued_bytes + nbytes <= budget:
            return True
        self._drop("queue")
        whole = " (more than the whole budget)" if nbytes > budget else ""
        self._note_once("dropped:queue_budget",
                        f"kvdbg capture dropped {where}: its {nbytes} bytes{whole} would take the snapshots waiting "
                        f"for the disk past {budget} bytes ({self._queue_budget_why}); the engine is not held up. "
                        f"Raise {ENV_QUEUE_BYTES} or capture fewer steps")
        return False

    # ---------------------------------------------------------------- the engine's calls

    def save_pre_update(self, layer: CaptureLayer, *, key: torch.Tensor, value: torch.Tensor,
                        slot_mapping: torch.Tensor, kv_cache: torch.Tensor, step: int | None = None,
                        rank: int | None = None, check_written: bool = False, ready: Any = None) -> PreUpdate | None:
        """Copy the step's new K/V and the pages they will overwrite; call it before the engine's cache update.

        With ``check_written`` the writer reads the slots the update wrote back
        from the pages the step's :meth:`begin` copies (after the update), and
        refuses the layer from then on, in one line, unless they hold
        ``key``/``value``: the engine's thread copies, never compares.
        """
        try:
            step = _step_number(step)
            if _stream_capturing(kv_cache) or not self._wants(layer.name, step, rank, before_update=True):
                return None
            return save_pre_update(layer, key=key, value=value, slot_mapping=slot_mapping, kv_cache=kv_cache,
                                   step=step, buffers=self._buffers, check_written=check_written, ready=ready)
        except Exception as exc:
            # The forward of this step will try again without the saved pages, so no step is lost yet.
            self.report(exc, f"layer {getattr(layer, 'name', layer)} step {step} (before the cache update)")
            return None

    def begin(self, layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, *, step: int | None = None,
              rank: int | None = None, info: Mapping[str, Any] | None = None, notes: str = "") -> PendingCapture | None:
        """Copy the step as the engine holds it *before* the backend's forward (only copies; engine's thread).

        Returns None (having logged why, once) when the step is filtered out, over
        budget or malformed. ``info`` is merged into the snapshot's provenance.
        """
        try:
            step = _step_number(step)
            if _stream_capturing(getattr(tensors, "kv_cache", None)):
                return None
            if rank is not None or self.config.rank is not None:
                rank_value, rank_source = self.rank(rank), "given"
            else:
                rank_value, rank_source = self._process_rank()
            if not self.wants(layer.name, step, rank_value):
                return None
            plan = plan_capture(layer, backend, tensors, step=step, rank=rank_value, rank_source=rank_source,
                                engine=self.config.engine, info=info, notes=notes, buffers=self._buffers)
            # Refuse before copying pages, the expensive part, when even a lower bound of the
            # file is over a budget; the writer checks the exact size.
            if not self._fits(plan.lower_bound_bytes, layer.name, step, exact=False):
                return None
            if self.config.background and not self._queue_has_room(
                    plan.lower_bound_bytes + plan.output_bytes, f"layer {layer.name} step {step}"):
                return None
            return plan.gather()
        except Exception as exc:
            self.report(exc, f"layer {getattr(layer, 'name', layer)} step {step}", step_lost=True)
            return None

    def finish(self, pending: PendingCapture | None, output: torch.Tensor | None = None, *,
               on_written: Callable[[str | None], None] | None = None) -> str | None:
        """Copy the engine's output (after the forward) and write the snapshot, or hand it to the writer.

        Returns the file's path when written in the caller's thread; with a background
        writer (``queue_bytes`` not 0) the file is written later and this returns None.
        ``on_written`` is called once with the file's path, or None when the step was
        not written, in whichever thread writes it (the vLLM sentinel names the file in its line).
        """
        if pending is None:
            return None
        where = f"layer {pending.layer.name} step {pending.step_index}"
        try:
            pending.attach_output(output)
            if self.config.background:
                if not self._hand_to_writer(pending, where, on_written):
                    _tell(on_written, None)
                return None
        except Exception as exc:
            self.report(exc, where, step_lost=True)
            pending.release()
            _tell(on_written, None)
            return None
        path = None
        try:
            snapshot = self._build(pending, where)
            path = None if snapshot is None else self._store(snapshot, pending, self.config.directory, where)
            return path
        finally:
            pending.release()
            _tell(on_written, path)

    def capture(self, layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, *,
                output: torch.Tensor | None = None, step: int | None = None, rank: int | None = None,
                info: Mapping[str, Any] | None = None, notes: str = "") -> str | None:
        """``begin`` and ``finish`` in one call, for a step whose output is already known (or absent)."""
        pending = self.begin(layer, backend, tensors, step=step, rank=rank, info=info, notes=notes)
        return self.finish(pending, output)

    def layer_refused(self, layer_name: str) -> str | None:
        """Why the writer refused this layer's cache (its written slots did not read back), or None."""
        return self._refused.get(layer_name)

    def skip(self, layer_name: str, step: int | None, reason: str = "refused") -> None:
        """A step :meth:`wants` took that the caller will not hand over (say, a cache layout it refuses):
        counted once in :attr:`dropped` under ``reason``, so that the exit line accounts for it."""
        self._count_unserved(layer_name, step, reason)

    # ---------------------------------------------------------------- the end

    @property
    def requested(self) -> int:
        """Steps asked for (through the filters) so far: written, dropped, or with the writer."""
        return len(self.written) + sum(self.dropped.values()) + self._in_flight - self._given_up

    def summary(self) -> str:
        """One line: what was captured, what was dropped and why."""
        dropped = sum(self.dropped.values())
        line = (f"kvdbg capture in pid {os.getpid()}: captured {len(self.written)} snapshot(s), "
                f"{self.bytes_written} bytes, into {self.config.directory}; dropped {dropped}")
        if dropped:
            line += " (" + ", ".join(f"{count} {DROP_REASONS.get(reason, reason)}"
                                     for reason, count in sorted(self.dropped.items()) if count) + ")"
        waiting = self._in_flight - self._given_up
        if waiting:
            line += f"; {waiting} still with the writer" if not self._closed else f"; {waiting} being written"
        if self.disabled_reason:
            line += f"; capture turned off: {self.disabled_reason}"
        spent = self.engine_time.describe()
        if spent:
            line += f"; {spent}"
        return line

    def close(self, timeout: float | None = EXIT_FLUSH_SECONDS) -> bool:
        """Let the writer drain (at most ``timeout`` seconds), then say in one line what was captured and dropped.

        The engine's shutdown calls it (the vLLM plugin wraps the worker's
        ``shutdown``), and an exit handler calls it for capturers that were not
        closed. Steps the writer has not started after ``timeout`` are given
        up: counted as dropped, and released unwritten; the line names a
        write still under way, which ends whole or leaves only a temporary
        file. Steps handed over later queue behind them and are written.
        Said once per capturer, and only when a step was ever requested.
        Returns whether everything handed over was written.
        """
        drained = self.flush(timeout)
        if self._closed:
            return drained
        with self._lock:
            self._closed = True
            if not drained:
                self._given_up = self._in_flight - self._writing
                self._drop("exit", self._given_up)
        _OPEN.discard(self)
        if self.requested or self.failures:
            level = logging.WARNING if sum(self.dropped.values()) else logging.INFO
            logger.log(level, "%s", self.summary())
        return drained


def _step_number(step: Any) -> int | None:
    """The step as a Python int (a numpy or torch integer is one too); CaptureInputError for anything else."""
    if step is None:
        return None
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise CaptureInputError(f"step must be an integer or None, got {step!r}")


# Capturers that handed steps to a writer and have not been closed: at interpreter exit, their
# writers drain (bounded wait) and each says its one line.
_OPEN: "weakref.WeakSet[Capturer]" = weakref.WeakSet()


@atexit.register
def _close_capturers_at_exit() -> None:
    for capturer in list(_OPEN):
        capturer.close(EXIT_FLUSH_SECONDS)


def capture_step(out_dir: str | os.PathLike, layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, *,
                 output: torch.Tensor | None = None, step: int | None = None, rank: int | None = None,
                 info: Mapping[str, Any] | None = None, notes: str = "") -> str | None:
    """Write one step into ``out_dir`` and return the file's path, or None after logging why.

    Pass the engine's tensors as they are *before* the backend's forward (the
    cache not yet updated with the new K/V); pass ``output`` if the forward
    already ran. Never raises.
    """
    try:
        capturer = Capturer(out_dir, rank=rank)
    except Exception as exc:  # a bad directory argument must not escape either
        logger.error("kvdbg capture not started: %s", exc)
        return None
    return capturer.capture(layer, backend, tensors, output=output, step=step, rank=rank, info=info, notes=notes)
