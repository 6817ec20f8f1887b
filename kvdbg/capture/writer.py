"""Write captured steps: build each snapshot, check it against the budgets, write it into the capture directory.

:class:`CaptureWriter` is the writing half of :class:`kvdbg.capture.capturer.Capturer`:
in the caller's thread, or in the background writer thread it starts (at a lower
priority than the engine's, :func:`writer_niceness`), which takes steps off a queue
and tells each step's ``on_written`` callback what became of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from typing import Callable

import torch

from kvdbg.util.background import confine_torch_to_this_thread
from kvdbg.capture.buffers import IDLE_RELEASE_SECONDS
from kvdbg.capture.build import build_snapshot, check_metadata, snapshot_file_size
from kvdbg.capture.config import ENV_MAX
from kvdbg.capture.inputs import WrittenKVMismatch
from kvdbg.capture.prepare import PendingCapture
from kvdbg.capture.temp_files import _SAFE_NAME, _TEMP_NAME, stale_temp_files, temp_file_prefix
from kvdbg.errors import OptionError, SnapshotError
from kvdbg.snapshot.store import Snapshot, save_snapshot

logger = logging.getLogger("kvdbg.capture")

__all__ = ["CaptureWriter", "writer_niceness"]

# Niceness the background writer thread adds to the engine thread's (Linux; at most 19): it yields the
# cores to the engine's threads. Not the lowest (19): on a machine with no idle core, a writer that the
# scheduler preempts while it holds the interpreter lock keeps the engine's thread waiting for that lock
# until its next slice, which at 19 comes rarely (docs/capture.md, "The writer's priority").
WRITER_NICENESS_ADDED = 10
# held_writer: how long the engine's thread waits for the step being written, and how often it looks.
HOLD_WAIT_SECONDS = 30.0
HELD_POLL_SECONDS = 0.002


class _WriteFailed(Exception):
    """Writing into the capture directory failed in a way that would repeat on every step."""


def writer_niceness(engine_niceness: int) -> int:
    """The writer's niceness for an engine thread at ``engine_niceness``: lower priority, never higher."""
    return min(19, engine_niceness + WRITER_NICENESS_ADDED)


class CaptureWriter:
    """The writing half of :class:`kvdbg.capture.capturer.Capturer`, its base class: build, check and write a step.

    In the caller's thread (``queue_bytes=0``) or in the background writer
    thread this class starts and feeds. It holds no state of its own: the
    budgets, counters, queue, lock and host buffers are the Capturer's, set up
    by its ``__init__``, and so is the failure policy it reports to.
    """

    # ---------------------------------------------------------------- writing

    def _build(self, pending: PendingCapture, where: str) -> Snapshot | None:
        """The step's snapshot (in the caller's thread or the writer's); None after counting why not."""
        name = pending.layer.name
        if name in self._refused:  # refused after this step was copied: its snapshot would be as wrong
            self._drop("refused")
            return None
        try:
            # Engines run under inference mode, so their copies are inference tensors; the writer restores
            # pre-update pages into them in place, which torch allows only inside inference mode.
            with torch.inference_mode():
                return build_snapshot(pending)
        except WrittenKVMismatch as exc:
            self._refuse_layer(pending, exc)
        except Exception as exc:
            self.report(exc, where, step_lost=True)
        return None

    def _refuse_layer(self, pending: PendingCapture, exc: WrittenKVMismatch) -> None:
        """A layer whose cache did not read back as declared: nothing more of it is captured, said in one line."""
        name, backend = pending.layer.name, str(pending.plan.backend.name)
        with self._lock:
            self._drop("refused")
            if name in self._refused:
                return
            self._refused[name] = str(exc)
            self.failures[f"layout:{backend}"] += 1
            first = f"readback:{backend}" not in self._logged
            self._logged.add(f"readback:{backend}")
        if first:  # one line for all of a backend's layers: they share the engine's layout
            logger.warning("kvdbg capture refused: %s layer %s: after do_kv_cache_update, %s; nothing is captured "
                           "from this layer from step %s on, found by the writer (nor, said no more, from other "
                           "layers refused so)", backend, name, exc, pending.step_index)

    def _store(self, snapshot: Snapshot, pending: PendingCapture, directory: str, where: str) -> str | None:
        """Validate, size-check and write one snapshot (in the caller's thread or the writer's)."""
        layer_name = pending.layer.name
        try:
            # save_snapshot checks the tensors; the metadata's values are checked here as a reader checks them.
            check_metadata(snapshot.meta)
            size = snapshot_file_size(snapshot)
            # The lock guards the budgets, never the write itself: the engine's thread may be
            # waiting on it to hand over the next step.
            with self._lock:
                max_snapshots = self.config.max_snapshots
                if not self.active or (max_snapshots is not None and len(self.written) >= max_snapshots):
                    self._drop("off")
                    return None
                if not self._fits(size, layer_name, pending.step_index, exact=True):
                    return None
                self._bytes_reserved += size  # now, so that concurrent writes cannot overrun the budget
            try:
                path = self._write(snapshot, pending, directory)
            finally:
                with self._lock:
                    self._bytes_reserved -= size
            with self._lock:
                self.bytes_written += os.path.getsize(path)
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
            self.report(exc, where, step_lost=True)
            return None

    def _write(self, snapshot: Snapshot, pending: PendingCapture, directory: str) -> str:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise _WriteFailed(f"cannot create capture directory {directory}: {exc.strerror or exc}") from None
        if directory not in self._cleaned:
            self._cleaned.add(directory)
            self._remove_stale_temps(directory)
        stem = _SAFE_NAME.sub("_", pending.layer.name) or "layer"
        step = "x" if pending.step_index is None else str(pending.step_index)
        temp_prefix = temp_file_prefix()
        for _ in range(1000):
            name = f"{stem}-step{step}-rank{pending.rank}-{next(self._names):04d}.safetensors"
            path = os.path.join(directory, name)
            if os.path.exists(path):
                continue
            try:
                return save_snapshot(snapshot, path, temp_prefix=temp_prefix)
            except SnapshotError:
                raise
            except OptionError as exc:
                if os.path.exists(path):  # another process took the name meanwhile
                    continue
                raise _WriteFailed(str(exc)) from None
        raise _WriteFailed(f"no free file name for {stem} in {directory} after 1000 tries")

    def _remove_stale_temps(self, directory: str) -> None:
        removed, pids = 0, set()
        for path in stale_temp_files(directory):
            try:
                os.unlink(path)
            except FileNotFoundError:  # another capture process removed it first
                continue
            except OSError as exc:
                logger.warning("kvdbg capture: cannot remove the stale temporary file %s: %s", path,
                               exc.strerror or exc)
                continue
            removed += 1
            pids.add(int(_TEMP_NAME.match(os.path.basename(path))["pid"]))
        if removed:
            logger.info("kvdbg capture: removed %d temporary file(s) in %s left by capture processes that died "
                        "mid-write (pid %s)", removed, directory, ", ".join(map(str, sorted(pids))))

    # ---------------------------------------------------------------- the background writer

    def _hand_to_writer(self, pending: PendingCapture, where: str,
                        on_written: Callable[[str | None], None] | None = None) -> bool:
        nbytes = pending.nbytes
        with self._lock:
            if not self._queue_has_room(nbytes, where):
                pending.release()
                return False
            if self._writer is None:
                self._queue = queue.SimpleQueue()
                self._writer = threading.Thread(target=self._write_loop, name="kvdbg-capture-writer", daemon=True)
                self._writer.start()
                logger.info("kvdbg capture: background writer started in pid %d; up to %d MiB of snapshots may wait "
                            "for the disk (%s)", os.getpid(), self.queue_budget() // 1024**2, self._queue_budget_why)
            self._queued_bytes += nbytes
            self._in_flight += 1
            # The directory is taken now: a later change of it applies to later steps only. Queued under the
            # lock, so that the steps close() gives up are the first the writer takes after it, in order.
            self._queue.put((pending, self.config.directory, where, nbytes, on_written))
        return True

    def _write_loop(self) -> None:
        assert self._queue is not None
        try:  # Linux: the writer yields the CPU to the engine's threads (on other systems this is a no-op)
            me = threading.get_native_id()  # a new thread starts at the niceness of the engine's that made it
            os.setpriority(os.PRIO_PROCESS, me, writer_niceness(os.getpriority(os.PRIO_PROCESS, me)))
        except (AttributeError, OSError):
            pass
        # No OpenMP team of the writer's own beside the engine's (kvdbg.util.background says what one costs).
        logger.debug("kvdbg capture writer: %s", confine_torch_to_this_thread())
        while True:
            try:
                # Idle with free page buffers: give them back to the system after a while.
                item = self._queue.get(timeout=IDLE_RELEASE_SECONDS if self._buffers.free_bytes else None)
            except queue.Empty:
                with self._lock:
                    if self._held:  # freeing pinned memory is a CUDA call: not while a graph is recorded
                        continue
                    self._writing += 1
                try:
                    released = self._buffers.trim()
                finally:
                    with self._lock:
                        self._writing -= 1
                if released:
                    logger.debug("kvdbg capture: idle for %.0f s, released %d bytes of free page buffers",
                                 IDLE_RELEASE_SECONDS, released)
                continue
            pending, directory, where, nbytes, on_written = item
            path = None
            while True:
                with self._lock:
                    if not self._held:
                        given_up = self._given_up > 0
                        if given_up:  # close counted it as dropped ("still waiting at shutdown")
                            self._given_up -= 1
                        else:
                            self._writing += 1
                        break
                time.sleep(HELD_POLL_SECONDS)
            if given_up:
                pending.release()
                _tell(on_written, None)
                with self._lock:
                    self._in_flight -= 1
                    self._queued_bytes -= nbytes
                continue
            try:
                try:
                    # The engine's next step of this size then finds memory already touched.
                    self._buffers.ensure_spare(self.queue_budget() - self._queued_bytes)
                except Exception:  # only an optimisation (say, no memory for a spare): write on
                    pass
                snapshot = self._build(pending, where)
                if snapshot is not None:
                    path = self._store(snapshot, pending, directory, where)
            except Exception as exc:  # the writer must outlive anything that goes wrong with one step
                self.report(exc, where, step_lost=True)
            finally:
                # Free page buffers are kept for the engine's next steps within what the budget leaves free,
                # so that waiting and free buffers together stay within the budget (each counted by its bytes).
                self._buffers.keep_bytes = max(0, self.queue_budget() - self._queued_bytes + nbytes)
                pending.release()
                _tell(on_written, path)
                with self._lock:
                    self._writing -= 1
                    self._in_flight -= 1
                    self._queued_bytes -= nbytes

    @contextlib.contextmanager
    def held_writer(self, timeout: float = HOLD_WAIT_SECONDS):
        """No device work in the writer while inside: the step it is writing is finished first (at most
        ``timeout`` seconds), and it starts no other until the block ends.

        For a CUDA graph being recorded on the engine's thread: CUDA forbids, process-wide, calls such as
        synchronising an event or freeing pinned memory while a stream captures (the capture then fails with
        ``invalid argument`` or ``operation not permitted``), and the writer makes such calls for each step.
        Steps handed to the writer meanwhile wait in its queue. Whether the writer was idle in time is yielded.
        """
        with self._lock:
            self._held += 1
        try:
            deadline = time.monotonic() + timeout
            while self._writing and time.monotonic() < deadline:
                time.sleep(HELD_POLL_SECONDS)
            yield not self._writing
        finally:
            with self._lock:
                self._held -= 1

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


def _tell(on_written: Callable[[str | None], None] | None, path: str | None) -> None:
    if on_written is None:
        return
    try:
        on_written(path)
    except Exception as exc:  # a caller's callback must not stop the writer
        logger.debug("kvdbg capture: the on_written callback failed: %s", exc)
