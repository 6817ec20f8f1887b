"""One run of `kvdbg replay DIR|FILES...` over many snapshots: where each file runs, what is kept, what is said.

:func:`run_fleet` takes the files, skips those a results file already holds
(``--resume``), hands the others to an executor -- this process, worker
processes on this machine's CPUs or GPUs (kvdbg.fleet.workers), or Ray tasks on a
cluster (kvdbg.fleet.ray_executor) -- and, as each file finishes, appends its row to
the results file (kvdbg.fleet.results) and reports progress. It returns every row in
the order of the files, the overall verdict (kvdbg.replayer.batch's rule), the failing
rows grouped by signature (kvdbg.fleet.triage) and how many files each device
replayed. The same files with the same options give the same rows whichever
executor ran them.

No torch here (the executors import it where they replay).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kvdbg._version import __version__
from kvdbg.replayer.batch import BatchOptions, BatchResult, batch_verdict, replay_file
from kvdbg.util.atomic import check_output
from kvdbg.errors import KvdbgError, OptionError
from kvdbg.fleet.results import (FileKey, ResultsError, ResultsWriter, Row, check_same_options, end_record, now,
                           options_record, read_results, row_record, run_record)
from kvdbg.fleet.triage import Triage, signature, triage
from kvdbg.fleet.workers import Done, Replay, WorkerLost


class Progress(Protocol):
    """What a run reports while it works (the CLI draws a bar on stderr)."""

    def begin(self, total: int, skipped: int, how: str) -> None: ...

    def row(self, row: Row, done: int, total: int) -> None: ...

    def note(self, text: str) -> None: ...

    def end(self) -> None: ...


@dataclass
class DeviceCount:
    """Files one device replayed in this run (rows taken from a results file are not counted)."""

    device: str  # "cpu", "cuda:1", on Ray "10.0.0.7 cuda:0"
    files: int
    workers: int  # distinct worker processes seen (a restarted worker counts again)
    seconds: float  # summed replay time of its files

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "files": self.files, "workers": self.workers, "seconds": self.seconds}


@dataclass
class FleetResult:
    batch: BatchResult  # files in the order given, the exit code and the verdict line
    rows: list[Row]
    triage: Triage
    devices: list[DeviceCount]
    executor: dict[str, Any]
    resumed: int = 0  # rows taken from the results file, not replayed again
    lost: list[WorkerLost] = field(default_factory=list)
    wall_s: float = 0.0
    results: str | None = None

    @property
    def replayed(self) -> int:
        return len(self.rows) - self.resumed

    def to_json(self) -> dict[str, Any]:
        return {"executor": self.executor, "devices": [d.to_json() for d in self.devices],
                "replayed": self.replayed, "resumed": self.resumed,
                "workers_lost": [{"device": w.placement.label(), "pid": w.placement.pid, "how": w.how,
                                  "file": None if w.index is None else self.rows[w.index].path,
                                  "retried": w.retried} for w in self.lost],
                "wall_s": self.wall_s, "files_per_s": self.replayed / self.wall_s if self.wall_s > 0 else None,
                "results": self.results}


def header_facts(path: str) -> tuple[list[int], int | None]:
    """(ranks, engine step) the capture recorded in the file's header; ([], None) when it says nothing or the
    file is not readable (its replay says why)."""
    from kvdbg.snapshot.format import read_header

    try:
        capture = read_header(path).meta.capture
    except (KvdbgError, OSError, MemoryError):
        return [], None
    rank, step = capture.get("rank"), capture.get("step")
    ranks = [rank] if isinstance(rank, int) and not isinstance(rank, bool) else []
    return ranks, step if isinstance(step, int) and not isinstance(step, bool) else None


def run_fleet(paths: list[str], options: BatchOptions, *, jobs: int | None = None, ray: str | None = None,
              use_ray: bool = False, results: str | None = None, resume: bool = False, overwrite: bool = False,
              progress: Progress | None = None, on_event: Callable[[Any], None] | None = None,
              replay: Replay = replay_file) -> FleetResult:
    """Replay ``paths``; see the module doc. ``use_ray`` with ``ray`` the address (None: RAY_ADDRESS or the
    cluster started on this machine). ``on_event`` sees every executor event (a test kills a worker on one)."""
    if resume and not results:
        raise OptionError("--resume needs --results FILE (the file whose rows it keeps)")
    if results:
        try:
            check_output(results, overwrite=resume or overwrite, what="--results",
                         exists="--resume continues it, --force starts it over")
        except OptionError as exc:
            raise ResultsError(str(exc)) from None
    started = time.perf_counter()
    executor, info, device_kind = _executor(options, jobs=jobs, ray=ray, use_ray=use_ray, replay=replay)
    try:
        return _run(paths, options, executor, info, device_kind, results=results, resume=resume,
                    overwrite=overwrite, progress=progress, on_event=on_event, started=started)
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            close()


def _executor(options: BatchOptions, *, jobs, ray, use_ray, replay):
    """(executor, what it is for the summary, the device kind the verdicts are judged on)."""
    if use_ray:
        from kvdbg.fleet.ray_executor import RayPool

        if jobs is not None and not options.device.startswith("cuda") and options.device != "auto":
            raise OptionError("--jobs with --ray counts tasks per GPU (--device cuda); on CPUs every task takes "
                              "one CPU of the cluster, as many at once as it has")
        pool = RayPool(ray, options, per_gpu=jobs, replay=replay)
        info = pool.connect()
        return pool, info, "cuda" if pool.device.startswith("cuda") else "cpu"
    from kvdbg.fleet.workers import LocalPool, cuda_count, needs_gpus, plan_workers, visible_gpus

    gpus = visible_gpus(cuda_count()) if needs_gpus(options.device) else []
    slots = plan_workers(options.device, jobs, gpus, os.cpu_count() or 1)
    per_device: dict[str, int] = {}
    for slot in slots:
        per_device[slot.device] = per_device.get(slot.device, 0) + 1
    info = {"kind": "jobs", "workers": len(slots), "per_device": per_device,
            "pinning": "CUDA_VISIBLE_DEVICES" if slots[0].visible is not None and len(slots) > 1 else None}
    kind = "cpu" if slots[0].device == "cpu" else "cuda"
    if len(slots) == 1:
        return _InProcess(slots[0], options, replay), info, kind
    return LocalPool(slots, options, replay=replay), info, kind


class _InProcess:
    def __init__(self, slot, options: BatchOptions, replay: Replay):
        self.slot, self.options, self.replay = slot, options, replay

    def run(self, tasks):
        from kvdbg.fleet.workers import run_in_process

        return run_in_process(tasks, self.options, self.slot, self.replay)


def _run(paths, options, executor, info, device_kind, *, results, resume, overwrite, progress, on_event,
         started) -> FleetResult:
    keys = [FileKey.of(p) for p in paths]
    stored = options_record(options, device_kind)
    kept: dict[int, Row] = {}
    writer = None
    if results:
        if resume and os.path.exists(results):
            previous = read_results(results)
            check_same_options(previous.options, stored, results)
            done = previous.done()
            for i, key in enumerate(keys):
                row = done.get(key.path)
                if row is not None and len(row.files) == 1 and row.files[0] == key:
                    row.path = row.result.path = paths[i]
                    kept[i] = row
            writer = ResultsWriter.open(results)
        tasks = [(i, p) for i, p in enumerate(paths) if i not in kept]
        first = run_record(stored, planned=len(paths), skipped=len(kept), executor=info,
                           resumed=writer is not None)
        if writer is None:
            writer = ResultsWriter.create(results, first, overwrite=overwrite)
        else:
            writer.write(first)
    else:
        tasks = list(enumerate(paths))
    facts = {i: header_facts(p) for i, p in tasks}
    rows: dict[int, Row] = dict(kept)
    lost: list[WorkerLost] = []
    how = _describe(info)
    if progress is not None:
        progress.begin(len(tasks), len(kept), how)
    finished = False
    try:
        done_count = 0
        for event in executor.run(tasks):
            if on_event is not None:
                on_event(event)
            if isinstance(event, WorkerLost):
                lost.append(event)
                if progress is not None:
                    what = "" if event.index is None else f" replaying {paths[event.index]}"
                    again = "; it is replayed again" if event.retried else ""
                    progress.note(f"worker {event.placement.pid or ''} on {event.placement.label()} died "
                                  f"({event.how}){what}{again}")
                continue
            if not isinstance(event, Done):
                continue
            if event.placement is not None and event.placement.kvdbg != __version__:
                raise OptionError(f"a Ray worker at {event.placement.label()} runs kvdbg {event.placement.kvdbg}, "
                                  f"this driver {__version__}: install the same kvdbg on every node")
            ranks, step = facts[event.index]
            row = Row(path=paths[event.index], files=[keys[event.index]], result=event.result, ranks=ranks,
                      step=step, placement=event.placement, attempts=event.attempts, finished=now())
            rows[event.index] = row
            if writer is not None:
                sig = signature(row.result)
                writer.write(row_record(row, None if sig is None else sig.to_json()))
            done_count += 1
            if progress is not None:
                progress.row(row, done_count, len(tasks))
        finished = True
    finally:
        if progress is not None:
            progress.end()
        if writer is not None:
            ordered = [rows[i] for i in sorted(rows)]
            code = batch_verdict([r.result for r in ordered])[0] if finished else None
            try:
                writer.write(end_record(rows=len(rows), exit_code=code, interrupted=not finished))
            finally:
                writer.close()
    ordered = [rows[i] for i in range(len(paths))]
    files = [r.result for r in ordered]
    code, summary = batch_verdict(files)
    return FleetResult(BatchResult(files, code, summary), ordered, triage(ordered, stored),
                       device_counts(r for i, r in rows.items() if i not in kept), info, resumed=len(kept),
                       lost=lost, wall_s=time.perf_counter() - started, results=results)


def device_counts(rows) -> list[DeviceCount]:
    """Files per device, in device order (``cuda:2`` before ``cuda:10``); Ray nodes sharing an address are
    told apart by their node id."""
    rows = [r for r in rows if r.placement is not None]
    ips: dict[str, set[str]] = {}
    for r in rows:
        if r.placement.node_ip is not None:
            ips.setdefault(r.placement.node_ip, set()).add(r.placement.node_id or "")
    counts: dict[str, DeviceCount] = {}
    pids: dict[str, set[int | None]] = {}
    for r in rows:
        p = r.placement
        label = p.label(with_node_id=p.node_ip is not None and len(ips[p.node_ip]) > 1)
        count = counts.setdefault(label, DeviceCount(label, 0, 0, 0.0))
        count.files += 1
        count.seconds += r.result.seconds
        pids.setdefault(label, set()).add(p.pid)
    for label, count in counts.items():
        count.workers = len(pids[label])

    def order(label: str):
        return [int(part) if part.isdigit() else part for part in label.replace(":", " ").replace(".", " ").split()]

    return [counts[label] for label in sorted(counts, key=order)]


def _describe(info: dict[str, Any]) -> str:
    if info.get("kind") == "ray":
        kind, need = next(iter(info["per_task"].items()))
        return (f"Ray at {info['address']}: {info['nodes']} node(s), {info['cpus']:g} CPU, {info['gpus']:g} GPU; "
                f"{need:g} {kind} per task")
    per = info.get("per_device") or {}
    if info.get("workers", 1) == 1:
        return f"in this process on {next(iter(per), 'cpu')}"
    return f"{info['workers']} worker processes: " + ", ".join(f"{d} {n}" for d, n in per.items())


__all__ = ["DeviceCount", "FleetResult", "Progress", "device_counts", "header_facts", "run_fleet"]
