"""The results file of `kvdbg replay DIR --results FILE`: one strict JSON line per row, kept across runs.

A *row* is one verdict: today one snapshot file; the rank grouping of tensor
parallelism makes it the files of one step, one per rank (``files`` is a list
for that reason, and ``--resume`` counts a row done only when every file of it
is unchanged).

Lines, in the order written (docs/fleet.md has every field)::

    {"record": "run", ...}   one per invocation: options, planned files, executor
    {"record": "row", ...}   one per row, as each finishes
    {"record": "end", ...}   when the invocation ends (absent after a crash or a kill)

Each line is written with a single ``write`` on a file opened for appending and
then fsync'd, so a crash, a kill or a power cut loses at most the rows still in
flight, and can leave at most one torn line at the end (no newline), which the
reader ignores and ``--resume`` cuts off before appending.

A file is *done* for ``--resume`` when a row names its absolute path with the
same size and modification time (ns). Not a content hash: hashing reads every
byte of every snapshot again on each resume (2 GiB captures, thousands of
them), while a capture is written to a temporary name and renamed, so a file
that is captured again gets a new modification time. A file copied elsewhere
(new path) is replayed again; ``cp -p`` and ``rsync -a`` keep the time, not the
path.

No torch here: the parent of a run, and `kvdbg triage`, only read and write lines.
"""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from kvdbg._version import __version__
from kvdbg.batch import STATUS_CRASHED, BatchOptions, FileResult, Worst
from kvdbg.errors import OptionError

RESULTS_VERSION = 1
RECORD_RUN, RECORD_ROW, RECORD_END = "run", "row", "end"

# The options that decide a row's verdict: a run resumes only a file written with the same ones.
VERDICT_OPTIONS = ("backends", "steps", "device_kind", "exact", "compile", "atol", "rtol")

# A row whose worker process died on it twice (kvdbg.triage groups these apart from kvdbg's own exceptions).
WORKER_DIED = "the worker process died"


class ResultsError(OptionError):
    """The results file cannot be used (not one, written with other options, being written, unwritable)."""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


# --------------------------------------------------------------------------- what a row holds


@dataclass(frozen=True)
class FileKey:
    """One file as --resume recognises it: absolute path, size and modification time (ns)."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> "FileKey":
        """The key of ``path`` now; a file that cannot be stat'ed gets size -1 (its replay says why)."""
        absolute = os.path.abspath(path)
        try:
            st = os.stat(absolute)
        except OSError:
            return cls(absolute, -1, -1)
        return cls(absolute, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Placement:
    """Where a file was replayed: the device as the run's user names it, and, on Ray, the node."""

    device: str  # "cpu", "cuda:1" (this machine's numbering), or on Ray the node's GPU id: "cuda:3"
    pid: int | None = None  # the worker process (None: replayed in the command's own process)
    node_ip: str | None = None  # Ray only
    node_id: str | None = None  # Ray only
    kvdbg: str = __version__  # the worker's kvdbg (a Ray node may run another install)

    def label(self, *, with_node_id: bool = False) -> str:
        """``cuda:0``; on Ray ``10.0.0.7 cuda:0`` (``10.0.0.7/3fa2c1 cuda:0`` when nodes share an address)."""
        if self.node_ip is None:
            return self.device
        node = f"{self.node_ip}/{(self.node_id or '')[:6]}" if with_node_id else self.node_ip
        return f"{node} {self.device}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Row:
    """One verdict of a run: its files, what the captures say about them, the result, where it ran."""

    path: str  # as the user named it (shown); files[i].path is absolute
    files: list[FileKey]
    result: FileResult
    ranks: list[int] = field(default_factory=list)  # tensor-parallel ranks of the files (from the capture)
    step: int | None = None  # the engine's step number the capture recorded (None: not recorded)
    placement: Placement | None = None
    attempts: int | None = None  # times the file was started (2: its first worker died); None: not known (Ray)
    finished: str = ""

    @property
    def size(self) -> int:
        return sum(max(f.size, 0) for f in self.files)


def strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, so that json.dumps(allow_nan=False) holds."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def row_record(row: Row, signature: dict[str, Any] | None) -> dict[str, Any]:
    """The ``row`` line: file(s), layer, engine step, ranks, verdict, worst comparison, finding codes, timing,
    then the details (``steps`` are the snapshot's steps replayed, as in `kvdbg replay DIR --json`)."""
    r = row.result
    return strict({
        "record": RECORD_ROW,
        "path": row.path,
        "files": [asdict(f) for f in row.files],
        "layer": r.layer,
        "engine_step": row.step,
        "ranks": list(row.ranks),
        "status": r.status,
        "exit_code": r.exit_code,
        "verdict": r.summary,
        "worst": asdict(r.worst) if r.worst is not None else None,
        "error_findings": list(r.error_findings),
        "signature": signature,
        "seconds": r.seconds,
        "steps": list(r.steps),
        "comparisons": r.comparisons,
        "placement": row.placement.to_json() if row.placement is not None else None,
        "attempts": row.attempts,
        "finished": row.finished,
    })


def row_from_record(record: dict[str, Any], where: str) -> Row:
    """A row read back; ``where`` ("FILE line N") prefixes the one-line error naming a bad field."""
    try:
        worst = record["worst"]
        result = FileResult(
            path=record["path"], status=record["status"], exit_code=int(record["exit_code"]),
            layer=record.get("layer"), steps=list(record.get("steps") or []),
            worst=Worst(**worst) if worst is not None else None,
            error_findings=list(record.get("error_findings") or []), summary=record.get("verdict") or "",
            comparisons=list(record.get("comparisons") or []), seconds=float(record.get("seconds") or 0.0))
        files = [FileKey(str(f["path"]), int(f["size"]), int(f["mtime_ns"])) for f in record["files"]]
        placement = record.get("placement")
        return Row(path=record["path"], files=files, result=result, ranks=list(record.get("ranks") or []),
                   step=record.get("engine_step"), placement=Placement(**placement) if placement else None,
                   attempts=record.get("attempts"), finished=record.get("finished") or "")
    except KeyError as exc:
        raise ResultsError(f"{where}: row record has no field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ResultsError(f"{where}: malformed row record ({exc})") from None


def died_result(path: str, how: str, *, retried: bool) -> FileResult:
    """The row of a file whose worker process died under it (after the retry, when there was one)."""
    from kvdbg.verdict import EXIT_FINDING

    times = "twice (it was retried once)" if retried else "while replaying it"
    return FileResult(path, STATUS_CRASHED, EXIT_FINDING,
                      summary=f"{WORKER_DIED} {times}: {how}; replay it alone (`kvdbg replay {path}`) to see why, "
                              "e.g. under /usr/bin/time -v for its memory")


# --------------------------------------------------------------------------- the run record


def options_record(options: BatchOptions, device_kind: str) -> dict[str, Any]:
    """The run's options as stored: what decides a verdict, and what an example command repeats."""
    return {"backends": list(options.backends), "steps": None if options.steps is None else str(options.steps),
            "device": options.device, "device_kind": device_kind, "exact": options.exact,
            "compile": options.compile, "atol": options.atol, "rtol": options.rtol}


def run_record(options: dict[str, Any], *, planned: int, skipped: int, executor: dict[str, Any],
               resumed: bool) -> dict[str, Any]:
    return strict({"record": RECORD_RUN, "version": RESULTS_VERSION, "kvdbg": __version__, "started": now(),
                   "resumed": resumed, "planned": planned, "skipped": skipped, "options": options,
                   "executor": executor})


def end_record(*, rows: int, exit_code: int | None, interrupted: bool) -> dict[str, Any]:
    return {"record": RECORD_END, "finished": now(), "rows": rows, "exit_code": exit_code, "interrupted": interrupted}


def check_same_options(previous: dict[str, Any], current: dict[str, Any], path: str) -> None:
    """--resume continues a file only with the options its rows were judged under (the device's kind, not its
    number or the worker count)."""
    for name in VERDICT_OPTIONS:
        if previous.get(name) != current.get(name):
            raise ResultsError(
                f"--resume: {path} was written with {name} {_shown(previous.get(name))}, this run has "
                f"{_shown(current.get(name))}; its rows would mix two judgements (give the same options, or "
                "another --results file)")


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "(default)"
    return "(default)" if value is None else str(value)


# --------------------------------------------------------------------------- reading


@dataclass
class ResultsFile:
    """A results file read back: its runs, the latest row per file, whether the last run ended."""

    path: str
    runs: list[dict[str, Any]]
    rows: list[Row]  # the latest row of each file, in the order first written
    ends: list[dict[str, Any]]
    torn_tail: int = 0  # bytes of a last line cut short by a crash (ignored)
    superseded: int = 0  # rows replaced by a later row of the same file (a changed file replayed again)
    last_end: dict[str, Any] | None = None  # the end record of the last run (None: it never wrote one)

    @property
    def options(self) -> dict[str, Any]:
        return self.runs[-1]["options"]

    @property
    def finished(self) -> bool:
        """Whether the last invocation wrote its end record without being interrupted."""
        return self.last_end is not None and not self.last_end.get("interrupted")

    def done(self) -> dict[str, Row]:
        """Rows by the absolute path of each of their files (what --resume skips when the key matches)."""
        out: dict[str, Row] = {}
        for row in self.rows:
            for key in row.files:
                out[key.path] = row
        return out


def read_results(path: str) -> ResultsFile:
    """Read a results file; one-line ResultsError naming the line for anything that is not one."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such results file") from None
    except IsADirectoryError:
        raise ResultsError(f"{path}: is a directory, not a results file") from None
    except OSError as exc:
        raise ResultsError(f"{path}: cannot read ({exc.strerror or exc})") from None
    torn = 0
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        torn, data = len(data) - cut, data[:cut]
    runs: list[dict[str, Any]] = []
    ends: list[dict[str, Any]] = []
    latest: dict[tuple[str, ...], Row] = {}
    superseded = 0
    last_end = None
    for number, line in enumerate(data.splitlines(), 1):
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, ValueError):
            raise ResultsError(f"{where}: not a JSON line (is {path} a kvdbg results file?)") from None
        kind = record.get("record") if isinstance(record, dict) else None
        if number == 1 and kind != RECORD_RUN:
            raise ResultsError(f"{path}: not a kvdbg results file (line 1 is not a run record)")
        if kind == RECORD_RUN:
            if record.get("version") != RESULTS_VERSION:
                raise ResultsError(f"{where}: results format version {record.get('version')!r}; this kvdbg reads "
                                   f"version {RESULTS_VERSION}")
            if not isinstance(record.get("options"), dict):
                raise ResultsError(f"{where}: run record has no options")
            runs.append(record)
            last_end = None
        elif kind == RECORD_ROW:
            row = row_from_record(record, where)
            key = tuple(f.path for f in row.files)
            if key in latest:
                superseded += 1
                del latest[key]  # re-inserted below: the order is that of the latest rows
            latest[key] = row
        elif kind == RECORD_END:
            ends.append(record)
            last_end = record
        else:
            raise ResultsError(f"{where}: unknown record {str(kind)[:40]!r}")
    if not runs:
        raise ResultsError(f"{path}: empty results file (no run record)")
    return ResultsFile(path, runs, list(latest.values()), ends, torn, superseded, last_end)


# --------------------------------------------------------------------------- writing


class ResultsWriter:
    """Appends records to a results file: one ``write`` and one fsync per line; an exclusive lock meanwhile."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def create(cls, path: str, first: dict[str, Any], *, overwrite: bool = False) -> "ResultsWriter":
        """A new file whose first line is ``first`` (written atomically: the file appears with it or not at
        all); an existing file is replaced only with ``overwrite``."""
        from kvdbg.atomic import atomic_write

        line = _line(first)
        atomic_write(path, lambda fh: fh.write(line), overwrite=overwrite, what="--results")
        writer = cls.open(path)
        _fsync_directory(path)
        return writer

    @classmethod
    def open(cls, path: str) -> "ResultsWriter":
        """Open an existing file to append to it, cutting off a torn last line (a row that will be redone)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND)
        except OSError as exc:
            raise ResultsError(f"cannot append to --results {path}: {exc.strerror or exc}") from None
        try:
            _lock(fd, path)
            size = os.fstat(fd).st_size
            if size:
                tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
                if not tail.endswith(b"\n"):
                    cut = tail.rfind(b"\n")
                    keep = size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= len(tail) else None)
                    if keep is None:  # a line longer than 1 MiB cut short: not ours to repair
                        raise ResultsError(f"--results {path}: its last line is cut short and over 1 MiB long")
                    os.ftruncate(fd, keep)
                    os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def write(self, record: dict[str, Any]) -> None:
        data = _line(record)
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fsync(self._fd)
        except OSError as exc:
            raise ResultsError(f"cannot append to --results {self.path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # also releases the lock
            self._fd = -1

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(strict(record), allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")


def _lock(fd: int, path: str) -> None:
    """One run appends to a file at a time: a second one is refused rather than interleaving rows."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as on a file system without one
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ResultsError(f"--results {path} is being written by another kvdbg run") from None
        # ENOLCK, EOPNOTSUPP: a file system without locks; the run goes on unlocked.


def _fsync_directory(path: str) -> None:
    """Make the new file's name durable too (its content is fsync'd by the write itself)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rows_by_path(rows: Iterable[Row]) -> dict[str, Row]:
    return {key.path: row for row in rows for key in row.files}


__all__ = ["FileKey", "Placement", "ResultsError", "ResultsFile", "ResultsWriter", "Row", "WORKER_DIED",
           "check_same_options", "died_result", "end_record", "options_record", "read_results", "row_from_record",
           "row_record", "rows_by_path", "run_record", "strict"]
