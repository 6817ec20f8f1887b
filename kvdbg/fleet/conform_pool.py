"""`kvdbg conform --jobs N`: a backend's cells in N worker processes, side by side.

A conform cell is short (a synthetic step through the engine's backend and the
reference) but on a GPU its first run of each kernel variant compiles it
(Triton, FlashInfer's JIT): one CPU core busy for seconds while the GPU idles.
The cells of a matrix need dozens of variants, so one process spends most of
its time compiling, one kernel after the other. N workers compile N at a time
(Triton and FlashInfer keep their builds on disk, shared by the workers).

Each worker is a fresh interpreter (spawn) that builds one
:class:`~kvdbg.moves.conform.run.EngineRunner` and then runs one cell at a time
over its own pipe, so the parent always knows which cell a worker holds:

- a worker that dies running a cell (a crash in a kernel, the OOM killer) is
  replaced, and the cell is run once more on the fresh worker; a cell whose
  workers die twice is a FAIL that says so (a backend that kills its process on
  an input is a finding);
- after a cell whose run left the CUDA context broken (an illegal address is
  sticky: every later launch in that process fails), the worker leaves, so no
  later cell is judged in a broken context; its next cell goes to a fresh one.

Workers are placed as `kvdbg replay --jobs` places them
(:func:`kvdbg.fleet.workers.plan_workers`): pinned to their GPU by
``CUDA_VISIBLE_DEVICES`` before they import torch, or given an equal share of
the cores on a CPU.
"""

from __future__ import annotations

import os
import signal
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator, Mapping

from kvdbg.errors import BackendUnavailable
from kvdbg.fleet.workers import (WorkerSlot, _die_with_parent, _exit_how, cuda_count, plan_workers, start_worker,
                                 stop_workers, visible_gpus)
from kvdbg.moves.conform.run import FAIL, REFUSED, TRITON_F32, Outcome, engine_backend_name

MAX_ATTEMPTS = 2
MAX_GPU_JOBS = 8  # compiles at a time on one GPU host: more only queue for the cores
STOP_TIMEOUT_S = 10.0
BROKEN = "__broken__"  # what a worker sends before it leaves with a broken CUDA context


def default_jobs(device: str, cpu_count: int) -> int:
    """Workers when --jobs is not given: on a GPU one per two cores (at most 8: the compiles are what run side
    by side); on a CPU one (the CPU kernels use every core already)."""
    if device.startswith("cuda") or device == "auto":
        return max(1, min(MAX_GPU_JOBS, cpu_count // 2))
    return 1


@dataclass(frozen=True)
class RunnerArgs:
    backend: str
    device: str
    seed: int = 0
    atol: float | None = None
    rtol: float | None = None
    runner: str = "kvdbg.moves.conform.run:EngineRunner"  # module:class each worker builds (tests give others)

    def make(self):
        import importlib

        module, _, name = self.runner.partition(":")
        cls = getattr(importlib.import_module(module), name)
        return cls(self.backend, self.device, seed=self.seed, atol=self.atol, rtol=self.rtol)


def _worker_main(conn, env: dict[str, str], args: RunnerArgs) -> None:
    """A worker: build the runner, say whether it could, then run each request received until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    os.environ.update(env)
    try:
        runner = args.make()
    except BackendUnavailable as exc:
        conn.send(("unavailable", str(exc)))
        conn.close()
        os._exit(0)
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break
        if request is None:
            break
        what, row, kind, exact = request
        try:
            answer = runner.refusal(row) if what == "refusal" else runner.run(row, kind, exact=exact)
        except Exception as exc:  # a mistake of kvdbg's: the parent raises it, as a run in one process would
            answer = exc
        broken = _cuda_broken(args.device)
        try:
            conn.send_bytes(_answer_bytes(answer, broken))
        except (BrokenPipeError, OSError):
            break
        if broken:
            break
    conn.close()
    os._exit(0)  # every answer is in the parent: no interpreter teardown (seconds, once torch is loaded)


def _answer_bytes(answer, broken: str | None) -> bytes:
    """A worker's answer, pickled by value. Not as ``conn.send`` would pickle it: once torch is imported, that
    shares each tensor's memory through a file descriptor fetched from this process when the parent unpickles,
    so a worker that leaves right after its answer (a broken context) loses it, and every failing outcome the
    parent keeps holds a descriptor open per tensor of its snapshot. A mistake that cannot travel as itself
    (an unpicklable exception) travels as its type, words and traceback."""
    import pickle

    try:
        data = pickle.dumps((answer, broken), protocol=pickle.HIGHEST_PROTOCOL)
        if isinstance(answer, BaseException):
            pickle.loads(data)  # an exception whose class cannot be rebuilt from its args fails in the parent
        return data
    except Exception as exc:  # noqa: BLE001 - whatever failed, the parent must hear a mistake, not a death
        import traceback

        what = answer if isinstance(answer, BaseException) else exc
        text = "".join(traceback.format_exception(what)).rstrip()
        error = RuntimeError(f"a conform worker's answer could not be sent back ({type(exc).__name__}: {exc}):\n"
                             f"{text}")
        return pickle.dumps((error, broken), protocol=pickle.HIGHEST_PROTOCOL)


def _cuda_broken(device: str) -> str | None:
    """The CUDA error a synchronise raises now (a sticky one: the context is lost), or None."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - any error here means the context cannot be trusted
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


@dataclass(eq=False)
class _Worker:
    slot: WorkerSlot
    process: object
    conn: object
    exact: bool = False  # runs the float32 path with IEEE products (TRITON_F32_DEFAULT=ieee from its start)
    ready: bool = False
    request: tuple | None = None  # (index, request) it holds


class PooledRunner:
    """The conform runner of ``--jobs N``: an :class:`EngineRunner` in each of N worker processes.

    Same answers as one EngineRunner (each cell draws its data from its own
    seed); ``run_many`` and ``refusals`` run side by side. Use as a context
    manager (or call :meth:`close`): the workers live across the calls of one
    backend's conform, so each imports the engine once.
    """

    def __init__(self, args: RunnerArgs, jobs: int | None = None, *, exact_workers: bool | None = None):
        import multiprocessing

        self.args = args
        self.backend = engine_backend_name(args.backend)
        gpus = visible_gpus(cuda_count()) if args.device.startswith("cuda") or args.device == "auto" else []
        self.slots = plan_workers(args.device, jobs or default_jobs(args.device, os.cpu_count() or 1), gpus,
                                  os.cpu_count() or 1)
        self.jobs = len(self.slots)
        # On a GPU the float32 re-runs of failing cells go to workers of their own, started with Triton's
        # float32 dot set to IEEE: Triton keeps a kernel compiled in a process by its arguments only (not by
        # that variable), so one process cannot run both ways (kvdbg.moves.conform.run._explanation).
        self.exact_float32 = (any(s.pinned_device.startswith("cuda") for s in self.slots) if exact_workers is None
                              else exact_workers)
        # They start with the others (a worker takes ~40 s to import the engine on a fresh GPU machine: started
        # only at the first failing cell, they kept the float32 re-runs waiting 30 s there), but the pool does
        # not wait for them: they take exact requests once they have greeted.
        exact = self.slots[:max(1, len(self.slots) // 4)] if self.exact_float32 else []
        self._context = multiprocessing.get_context("spawn")
        self._no_exact: str | None = None  # why no IEEE worker could start, once none is left
        self._workers: list[_Worker] = [self._start(slot) for slot in self.slots]
        self._workers += [self._start(slot, exact=True) for slot in exact]
        self._await_ready()

    # ------------------------------------------------------------------ the runner's interface

    def refusal(self, row: Mapping[str, str]) -> str | None:
        return self.refusals([row])[0]

    def refusals(self, rows: list[Mapping[str, str]]) -> list[str | None]:
        answers = dict(self._run([("refusal", dict(row), None, False) for row in rows]))
        return [answers[i] for i in range(len(rows))]

    def run(self, row: Mapping[str, str], kind: str, exact: bool = False) -> Outcome:
        return next(iter(self.run_many([(row, kind, exact)])))[1]

    def run_many(self, requests: list[tuple[Mapping[str, str], str, bool]]) -> Iterator[tuple[tuple, Outcome]]:
        """(request, outcome) for each request, as they finish."""
        for index, outcome in self._run([("run", dict(r), k, e) for r, k, e in requests]):
            yield requests[index], outcome

    def close(self) -> None:
        # A worker busy with a cell, or still importing the engine (it reads the pipe only once it is ready), is
        # stopped at once rather than waited for.
        stop_workers(self._workers, idle=lambda worker: worker.request is None and worker.ready)
        self._workers = []

    def __enter__(self) -> "PooledRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the pool

    def _start(self, slot: WorkerSlot, exact: bool = False) -> _Worker:
        env = {**slot.env, **({TRITON_F32: "ieee"} if exact else {})}
        process, conn = start_worker(self._context, _worker_main, f"kvdbg-conform-{slot.index}", env,
                                     replace(self.args, device=slot.pinned_device))
        return _Worker(slot, process, conn, exact)

    def _await_ready(self) -> None:
        """Every worker of plain requests built its runner; the first one that could not raises its reason (as one
        run would). The IEEE workers greet later, while the cells run."""
        for worker in self._workers:
            if not worker.exact:
                self._greeting(worker)

    def _greeting(self, worker: _Worker) -> None:
        try:
            tag, reason = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)
            tag, reason = None, (f"--backend {self.backend}: a conform worker could not start "
                                 f"({_exit_how(worker.process.exitcode)})")
        if tag == "ready":
            worker.ready = True
            return
        if worker.exact:  # only the float32 re-runs need it: the cells go on, and those re-runs say why not
            self._retire(worker, reason)
            return
        self.close()
        raise BackendUnavailable(reason)

    def _retire(self, worker: _Worker, reason: str) -> None:
        """An IEEE worker that could not start leaves for good; when none is left, ``_no_exact`` says why."""
        worker.conn.close()
        worker.process.join(timeout=STOP_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        self._workers.remove(worker)
        if not any(w.exact for w in self._workers):
            self._no_exact = reason

    def _run(self, requests: list[tuple]) -> Iterator[tuple[int, object]]:
        from multiprocessing.connection import wait

        queue = deque(enumerate(requests))
        attempts: dict[int, int] = {}
        if queue and not self._workers:  # closed (by close, or by a mistake raised): nothing would ever answer
            raise RuntimeError("the conform pool is closed")
        while queue or any(w.request is not None for w in self._workers):
            if self._no_exact is not None:
                for item in [item for item in queue if item[1][3] and self.exact_float32]:
                    queue.remove(item)
                    yield item[0], Outcome(REFUSED, reason=f"no worker with IEEE float32 products "
                                                           f"({TRITON_F32}=ieee) could start: {self._no_exact}")
            self._assign(queue, attempts)
            busy = {w.conn: w for w in self._workers if w.request is not None or not w.ready}
            sentinels = {w.process.sentinel: w for w in busy.values()}
            for ready in wait([*busy, *sentinels], timeout=1.0):
                worker = busy.get(ready) or sentinels.get(ready)
                if worker is None or worker not in self._workers:
                    continue
                if not worker.ready:  # a fresh worker's greeting
                    self._greeting(worker)
                    continue
                if worker.request is None:
                    continue
                answer = self._receive(worker)
                if answer is not None:
                    index, value = answer
                    if isinstance(value, BaseException):
                        self.close()
                        raise value
                    yield index, value
                elif not worker.process.is_alive():
                    lost = self._lost(worker, queue, attempts)
                    if lost is not None:
                        yield lost

    def _assign(self, queue: deque, attempts: dict[int, int]) -> None:
        for worker in self._workers:
            if not worker.ready or worker.request is not None or not queue:
                continue
            # its own kind of request: exact ones to the IEEE workers (any worker where there are none)
            mine = next((item for item in queue if bool(item[1][3] and self.exact_float32) == worker.exact),
                        None)
            if mine is not None:
                queue.remove(mine)
                index, request = mine
                attempts[index] = attempts.get(index, 0) + 1
                worker.request = (index, request)
                try:
                    worker.conn.send(request)
                except (BrokenPipeError, OSError):
                    pass  # it died: its sentinel says so, and the request goes back

    def _receive(self, worker: _Worker) -> tuple[int, object] | None:
        import pickle

        try:
            if not worker.conn.poll():
                return None
            value, broken = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            return None
        index = worker.request[0]
        worker.request = None
        if broken:  # it leaves: a fresh worker takes its place
            self._replace(worker)
            if isinstance(value, Outcome) and value.reason is None:
                value.reason = f"the CUDA context was lost after this cell ({broken})"
        return index, value

    def _lost(self, worker: _Worker, queue: deque, attempts: dict[int, int]) -> tuple[int, object] | None:
        """A worker died holding a request: run it once more on a fresh worker, or report it."""
        worker.process.join(timeout=1.0)
        how = _exit_how(worker.process.exitcode)
        index, request = worker.request
        worker.request = None
        self._replace(worker)
        if attempts[index] < MAX_ATTEMPTS:
            queue.appendleft((index, request))
            return None
        what, row, kind, _ = request
        reason = f"the worker process died running this cell, twice ({how})"
        return index, (reason if what == "refusal" else Outcome(FAIL, reason=reason))

    def _replace(self, worker: _Worker) -> None:
        worker.conn.close()
        worker.process.join(timeout=STOP_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        self._workers[self._workers.index(worker)] = self._start(worker.slot, worker.exact)  # ready when it greets


__all__ = ["PooledRunner", "RunnerArgs", "default_jobs"]
