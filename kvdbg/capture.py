"""Capture one attention layer's decode step from a live engine into a snapshot, never raising into the engine.

The engine describes each layer once (:class:`CaptureLayer`) and its backend
settings (:class:`CaptureBackend`), then per step calls
``Capturer.begin(layer, backend, tensors, step=..., rank=...)`` just before the
attention backend's forward (the cache still holds the state the step starts
from), runs the forward, and calls :meth:`Capturer.finish` with the output
buffer. Everything a later kernel could overwrite is copied to CPU in ``begin``:
the query, the new K/V with their slots, the engine-level metadata and only the
pages the step reads or writes (:mod:`kvdbg.capture_prepare`, which raises typed
errors). Files are written with :func:`kvdbg.snapshot.save_snapshot` (atomic,
never clobbering) under the budgets of a frozen :class:`CaptureConfig`.

:class:`Capturer` is the shell around that work: it holds the budgets, the
failure policy and the background writer. Any failure is logged once per kind
on the ``kvdbg.capture`` logger; a failure that would recur on every step (an
unwritable directory, a bug) turns capture off. docs/capture.md describes the
API, the vLLM plugin and its variables.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import queue
import re
import threading
import time
from collections import Counter
from typing import Any, Mapping

import torch

from kvdbg.capture_config import ENV_MAX, ENV_MAX_BYTES, ENV_QUEUE, CaptureConfig, LayerFilter
from kvdbg.capture_prepare import (
    CaptureBackend,
    CaptureInputError,
    CaptureLayer,
    PendingCapture,
    PreUpdate,
    StepTensors,
    check_metadata,
    complete_capture,
    current_rank,
    infer_kv_layout,
    package_version,
    plan_capture,
    resolve_kv_layout,
    save_pre_update,
    snapshot_file_size,
)
from kvdbg.errors import OptionError, SnapshotError
from kvdbg.snapshot import Snapshot, save_snapshot

logger = logging.getLogger("kvdbg.capture")

__all__ = [
    "CaptureBackend",
    "CaptureConfig",
    "CaptureInputError",
    "CaptureLayer",
    "Capturer",
    "LayerFilter",
    "PendingCapture",
    "PreUpdate",
    "StepTensors",
    "capture_step",
    "infer_kv_layout",
    "package_version",
    "resolve_kv_layout",
    "snapshot_file_size",
]

# Scheduling priority of the background writer thread (Linux): lowest, so it only uses idle CPU.
WRITER_NICENESS = 19

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


class _WriteFailed(Exception):
    """Writing into the capture directory failed in a way that would repeat on every step."""


def _stream_capturing(t: Any) -> bool:
    # A CUDA graph being recorded forbids the host syncs a capture needs; the
    # step is replayed later without Python, so there is nothing to take anyway.
    return isinstance(t, torch.Tensor) and t.is_cuda and torch.cuda.is_current_stream_capturing()


class Capturer:
    """Capture into one directory under a :class:`CaptureConfig`: filters, budgets, failure policy, writer.

    ``Capturer(directory, **config_fields)`` or ``Capturer(config)``. Nothing
    here raises into the caller: failures are logged once per kind on the
    ``kvdbg.capture`` logger and counted in :attr:`failures`.
    """

    def __init__(self, config: CaptureConfig | str | os.PathLike, **fields):
        if isinstance(config, CaptureConfig):
            self.config = dataclasses.replace(config, **fields) if fields else config
        else:
            self.config = CaptureConfig(directory=config, **fields)
        # Budget state: files written, bytes written (reserved before each write), steps with the writer.
        self.written: list[str] = []
        self.bytes_written = 0
        self._in_flight = 0
        # Failure state.
        self.failures: Counter[str] = Counter()
        self.disabled_reason: str | None = None
        self._logged: set[str] = set()
        self._queue: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        self._names = itertools.count()
        self._layer_cache: dict[str, bool] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Capturer":
        """A capturer configured by the ``KVDBG_CAPTURE_*`` variables; OptionError naming a bad one."""
        return cls(CaptureConfig.from_env(environ), **overrides)

    def reconfigure(self, **changes) -> None:
        """Replace fields of the configuration from now on (a step already handed to the writer keeps its directory).

        A new ``queue_size`` applies to a writer not yet started.
        """
        self.config = dataclasses.replace(self.config, **changes)
        self._layer_cache = {}

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
        return current_rank()[0]

    def _rank_source(self, rank: int | None) -> str:
        return "given" if rank is not None or self.config.rank is not None else current_rank()[1]

    def layer_selected(self, layer_name: str) -> bool:
        hit = self._layer_cache.get(layer_name)
        if hit is None:
            hit = self._layer_cache[layer_name] = bool(self.config.layers(layer_name))
        return hit

    def wants(self, layer_name: str, step: int | None = None, rank: int | None = None) -> bool:
        """Whether a step of this layer would be captured now (filters and count budget)."""
        config = self.config
        if not self.active or not self.layer_selected(layer_name):
            return False
        if config.steps is not None and step not in config.steps:
            return False
        if config.ranks is not None and self.rank(rank) not in config.ranks:
            return False
        if config.max_snapshots is not None and len(self.written) + self._in_flight >= config.max_snapshots:
            if self._in_flight == 0:
                self.disable(f"wrote {len(self.written)} snapshots, the limit ({ENV_MAX}={config.max_snapshots})")
            return False
        return True

    # ---------------------------------------------------------------- failure policy

    def report(self, exc: BaseException, where: str = "") -> None:
        """Log a failure once per kind; turn capture off when it would repeat every step."""
        if isinstance(exc, (CaptureInputError, SnapshotError)):
            kind, fatal = "input", False
        elif isinstance(exc, _WriteFailed):
            kind, fatal = "write", True
        else:
            kind, fatal = "internal", True
        key = f"{kind}:{type(exc).__name__}"
        self.failures[key] += 1
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
            logger.warning("%s (logged once)", message)

    def _fits(self, size: int, layer_name: str, step: int | None, *, exact: bool) -> bool:
        max_bytes = self.config.max_bytes
        if max_bytes is None or self.bytes_written + size <= max_bytes:
            return True
        self._note_once(
            "budget:bytes",
            f"kvdbg capture skipped layer {layer_name} step {step}: the snapshot "
            f"{'takes' if exact else 'would take at least'} {size} bytes, over the {max_bytes - self.bytes_written} "
            f"bytes left of {ENV_MAX_BYTES}={max_bytes}; smaller steps may still be captured",
        )
        return False

    # ---------------------------------------------------------------- the engine's calls

    def save_pre_update(self, layer: CaptureLayer, *, key: torch.Tensor, value: torch.Tensor,
                        slot_mapping: torch.Tensor, kv_cache: torch.Tensor, step: int | None = None,
                        rank: int | None = None) -> PreUpdate | None:
        """Save the step's new K/V and the pages they will overwrite; call it before the engine's cache update."""
        try:
            if _stream_capturing(kv_cache) or not self.wants(layer.name, step, rank):
                return None
            return save_pre_update(layer, key=key, value=value, slot_mapping=slot_mapping, kv_cache=kv_cache,
                                   step=step)
        except Exception as exc:
            self.report(exc, f"layer {getattr(layer, 'name', layer)} step {step} (before the cache update)")
            return None

    def begin(self, layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, *, step: int | None = None,
              rank: int | None = None, info: Mapping[str, Any] | None = None, notes: str = "") -> PendingCapture | None:
        """Copy the step to CPU as the engine holds it *before* the backend's forward.

        Returns None (having logged why, once) when the step is filtered out, over
        budget or malformed. ``info`` is merged into the snapshot's provenance.
        """
        try:
            if _stream_capturing(getattr(tensors, "kv_cache", None)):
                return None
            rank_value = self.rank(rank)
            if not self.wants(layer.name, step, rank_value):
                return None
            plan = plan_capture(layer, backend, tensors, step=step, rank=rank_value,
                                rank_source=self._rank_source(rank), engine=self.config.engine, info=info,
                                notes=notes)
            # Refuse before copying pages, the expensive part, when even a lower bound of the
            # file is over budget; the writer checks the exact size.
            if not self._fits(plan.lower_bound_bytes, layer.name, step, exact=False):
                return None
            return plan.gather()
        except Exception as exc:
            self.report(exc, f"layer {getattr(layer, 'name', layer)} step {step}")
            return None

    def finish(self, pending: PendingCapture | None, output: torch.Tensor | None = None) -> str | None:
        """Add the engine's output (after the forward) and write the snapshot. Returns its path or None.

        With a background writer (``queue_size`` > 0) the file is written later and this returns None.
        """
        if pending is None:
            return None
        where = f"layer {pending.meta.layer.name} step {pending.step_index}"
        try:
            snapshot = complete_capture(pending, output)
        except Exception as exc:
            self.report(exc, where)
            return None
        if self.config.queue_size:
            self._hand_to_writer(snapshot, pending, where)
            return None
        return self._store(snapshot, pending, self.config.directory, where)

    def capture(self, layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, *,
                output: torch.Tensor | None = None, step: int | None = None, rank: int | None = None,
                info: Mapping[str, Any] | None = None, notes: str = "") -> str | None:
        """``begin`` and ``finish`` in one call, for a step whose output is already known (or absent)."""
        pending = self.begin(layer, backend, tensors, step=step, rank=rank, info=info, notes=notes)
        return self.finish(pending, output)

    # ---------------------------------------------------------------- writing

    def _store(self, snapshot: Snapshot, pending: PendingCapture, directory: str, where: str) -> str | None:
        """Validate, size-check and write one snapshot (in the caller's thread or the writer's)."""
        layer_name = pending.meta.layer.name
        try:
            # save_snapshot checks the tensors; the metadata's values are checked here as a reader checks them.
            check_metadata(pending.meta)
            size = snapshot_file_size(snapshot)
            # The lock guards the budgets, never the write itself: the engine's thread may be
            # waiting on it to hand over the next step.
            with self._lock:
                max_snapshots = self.config.max_snapshots
                if not self.active or (max_snapshots is not None and len(self.written) >= max_snapshots):
                    return None
                if not self._fits(size, layer_name, pending.step_index, exact=True):
                    return None
                self.bytes_written += size  # reserved now, so concurrent writes cannot overrun the budget
            try:
                path = self._write(snapshot, pending, directory)
            except BaseException:
                with self._lock:
                    self.bytes_written -= size
                raise
            with self._lock:
                self.bytes_written += os.path.getsize(path) - size
                self.written.append(path)
            count, lines = len(self.written), self.config.info_snapshot_lines
            if count <= lines:
                logger.info("kvdbg captured %s: %s (%d bytes)%s", where, path, size,
                            "; further snapshots are logged at debug level" if count == lines else "")
            else:
                logger.debug("kvdbg captured %s: %s", where, path)
            max_snapshots = self.config.max_snapshots
            if max_snapshots is not None and count >= max_snapshots:
                self.disable(f"wrote {count} snapshots, the limit ({ENV_MAX}={max_snapshots})")
            return path
        except Exception as exc:
            self.report(exc, where)
            return None

    def _write(self, snapshot: Snapshot, pending: PendingCapture, directory: str) -> str:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise _WriteFailed(f"cannot create capture directory {directory}: {exc.strerror or exc}") from None
        stem = _SAFE_NAME.sub("_", pending.meta.layer.name) or "layer"
        step = "x" if pending.step_index is None else str(pending.step_index)
        for _ in range(1000):
            name = f"{stem}-step{step}-rank{pending.rank}-{next(self._names):04d}.safetensors"
            path = os.path.join(directory, name)
            if os.path.exists(path):
                continue
            try:
                return save_snapshot(snapshot, path)
            except SnapshotError:
                raise
            except OptionError as exc:
                if os.path.exists(path):  # another process took the name meanwhile
                    continue
                raise _WriteFailed(str(exc)) from None
        raise _WriteFailed(f"no free file name for {stem} in {directory} after 1000 tries")

    # ---------------------------------------------------------------- the background writer

    def _hand_to_writer(self, snapshot: Snapshot, pending: PendingCapture, where: str) -> None:
        with self._lock:
            if self._writer is None:
                self._queue = queue.Queue(self.config.queue_size)
                self._writer = threading.Thread(target=self._write_loop, name="kvdbg-capture-writer", daemon=True)
                self._writer.start()
                _WRITERS.append(self)
            try:
                # The directory is taken now: a later change of it applies to later steps only.
                self._queue.put_nowait((snapshot, pending, self.config.directory, where))
                self._in_flight += 1
            except queue.Full:
                size = self._queue.maxsize
                self._note_once("dropped:queue_full",
                                f"kvdbg capture dropped {where}: {size} snapshots are already waiting "
                                f"for the disk ({ENV_QUEUE}={size}); the engine is not held up, "
                                "dropped steps are counted in failures['dropped:queue_full']")

    def _write_loop(self) -> None:
        assert self._queue is not None
        try:  # Linux: the writer yields the CPU to the engine's threads (on other systems this is a no-op)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while True:
            snapshot, pending, directory, where = self._queue.get()
            try:
                self._store(snapshot, pending, directory, where)
            finally:
                with self._lock:
                    self._in_flight -= 1
                self._queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background writer has written (or dropped) everything handed to it.

        Returns False if ``timeout`` seconds passed first. Without a writer, returns True at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._in_flight:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True


# Capturers with a background writer: at interpreter exit, what they hold is written (bounded wait).
_WRITERS: list[Capturer] = []
EXIT_FLUSH_SECONDS = 30.0


@atexit.register
def _flush_writers_at_exit() -> None:
    for capturer in list(_WRITERS):
        if not capturer.flush(EXIT_FLUSH_SECONDS):
            logger.warning("kvdbg capture: %d snapshot(s) still unwritten at exit after %.0f s",
                           capturer._in_flight, EXIT_FLUSH_SECONDS)


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
