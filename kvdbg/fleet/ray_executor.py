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
Ctrl-C), each ``ray.get`` of a finished task, a probe of the head (GCS) every
few seconds, and leaving (``ray.shutdown``); a run whose tasks the cluster can
no longer place (no node offers the CPU or GPU they ask for) stops with a
one-line error after ``stall_timeout`` rather than waiting for ever, and one
whose head stops answering stops within ``GCS_LOST_S``, well before Ray's own
client would end the process (exit 1, after 60 s without its GCS); so does one
whose own node (the raylet it submits through) died. Each is a one-line
:class:`BackendUnavailable`, exit 2: Ray's failure, never a file's verdict.
Rows already finished are in the results file; ``--resume`` continues.

``ray.init`` runs in a thread of its own, so that its wait can be bounded;
that thread lives until :meth:`RayPool.close`. It must: Ray starts the
processes of a private cluster (``--ray local``: GCS, raylet, ...) with
``PR_SET_PDEATHSIG``, and Linux sends that signal when the *thread* that
started them ends, not the process -- an init thread that returned would take
the cluster down with it, the driver's next call would find no GCS, and Ray
would end the process after 60 s.

A private cluster also gets a directory of its own (Ray's sessions, logs and
sockets), removed by :meth:`RayPool.close`, which also ends whatever of its
processes ``ray.shutdown`` could not (without a GCS it cannot end them all).

A private cluster gets a token of its own (``RAY_AUTH_TOKEN`` in this process
and the cluster's, restored by :meth:`RayPool.close`): Ray 2.60 turns token
authentication on for a cluster ``ray.init`` starts and would otherwise read,
or create, the user's ``~/.ray/auth_token``. Nothing under ``~/.ray`` is read
or written for it. Other addresses follow Ray's rules (``RAY_AUTH_MODE``,
``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``); a cluster
that refuses this driver's token is a one-line error naming them.

Ray's core writes its messages straight to file descriptor 2; while joining and
leaving the cluster they go to a file (named in the error when something
fails), so that a failure is one line. During the run, what Ray's nodes tell
the driver goes to stderr, one line each (the indented detail below is left
out).

Ray is an optional extra (``pip install 'kvdbg[ray]'``), imported only here.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any, Iterator

from kvdbg.replayer.batch import STATUS_CRASHED, BatchOptions, FileResult, replay_file
from kvdbg.errors import BackendUnavailable, OptionError
from kvdbg.fleet.results import Placement, died_result
from kvdbg.fleet.workers import Done, Replay, WorkerLost
from kvdbg.util.environ import restore_environ, saved_environ

INSTALL_HINT = "pip install 'kvdbg[ray]' (here and on every node of the cluster)"
MAX_RETRIES = 1  # a task whose worker dies is run once more, then reported
CONNECT_TIMEOUT_S = 60.0  # joining (or, for --ray local, starting) the cluster
CLOSE_TIMEOUT_S = 30.0  # ray.shutdown: the driver leaves, a private cluster's processes end
LOST_CLOSE_TIMEOUT_S = 10.0  # the same once the head is lost (then the processes are ended without it)
PROBE_TIMEOUT_S = 5.0  # the head's port, before joining
WAIT_SLICE_S = 1.0  # each ray.wait: progress and Ctrl-C stay responsive
GET_TIMEOUT_S = 60.0  # fetching a finished task's result (a few KB)
STALL_TIMEOUT_S = 120.0  # no node offers what the tasks ask for, this long: stop
GCS_PROBE_EVERY_S = 5.0  # during a run, the head's GCS port is probed this often...
GCS_PROBE_TIMEOUT_S = 2.0
GCS_LOST_AFTER = 2  # ...and this many failed probes in a row stop the run
GCS_LOST_S = GCS_LOST_AFTER * (GCS_PROBE_EVERY_S + GCS_PROBE_TIMEOUT_S)  # at most, < Ray's own 60 s
LOCAL = "local"  # Ray's word for a private cluster of this machine, started by ray.init
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")  # what --ray local changes in os.environ (restored)
AUTH_HINT = ("give this driver the cluster's token: RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH "
             "or ~/.ray/auth_token (Ray reads ~/.ray/auth_token by itself only for --ray auto)")


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
        self._thread: _RayThread | None = None
        self._messages: _RayMessages | None = None
        self._saved_env: dict[str, str | None] | None = None
        self._gcs: str | None = None
        self._lost = False
        self._private_dir: str | None = None  # --ray local: the cluster's temp dir (sessions, logs, sockets)
        self._keep_private_dir = False

    # ------------------------------------------------------------------ connecting

    def connect(self) -> dict[str, Any]:
        """Join the cluster (bounded); check it can run the tasks. Returns what the summary says of it.

        Any failure is a one-line :class:`BackendUnavailable` (exit 2), raised within ``connect_timeout`` (plus
        the port probe and a bounded clean-up); nothing of Ray is left running here then."""
        try:
            return self._connect()
        except BaseException:
            self.close(wait=False)
            raise

    def _connect(self) -> dict[str, Any]:
        ray = self.ray
        target = _address_port(self.address)
        if target is not None:
            try:
                socket.create_connection(target, timeout=min(PROBE_TIMEOUT_S, self.connect_timeout)).close()
            except OSError as exc:
                raise BackendUnavailable(f"--ray {self.address}: nothing answers there ({exc.strerror or exc}); "
                                         "is the cluster started (ray start --head)?") from None
        if self.address == LOCAL:
            self._private_token()
            self._private_dir = _private_dir()
        # Ray prints what its nodes report to the driver (a worker that died, ...) on sys.stdout, from a thread
        # of its own: stdout is kvdbg's output (--json), so Ray's messages go to stderr until close(), their
        # first lines only (a dead raylet's message carries the last 20 lines of its log, indented).
        self._stdout, sys.stdout = sys.stdout, _FirstLines(sys.stderr)
        self._messages = _RayMessages.create(self._private_dir)
        gcs_check = target if target is not None and not self.address.startswith("ray://") else None
        self._thread = _RayThread(ray, self.address, gcs_check, self._private_dir)
        with self._messages.captured():
            self._thread.start()
            joined = self._thread.ready.wait(self.connect_timeout)
        if not joined:
            raise BackendUnavailable(self._failed(
                f"the cluster did not accept this driver within {self.connect_timeout:.0f} s" if self.address != LOCAL
                else f"Ray did not start a cluster here within {self.connect_timeout:.0f} s", last_message=True))
        error = self._thread.error
        if error is not None:
            raise BackendUnavailable(self._failed(self._explain(error)))
        # Joined: the file is not needed any more (a driver killed later leaves nothing behind); what Ray says
        # while leaving is of no use to anyone.
        self._messages.remove()
        self._messages = _RayMessages.discard()
        self.resources = dict(self._thread.resources)
        self._gcs = self._thread.gcs_address
        if self.device == "auto":
            self.device = "cuda" if self.resources.get("GPU", 0) > 0 else "cpu"
        kind, need = self._need()
        if self.resources.get(kind, 0) < need:
            have = ", ".join(f"{k} {v:g}" for k, v in sorted(self.resources.items()) if k in ("CPU", "GPU"))
            raise BackendUnavailable(f"--ray {self.address}: no node offers the {need:g} {kind} a task asks for "
                                     f"(the cluster has: {have or 'nothing'})")
        return {"kind": "ray", "address": self.address, "nodes": self._thread.nodes,
                "cpus": self.resources.get("CPU", 0), "gpus": self.resources.get("GPU", 0),
                "per_task": {kind: need}, "max_retries": MAX_RETRIES}

    def _private_token(self) -> None:
        """A private cluster's own token (Ray 2.60 starts one with token authentication): in os.environ, which
        its processes inherit, so that Ray neither reads nor creates ~/.ray/auth_token for it."""
        self._saved_env = saved_environ(AUTH_ENV)
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        _reload_ray_auth()

    def _explain(self, exc: BaseException) -> str:
        """One line for what ray.init (or the first calls after it) raised."""
        chain = _chain(exc)
        text = " ".join(str(e) for e in chain) + " " + self._messages.text()
        if any(type(e).__name__ == "AuthenticationError" for e in chain) or "InvalidAuthToken" in text:
            return f"the cluster refused this driver's token (InvalidAuthToken); {AUTH_HINT}"
        if self.address == "auto" and "Could not find any running Ray instance" in text:
            return ("no Ray cluster runs on this machine: start one (ray start --head), give the address of one "
                    "(--ray HOST:PORT, RAY_ADDRESS), or run a private one for this run (--ray local)")
        what = "cannot start a private Ray cluster here" if self.address == LOCAL else "cannot join the cluster"
        return f"{what}: {type(exc).__name__}: {_first_line(exc)}"

    def _failed(self, why: str, *, last_message: bool = False) -> str:
        self._messages.keep = self._keep_private_dir = True
        last = self._messages.last() if last_message else ""
        said = f"Ray's last message: {last}; all in" if last else "Ray's messages:"
        return f"--ray {self.address}: {why} ({said} {self._messages.path})"

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
        head = _HeadProbe(self._gcs)
        try:
            while queue or pending:
                while queue and len(pending) < window:
                    index, path = queue.pop()
                    pending[remote.remote(os.path.abspath(path), task_options, self.replay)] = (index, path)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_SLICE_S)
                if head.lost():
                    self._lost = True
                    raise BackendUnavailable(
                        f"--ray {self.address}: the cluster's head (GCS at {self._gcs}) stopped answering; "
                        f"{len(pending) + len(queue)} file(s) were not replayed (--resume continues them)")
                if not ready:
                    if time.monotonic() - last_progress > self.stall_timeout:
                        self._check_placeable(kind, need, len(pending) + len(queue))
                        last_progress = time.monotonic()
                    continue
                last_progress = time.monotonic()
                for ref in ready:
                    index, path = pending.pop(ref)
                    try:
                        yield from self._collect(ref, index, path)
                    except _NodeLost as lost:
                        self._lost = True
                        raise BackendUnavailable(
                            f"--ray {self.address}: the Ray node of this machine died ({lost}); "
                            f"{len(pending) + len(queue) + 1} file(s) were not replayed (--resume continues them)"
                        ) from None
        finally:
            if pending and not self._lost:  # a lost head answers no cancel; close() ends the tasks anyway
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
        except errors.LocalRayletDiedError as exc:
            # The raylet this driver submits through (the private cluster's only one, with --ray local) is gone:
            # no task can run or be retried any more. Ray's failure, not the file's: the run stops (exit 2).
            raise _NodeLost(f"{type(exc).__name__}: {_first_line(exc)}") from None
        except (errors.WorkerCrashedError, errors.NodeDiedError, errors.OutOfMemoryError) as exc:
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

    def close(self, wait: bool = True) -> None:
        """Leave the cluster (a private one ends); bounded. Restores stdout and what --ray local set in the
        environment. ``wait=False`` when joining failed: an init still running is not waited for."""
        thread, self._thread = self._thread, None
        messages = self._messages
        wedged = False
        try:
            if thread is not None:
                thread.tree |= _tree(thread.started)  # while the raylet lives: its workers and agents below it
                if self._lost:
                    # A private cluster that lost its head or its raylet cannot be shut down by Ray (the
                    # driver's part waits on them, and on workers that will never answer): ended first.
                    _kill_survivors(thread.tree)
                # A lost head answers nothing: Ray's shutdown waits on it (the driver's part) before it ends the
                # processes, so it gets less time; a join that failed leaves an init that may never return.
                timeout = LOST_CLOSE_TIMEOUT_S if self._lost else CLOSE_TIMEOUT_S
                with messages.captured() if messages is not None else contextlib.nullcontext():
                    wedged = not thread.stop(timeout if wait or thread.ready.is_set() else 1.0)
        finally:
            if thread is not None and thread.tree:
                # What ray.shutdown did not end (all of it when it could not run; without a GCS, the raylet's
                # agents, which Ray renames: nothing in /proc says which cluster they are of) is ended here.
                _kill_survivors(thread.tree)
            if self._private_dir is not None:
                if not self._keep_private_dir:
                    shutil.rmtree(self._private_dir, ignore_errors=True)
                self._private_dir = None
            if self._saved_env is not None:
                restore_environ(self._saved_env)
                self._saved_env = None
                _reload_ray_auth()
            if self._stdout is not None:
                sys.stdout, self._stdout = self._stdout, None
            if messages is not None:
                messages.remove()
            if wedged:
                _abandon_ray(self.ray)


class _FirstLines(io.TextIOBase):
    """Writes the lines it is given to ``target``, less the indented ones (the detail below a message)."""

    def __init__(self, target):
        self.target, self._partial = target, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        shown = [line for line in lines if line.strip() and not line[:1].isspace()]
        if shown:
            self.target.write("\n".join(shown) + "\n")
            self.target.flush()
        return len(text)

    def flush(self) -> None:
        self.target.flush()


class _NodeLost(Exception):
    """The driver's own Ray node died (LocalRayletDiedError)."""


class _RayThread:
    """``ray.init`` and the first questions to the cluster, in a thread that lives until :meth:`stop`: the
    processes of a private cluster die with the thread that started them (``PR_SET_PDEATHSIG``)."""

    def __init__(self, ray, address: str, gcs_check: tuple[str, int] | None, temp_dir: str | None = None):
        self.ray, self.address, self.gcs_check, self.temp_dir = ray, address, gcs_check, temp_dir
        self.ready, self._stop = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.resources: dict[str, float] = {}
        self.nodes = 0
        self.gcs_address: str | None = None
        self.started: list[int] = []  # --ray local: the processes ray.init started (GCS, raylet, ...)
        self.tree: set[tuple[int, int]] = set()  # ...and those below them, as (pid, start time)
        self._thread = threading.Thread(target=self._main, name="kvdbg-ray", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        ray = self.ray
        before = set(_children(os.getpid())) if self.address == LOCAL else None
        try:
            try:
                if self.gcs_check is not None:
                    _check_token(ray, self.gcs_check)
                extra: dict[str, Any] = {}
                if self.address == LOCAL:
                    extra["include_dashboard"] = False
                    if self.temp_dir is not None:
                        extra["_temp_dir"] = self.temp_dir
                try:
                    ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False,
                             configure_logging=True, **extra)
                finally:
                    if before is not None:
                        self.started = sorted(set(_children(os.getpid())) - before)
                        self.tree = _tree(self.started)
                self.resources = dict(ray.cluster_resources())
                self.nodes = len([n for n in ray.nodes() if n.get("Alive")])
                self.gcs_address = ray.get_runtime_context().gcs_address
            except BaseException as exc:  # reported by the connecting thread
                self.error = exc
            self.ready.set()
            self._stop.wait()
        finally:
            try:
                ray.shutdown()
            except BaseException:
                pass

    def stop(self, timeout: float) -> bool:
        """Whether the thread ended (ray.shutdown returned) within ``timeout``."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()


class _HeadProbe:
    """Whether the head's GCS port still accepts connections, checked every GCS_PROBE_EVERY_S: lost after
    GCS_LOST_AFTER failures in a row (Ray's own client waits 60 s, then ends the process with exit 1)."""

    def __init__(self, gcs_address: str | None):
        self.target = _address_port(gcs_address) if gcs_address else None
        self.next = time.monotonic() + GCS_PROBE_EVERY_S
        self.failures = 0

    def lost(self) -> bool:
        if self.target is None or time.monotonic() < self.next:
            return False
        try:
            socket.create_connection(self.target, timeout=GCS_PROBE_TIMEOUT_S).close()
            self.failures = 0
        except OSError:
            self.failures += 1
        self.next = time.monotonic() + GCS_PROBE_EVERY_S
        return self.failures >= GCS_LOST_AFTER


class _RayMessages:
    """A file for what Ray writes to file descriptor 2 (its C++ core logs there directly, bypassing
    sys.stderr) while this driver joins or leaves the cluster; removed unless an error names it."""

    def __init__(self, path: str | None):
        self.path, self.keep = path, False

    @classmethod
    def discard(cls) -> "_RayMessages":
        messages = cls(os.devnull)
        messages.keep = True
        return messages

    @classmethod
    def create(cls, directory: str | None = None) -> "_RayMessages":
        """In ``directory`` (a private cluster's, beside Ray's own logs), else a temporary file of its own."""
        try:
            if directory is not None:
                path = os.path.join(directory, "kvdbg-driver-stderr.log")
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            else:
                fd, path = tempfile.mkstemp(prefix="kvdbg-ray-", suffix=".log")
                os.close(fd)
        except OSError:
            return cls(None)
        return cls(path)

    @contextlib.contextmanager
    def captured(self):
        saved = None
        if self.path is not None:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            try:
                target = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            except OSError:
                target = None
            if target is not None:
                try:
                    saved = os.dup(2)
                    os.dup2(target, 2)
                except OSError:
                    if saved is not None:
                        os.close(saved)
                    saved = None
                finally:
                    os.close(target)
        try:
            yield
        finally:
            if saved is not None:
                try:
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
                os.dup2(saved, 2)
                os.close(saved)

    def text(self) -> str:
        if self.path is None:
            return ""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.path) - 65536))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def last(self) -> str:
        """Ray's last message, without its time and source prefix (``[date time W pid tid] file.cc:210: ``)."""
        lines = [line.strip() for line in self.text().splitlines() if line.strip()]
        if not lines:
            return ""
        text = re.sub(r"^\[[^\]]*\]\s*(?:\S+:\d+:\s*)?", "", lines[-1])
        return " ".join(text.split())[:200]

    def remove(self) -> None:
        if self.path is not None and not self.keep:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _check_token(ray, target: tuple[str, int]) -> None:
    """Ask the head for its cluster id once: a token it refuses is an AuthenticationError at once, where
    ray.init would retry for about 20 s (one message a second) before saying only that it could not connect.
    Any other answer is left to ray.init."""
    try:
        from ray._raylet import GcsClient
    except ImportError:
        return
    try:
        GcsClient(address=f"{target[0]}:{target[1]}")
    except ray.exceptions.AuthenticationError:
        raise
    except Exception:
        pass


def _private_dir() -> str | None:
    """A directory of its own for a private cluster, where Ray would put its default one (RAY_TMPDIR, TMPDIR,
    /tmp): short, for Ray's sockets below it (107 bytes a path); removed by close()."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    try:
        return tempfile.mkdtemp(prefix="kvdbg-", dir=base or "/tmp")
    except OSError:
        return None  # Ray's own default, then


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc; elsewhere none)."""
    if not os.path.isdir("/proc"):
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _parent(int(entry)) == pid:
            found.append(int(entry))
    return found


def _parent(pid: int) -> int | None:
    stat = _stat(pid)
    return int(stat[1]) if stat else None


def _stat(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (state, parent, ...; the start time is [19])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields if len(fields) > 19 else None
    except (OSError, IndexError):
        return None


def _tree(roots: list[int]) -> set[tuple[int, int]]:
    """Each of ``roots`` that is still a child of this process, and everything below it, as (pid, start time)."""
    me = os.getpid()
    found, todo = set(), [pid for pid in roots if _parent(pid) == me]
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        if stat is not None:
            found.add((pid, int(stat[19])))
            todo += _children(pid)
    return found


def _kill_survivors(tree: set[tuple[int, int]]) -> None:
    """SIGKILL each process of ``tree`` still running (the same process: same start time)."""
    for pid, started in tree:
        stat = _stat(pid)
        if stat is None or int(stat[19]) != started or stat[0] == b"Z":
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _abandon_ray(ray) -> None:
    """Ray's core could not be shut down in time (an init or a shutdown that did not return): it runs on, in a
    thread of this process, until the process ends. Keep it from deciding how it ends: its atexit hook would wait
    for it (then Ray's client ends the process, exit 1, 60 s after its GCS went), what it writes to fd 2 would
    follow kvdbg's one-line error, and the interpreter's own ending can crash in its torn-down core (SIGSEGV)."""
    _forget_ray_at_exit(ray)
    _leave_fd2_to_ray()
    _exit_at_once()


def _exit_at_once() -> None:
    """sys.exit(code), from now on: flush, then end the process with that code (os._exit), not the
    interpreter's ending."""

    def exit_now(code=0):
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code or 0)

    sys.exit = exit_now


def _leave_fd2_to_ray() -> None:
    """From now on file descriptor 2, where Ray's core writes (a task it gave up on, a GCS it cannot reach), goes
    nowhere, and sys.stderr, where kvdbg writes (its one-line error comes next), to what fd 2 was."""
    try:
        sys.stderr.flush()
        encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
        kept = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        sys.stderr = io.TextIOWrapper(io.FileIO(kept, "w"), encoding=encoding, errors="backslashreplace",
                                      line_buffering=True)
    except (OSError, ValueError, AttributeError):
        pass


def _forget_ray_at_exit(ray) -> None:
    """Ray wedged (an init or shutdown that did not return in time): its own atexit hook, ray.shutdown, would
    wait for it (one lock) until Ray's client ends the process after 60 s without its GCS, with exit 1."""
    import atexit

    try:
        atexit.unregister(ray.shutdown)
    except Exception:
        pass


def _reload_ray_auth() -> None:
    """Make this process's Ray read RAY_AUTH_MODE and the token again after os.environ changed: it caches
    both (its own ray.init does the same when it turns token authentication on)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    try:
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:
        pass


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen and len(seen) < 10:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join((text.splitlines()[0] if text else type(exc).__name__).split())[:300]


__all__ = ["INSTALL_HINT", "LOCAL", "MAX_RETRIES", "RayPool", "import_ray"]
