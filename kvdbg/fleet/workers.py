"""Worker processes of `kvdbg replay DIR --jobs N` on this machine: which device each gets, and a pool that
survives a worker's death.

**Which device.** :func:`plan_workers` is a pure function of the device asked
for, --jobs and the GPUs visible: on ``--device cuda`` every visible GPU gets
``--jobs`` workers (default :func:`default_per_gpu`), interleaved so that a
short list of files is spread over the GPUs first; ``--device cuda:N`` puts
them all on GPU N; on ``cpu`` there are ``--jobs`` workers, each with an equal
share of the cores as torch threads.

A GPU worker is pinned by ``CUDA_VISIBLE_DEVICES`` set in its environment when
it is started (before it can import torch), not by ``torch.cuda.set_device``:
the worker then sees one GPU, so everything that runs on "the" GPU -- torch's
default device, Triton launches, torch.compile's kernels, a library that says
``cuda:0`` -- runs on its GPU; no CUDA context is ever made on the others (each
costs memory and start-up time); and it is what Ray does for a task with
``num_gpus``, so the same replay runs under ``--jobs`` and under ``--ray``
with the device ``cuda``.

**The pool.** Each worker takes one file at a time over its own pipe, so the
parent always knows which file a worker holds. When a worker process dies (a
kill, the OOM killer, a crash in a kernel), its file is given to a fresh
worker on the same device once more; a file whose worker dies twice becomes a
row saying so. Nothing else is lost: other workers go on. A pool of
``multiprocessing.Pool`` hangs when a worker dies, and ``ProcessPoolExecutor``
fails every file in flight without saying which one killed it.

No torch here: the parent only schedules (torch is imported to count GPUs only
for ``--device cuda``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvdbg.replayer.batch import BatchOptions, FileResult, replay_file
from kvdbg.errors import BackendUnavailable, OptionError
from kvdbg.fleet.results import Placement, died_result
from kvdbg.util.environ import restore_environ, saved_environ

# A file is started at most this often: once, and once more on a fresh worker if the first one died.
MAX_ATTEMPTS = 2

# How long the parent waits for workers to leave after the last file (then it terminates them).
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WorkerSlot:
    """One worker: the device it replays on, and how it is pinned there."""

    index: int
    device: str  # as the user names it: "cpu", "cuda:1" (this machine's numbering)
    visible: str | None = None  # the CUDA_VISIBLE_DEVICES entry of its GPU (None: cpu)
    threads: int | None = None  # torch CPU threads (None: torch's default)

    @property
    def env(self) -> dict[str, str]:
        """Set in the worker's environment before it starts: its GPU, and its share of the cores as torch's
        threads (read when the worker first imports torch; an OMP_NUM_THREADS of the user's own stays)."""
        env = {} if self.visible is None else {"CUDA_VISIBLE_DEVICES": self.visible}
        if self.threads is not None and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    @property
    def pinned_device(self) -> str:
        """The device string a pinned worker replays on: it sees its GPU alone, as ``cuda``."""
        return "cpu" if self.visible is None else "cuda"


def default_per_gpu(cpu_count: int, gpus: int) -> int:
    """Workers per GPU when --jobs is not given: two, so one prepares its next file (load, page map, Python)
    while the other's kernels run; one where the cores are fewer than two per GPU."""
    return max(1, min(2, cpu_count // max(gpus, 1)))


def visible_gpus(count: int, environ: dict[str, str] | None = None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each of the ``count`` GPUs torch sees, in torch's order.

    Entries are kept as written (indices, ``GPU-<uuid>``, ``MIG-<uuid>``), so a
    worker is pinned to the very GPU the parent calls ``cuda:i``.
    """
    environ = os.environ if environ is None else environ
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(count)]
    entries = [e.strip() for e in given.split(",") if e.strip()]
    return entries[:count]


def plan_workers(device: str, jobs: int | None, gpus: list[str], cpu_count: int) -> list[WorkerSlot]:
    """The workers of a run: ``device`` as given (cpu, cuda, cuda:N, auto), --jobs (None: the default),
    ``gpus`` from :func:`visible_gpus`. Raises OptionError / BackendUnavailable in the words of --device."""
    if jobs is not None and jobs < 1:
        raise OptionError(f"--jobs must be at least 1, got {jobs}")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cpu":
        count = jobs or 1
        threads = max(1, cpu_count // count) if count > 1 else None
        return [WorkerSlot(i, "cpu", None, threads) for i in range(count)]
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise OptionError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if not gpus:
        raise BackendUnavailable(f"--device {device}: no CUDA device is visible")
    if match.group(1) is not None:
        index = int(match.group(1))
        if index >= len(gpus):
            raise OptionError(f"--device {device}: only {len(gpus)} CUDA device(s) are visible "
                              f"(cuda:0 to cuda:{len(gpus) - 1})")
        chosen = [index]
    else:
        chosen = list(range(len(gpus)))
    per_gpu = jobs or default_per_gpu(cpu_count, len(chosen))
    total = per_gpu * len(chosen)
    threads = max(1, cpu_count // total)
    # Interleaved (cuda:0, cuda:1, ..., cuda:0, ...): the first files go to every GPU before any gets two.
    order = [g for _ in range(per_gpu) for g in chosen]
    return [WorkerSlot(i, f"cuda:{g}", gpus[g], threads) for i, g in enumerate(order)]


def cuda_count() -> int:
    """GPUs torch sees here (imports torch; counting does not create a CUDA context)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(device: str) -> bool:
    return device.startswith("cuda") or device == "auto"


# --------------------------------------------------------------------------- events every executor reports


@dataclass
class Started:
    """A file was handed to a worker (``pid``; ``attempt`` 2 when its first worker died)."""

    index: int
    placement: Placement
    attempt: int


@dataclass
class Done:
    """A file's result. ``attempts`` None when the executor does not know (Ray retries by itself)."""

    index: int
    result: FileResult
    placement: Placement | None
    attempts: int | None


@dataclass
class WorkerLost:
    """A worker process died; ``index`` the file it held (None: it held none), ``retried`` whether that file
    goes to a fresh worker."""

    placement: Placement
    how: str
    index: int | None
    retried: bool


Replay = Callable[[str, BatchOptions], FileResult]


# --------------------------------------------------------------------------- one process


def run_in_process(tasks: list[tuple[int, str]], options: BatchOptions, slot: WorkerSlot,
                   replay: Replay = replay_file) -> Iterator[Started | Done]:
    """One worker: the files replayed here, one after the other, on ``slot``'s GPU named as this process sees
    it (``cuda:N``; no pinning)."""
    from dataclasses import replace

    device = slot.device
    here = replace(options, device=device)
    placement = Placement(device)
    for index, path in tasks:
        yield Started(index, placement, 1)
        yield Done(index, replay(path, here), placement, 1)


# --------------------------------------------------------------------------- the pool


def _worker_main(conn, env: dict[str, str], options: BatchOptions, replay: Replay) -> None:
    """A worker process: replay each (index, path) received until None; Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    os.environ.update(env)  # already set at spawn (torch is imported later, by the first replay)
    pid = os.getpid()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if task is None:
            break
        index, path = task
        result = replay(path, options)
        try:
            conn.send((index, result, pid))
        except (BrokenPipeError, OSError):
            break
    # Every result is in the parent already: leave without the interpreter's teardown, which takes seconds
    # once torch is loaded (on a busy machine, longer than the last file).
    conn.close()
    os._exit(0)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the parent dies, so that a killed run leaves no worker replaying on."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(eq=False)  # compared by identity: a restarted slot is another worker
class _Worker:
    slot: WorkerSlot
    process: object
    conn: object
    task: tuple[int, str] | None = None  # the file it holds

    @property
    def placement(self) -> Placement:
        return Placement(self.slot.device, self.process.pid)


class LocalPool:
    """Worker processes on this machine, one per slot; see the module doc."""

    def __init__(self, slots: list[WorkerSlot], options: BatchOptions, *, replay: Replay = replay_file):
        self.slots, self.options, self.replay = slots, options, replay
        import multiprocessing

        # Fresh interpreters (spawn): a fork of a process that may hold torch's thread pools or a CUDA
        # context can deadlock, and a spawned worker can be pinned before it imports torch.
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []

    def _start(self, slot: WorkerSlot) -> _Worker:
        options = _with_device(self.options, slot.pinned_device)
        process, conn = start_worker(self._context, _worker_main, f"kvdbg-worker-{slot.index}", slot.env,
                                     options, self.replay)
        return _Worker(slot, process, conn)

    def run(self, tasks: list[tuple[int, str]]) -> Iterator[Started | Done | WorkerLost]:
        """Events as files start and finish; the workers are stopped when the iterator ends or is closed.

        A worker that returns a result is given its next file before the result is reported, so that it
        replays while the caller writes the row (an fsync) and draws the progress.
        """
        from multiprocessing.connection import wait

        queue = deque(tasks)
        attempts: dict[int, int] = {}
        if not tasks:
            return
        try:
            self._workers = [self._start(slot) for slot in self.slots[:min(len(self.slots), len(tasks))]]
            yield from self._assign(queue, attempts)
            while queue or any(w.task is not None for w in self._workers):
                events: list[Started | Done | WorkerLost] = []
                busy = {w.conn: w for w in self._workers if w.task is not None}
                sentinels = {w.process.sentinel: w for w in self._workers}
                for ready in wait([*busy, *sentinels], timeout=1.0):
                    worker = busy.get(ready) or sentinels[ready]
                    if worker not in self._workers:
                        continue  # both its pipe and its sentinel were ready, and it was handled
                    if worker.task is not None:
                        done = self._receive(worker, attempts)
                        if done is not None:
                            events.append(done)
                    if not worker.process.is_alive():
                        events.extend(self._lost(worker, queue, attempts))
                events.extend(self._assign(queue, attempts))
                yield from events
        finally:
            self._stop()

    def _assign(self, queue: deque, attempts: dict[int, int]) -> list[Started]:
        """The next files to the idle workers (one each)."""
        started = []
        for worker in self._workers:
            if worker.task is None and queue and worker.process.is_alive():
                task = queue.popleft()
                attempts[task[0]] = attempts.get(task[0], 0) + 1
                worker.task = task
                try:
                    worker.conn.send(task)
                except (BrokenPipeError, OSError):
                    pass  # it died: its sentinel says so, and the file goes back
                started.append(Started(task[0], worker.placement, attempts[task[0]]))
        return started

    def _receive(self, worker: _Worker, attempts: dict[int, int]) -> Done | None:
        """The worker's result if one is waiting (also when it died just after sending it)."""
        try:
            if not worker.conn.poll():
                return None
            index, result, pid = worker.conn.recv()
        except (EOFError, OSError):
            return None
        worker.task = None
        return Done(index, result, Placement(worker.slot.device, pid), attempts.get(index))

    def _lost(self, worker: _Worker, queue: deque, attempts: dict[int, int]) -> Iterator[WorkerLost | Done]:
        """A dead worker: give its file to a fresh worker once more, or report it; restart the slot."""
        worker.process.join(timeout=1.0)
        how = _exit_how(worker.process.exitcode)
        placement = worker.placement
        worker.conn.close()
        task, worker.task = worker.task, None
        retried = task is not None and attempts[task[0]] < MAX_ATTEMPTS
        yield WorkerLost(placement, how, None if task is None else task[0], retried)
        if task is not None:
            if retried:
                queue.appendleft(task)  # next, on the first free worker
            else:
                yield Done(task[0], died_result(task[1], how, retried=attempts[task[0]] > 1), placement,
                           attempts[task[0]])
        position = self._workers.index(worker)
        if queue:
            self._workers[position] = self._start(worker.slot)
        else:
            del self._workers[position]

    def _stop(self) -> None:
        stop_workers(self._workers, idle=lambda worker: worker.task is None)
        self._workers = []

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids (for a test that kills one)."""
        return [w.process.pid for w in self._workers if w.process.is_alive()]


def start_worker(context, target, name: str, env: dict[str, str], *args) -> tuple[Any, Any]:
    """A worker process ``target(conn, env, *args)`` started in ``context`` with ``env`` in its environment from
    its first instruction (set in this process around the start, then put back); (process, the parent's end of
    its pipe)."""
    parent_end, child_end = context.Pipe(duplex=True)
    process = context.Process(target=target, name=name, args=(child_end, env, *args), daemon=True)
    saved = saved_environ(env)
    os.environ.update(env)  # the child's environment is the parent's at start
    try:
        process.start()
    finally:
        restore_environ(saved)
    child_end.close()
    return process, parent_end


def stop_workers(workers: list, idle: Callable[[Any], bool]) -> None:
    """Stop worker processes (each with ``process`` and ``conn``): None on every pipe (leave), then each joined --
    for up to STOP_TIMEOUT_S where ``idle(worker)``, at once otherwise -- terminated, and killed if it still runs."""
    for worker in workers:
        try:
            worker.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
    for worker in workers:
        worker.process.join(timeout=STOP_TIMEOUT_S if idle(worker) else 0)
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(timeout=STOP_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()


def _exit_how(code: int | None) -> str:
    """``killed by SIGKILL``, ``exit code 1``: how a worker process ended."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "still running" if code is None else f"exit code {code}"


def _with_device(options: BatchOptions, device: str) -> BatchOptions:
    from dataclasses import replace

    return replace(options, device=device)


__all__ = ["Done", "LocalPool", "MAX_ATTEMPTS", "Started", "WorkerLost", "WorkerSlot", "cuda_count", "default_per_gpu",
           "needs_gpus", "plan_workers", "run_in_process", "visible_gpus"]
