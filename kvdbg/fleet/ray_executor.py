"""`kvdbg replay DIR --ray [ADDRESS]`: the same replays as Ray tasks on a cluster (Ray is the scheduler).

Each file is one Ray task asking for one CPU, or on ``--device cuda`` one GPU
(``1/N`` of one with ``--jobs N``): Ray places it, pins it to its GPU (it sets
``CUDA_VISIBLE_DEVICES``, as ``--jobs`` does on one machine) and retries it
once when its worker process or node dies (``max_retries=1``; a Python
exception is a result, never retried). A task that fails again becomes a row
saying its worker died. The task reads the snapshot from its absolute path,
which must be a path every node shares (the driver lists the files there).

Every wait is bounded: connecting (a port probe, then ``ray.init`` within
``connect_timeout``), each ``ray.wait`` (one second, to show progress and see
Ctrl-C), each ``ray.get`` of a finished task; and a run whose tasks the
cluster can no longer place (no node offers the CPU or GPU they ask for) stops
with a one-line error after ``stall_timeout`` rather than waiting for ever.
Rows already finished are in the results file; ``--resume`` continues.

Ray is an optional extra (``pip install 'kvdbg[ray]'``), imported only here.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Iterator

from kvdbg.replayer.batch import STATUS_CRASHED, BatchOptions, FileResult, replay_file
from kvdbg.errors import BackendUnavailable, OptionError
from kvdbg.fleet.results import Placement, died_result
from kvdbg.fleet.workers import Done, Replay, WorkerLost

INSTALL_HINT = "pip install 'kvdbg[ray]' (here and on every node of the cluster)"
MAX_RETRIES = 1  # a task whose worker dies is run once more, then reported
CONNECT_TIMEOUT_S = 60.0
WAIT_SLICE_S = 1.0  # each ray.wait: progress and Ctrl-C stay responsive
GET_TIMEOUT_S = 60.0  # fetching a finished task's result (a few KB)
STALL_TIMEOUT_S = 120.0  # no node offers what the tasks ask for, this long: stop


def import_ray():
    try:
        import ray
    except ImportError:
        raise BackendUnavailable(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def _replay_task(path: str, options: BatchOptions, replay: Replay) -> tuple[FileResult, dict[str, Any]]:
    """The Ray task: one file replayed on the worker Ray chose, and where that was."""
    import ray

    from kvdbg._version import __version__

    context = ray.get_runtime_context()
    gpus = context.get_accelerator_ids().get("GPU") or []
    result = replay(path, options)
    device = f"cuda:{gpus[0]}" if options.device.startswith("cuda") and gpus else options.device
    where = {"device": device, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
             "node_id": context.get_node_id(), "kvdbg": __version__}
    return result, where


def _address_port(address: str) -> tuple[str, int] | None:
    """host and port of ``host:port`` or ``ray://host:port``; None for Ray's words (auto, local)."""
    match = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d+)", address)
    return (match.group(1), int(match.group(2))) if match else None


class RayPool:
    """The files of a run as Ray tasks; :meth:`run` yields the same events as kvdbg.fleet.workers.LocalPool."""

    def __init__(self, address: str | None, options: BatchOptions, *, per_gpu: int | None = None,
                 replay: Replay = replay_file, connect_timeout: float = CONNECT_TIMEOUT_S,
                 stall_timeout: float = STALL_TIMEOUT_S):
        if options.device.startswith("cuda:"):
            raise OptionError(f"--device {options.device} names a GPU of this machine; with --ray give "
                              "--device cuda (Ray gives each task a GPU of its node)")
        self.address = address or os.environ.get("RAY_ADDRESS") or "auto"
        self.options, self.per_gpu, self.replay = options, per_gpu, replay
        self.connect_timeout, self.stall_timeout = connect_timeout, stall_timeout
        self.ray = import_ray()
        self.resources: dict[str, float] = {}
        self.device = options.device
        self._stdout = None

    # ------------------------------------------------------------------ connecting

    def connect(self) -> dict[str, Any]:
        """Join the cluster (bounded); check it can run the tasks. Returns what the summary says of it."""
        ray = self.ray
        target = _address_port(self.address)
        if target is not None:
            try:
                socket.create_connection(target, timeout=min(5.0, self.connect_timeout)).close()
            except OSError as exc:
                raise BackendUnavailable(f"--ray {self.address}: nothing answers there ({exc.strerror or exc}); "
                                         "is the cluster started (ray start --head)?") from None
        failure: list[BaseException] = []
        # Ray prints what its nodes report to the driver (a worker that died, ...) on sys.stdout, from a thread
        # of its own: stdout is kvdbg's output (--json), so Ray's messages go to stderr until close().
        self._stdout, sys.stdout = sys.stdout, sys.stderr

        def init() -> None:
            try:
                ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False,
                         configure_logging=True)
            except BaseException as exc:  # reported from the calling thread
                failure.append(exc)

        thread = threading.Thread(target=init, name="kvdbg-ray-init", daemon=True)
        thread.start()
        thread.join(self.connect_timeout)
        if thread.is_alive():
            raise BackendUnavailable(f"--ray {self.address}: the cluster did not accept this driver within "
                                     f"{self.connect_timeout:.0f} s")
        if failure:
            exc = failure[0]
            text = " ".join(str(exc).split())[:300]
            raise BackendUnavailable(f"--ray {self.address}: cannot join the cluster: {type(exc).__name__}: "
                                     f"{text}") from None
        self.resources = dict(ray.cluster_resources())
        if self.device == "auto":
            self.device = "cuda" if self.resources.get("GPU", 0) > 0 else "cpu"
        kind, need = self._need()
        if self.resources.get(kind, 0) < need:
            have = ", ".join(f"{k} {v:g}" for k, v in sorted(self.resources.items()) if k in ("CPU", "GPU"))
            raise BackendUnavailable(f"--ray {self.address}: no node offers the {need:g} {kind} a task asks for "
                                     f"(the cluster has: {have or 'nothing'})")
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return {"kind": "ray", "address": self.address, "nodes": len(nodes),
                "cpus": self.resources.get("CPU", 0), "gpus": self.resources.get("GPU", 0),
                "per_task": {kind: need}, "max_retries": MAX_RETRIES}

    def _need(self) -> tuple[str, float]:
        if self.device.startswith("cuda"):
            return "GPU", 1.0 / (self.per_gpu or 1)
        return "CPU", 1.0

    def slots(self) -> int:
        kind, need = self._need()
        return max(1, int(self.resources.get(kind, 0) / need))

    # ------------------------------------------------------------------ running

    def run(self, tasks: list[tuple[int, str]]) -> Iterator[Done | WorkerLost]:
        """Submit the tasks (at most a few per slot ahead, Ray's own back-pressure pattern), yield each result."""
        ray = self.ray
        kind, need = self._need()
        device = "cuda" if kind == "GPU" else "cpu"
        task_options = replace(self.options, device=device)
        remote = ray.remote(_replay_task).options(
            num_cpus=1, num_gpus=need if kind == "GPU" else 0, max_retries=MAX_RETRIES, retry_exceptions=False)
        window = max(64, 4 * self.slots())
        queue = list(reversed(tasks))
        pending: dict[Any, tuple[int, str]] = {}
        last_progress = time.monotonic()
        try:
            while queue or pending:
                while queue and len(pending) < window:
                    index, path = queue.pop()
                    pending[remote.remote(os.path.abspath(path), task_options, self.replay)] = (index, path)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_SLICE_S)
                if not ready:
                    if time.monotonic() - last_progress > self.stall_timeout:
                        self._check_placeable(kind, need, len(pending) + len(queue))
                        last_progress = time.monotonic()
                    continue
                last_progress = time.monotonic()
                for ref in ready:
                    index, path = pending.pop(ref)
                    yield from self._collect(ref, index, path)
        finally:
            if pending:
                for ref in pending:
                    try:
                        ray.cancel(ref, force=True)
                    except Exception:  # the driver is going anyway; Ray ends its tasks with it
                        pass

    def _collect(self, ref, index: int, path: str) -> Iterator[Done | WorkerLost]:
        ray = self.ray
        errors = ray.exceptions
        try:
            result, where = ray.get(ref, timeout=GET_TIMEOUT_S)
        except (errors.WorkerCrashedError, errors.NodeDiedError, errors.OutOfMemoryError,
                errors.LocalRayletDiedError) as exc:
            how = f"{type(exc).__name__}: {_first_line(exc)}"
            placement = Placement(self.device if self.device == "cpu" else "cuda")
            yield WorkerLost(placement, how, index, False)
            yield Done(index, died_result(path, how, retried=True), None, MAX_RETRIES + 1)
            return
        except errors.RayError as exc:  # the task could not run or return (not a replay result)
            yield Done(index, FileResult(path, STATUS_CRASHED, 1, summary=f"the Ray task failed: "
                                         f"{type(exc).__name__}: {_first_line(exc)}"), None, None)
            return
        result.path = path  # the name the user gave, not the absolute one the task read
        yield Done(index, result, Placement(**where), None)

    def _check_placeable(self, kind: str, need: float, waiting: int) -> None:
        """Tasks wait with no result for a while: fine while some node offers what they ask for."""
        available = dict(self.ray.cluster_resources())
        if available.get(kind, 0) < need:
            raise BackendUnavailable(
                f"--ray {self.address}: no node of the cluster offers {need:g} {kind} any more; {waiting} file(s) "
                f"were not replayed (--resume continues them)")

    def close(self) -> None:
        try:
            self.ray.shutdown()
        except Exception:
            pass
        finally:
            if self._stdout is not None:
                sys.stdout, self._stdout = self._stdout, None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join((text.splitlines()[0] if text else type(exc).__name__).split())[:300]


__all__ = ["INSTALL_HINT", "MAX_RETRIES", "RayPool", "import_ray"]
