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
from kvdbg.replayer.batch import (STATUS_BAD_INPUT, STATUS_CRASHED, STATUS_FAIL, STATUS_PASS, STATUS_UNVERIFIED,
                         BatchOptions, FileResult, Worst)
from kvdbg.errors import OptionError
from kvdbg.snapshot.ranks import RankInfo, StepFacts

RESULTS_VERSION = 1
RECORD_RUN, RECORD_ROW, RECORD_END = "run", "row", "end"

# The options that decide a row's verdict: a run resumes only a file written with the same ones.
VERDICT_OPTIONS = ("backends", "steps", "device_kind", "exact", "compile", "atol", "rtol")

# A row whose worker process died on it twice (kvdbg.fleet.triage groups these apart from kvdbg's own exceptions).
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
        # What replay DIR and triage check a step's rank files against each other with (kvdbg.snapshot.ranks.check_step).
        "rank": asdict(r.rank) if r.rank is not None else None,
        "step_facts": asdict(r.step_facts) if r.step_facts is not None else None,
        "status": r.status,
        "exit_code": r.exit_code,
        "verdict": r.summary,
        "worst": asdict(r.worst) if r.worst is not None else None,
        "error_findings": list(r.error_findings),
        "error_finding_count": r.error_finding_count,
        "signature": signature,
        "seconds": r.seconds,
        "steps": list(r.steps),
        "comparisons": r.comparisons,
        "placement": row.placement.to_json() if row.placement is not None else None,
        "attempts": row.attempts,
        "finished": row.finished,
    })


def row_from_record(record: dict[str, Any], where: str) -> Row:
    """A row read back; ``where`` ("FILE line N") prefixes the one-line error naming a bad field.

    Every field is checked against what :func:`row_record` writes, so that a file edited by hand or damaged
    is refused here, naming the field, rather than failing later in whatever reads the row."""
    def get(obj: dict[str, Any], key: str, kind: str, prefix: str = "") -> Any:
        return _field(obj, key, kind, where, "row", prefix)

    status = get(record, "status", "str")
    if status not in STATUSES:
        raise _field_error(where, "row", "status", f"one of {', '.join(STATUSES)}", status)
    exit_code = get(record, "exit_code", "int")
    if exit_code not in ROW_EXIT_CODES:
        raise _field_error(where, "row", "exit_code", "0, 1, 2 or 3", exit_code)
    worst = get(record, "worst", "object?")
    if worst is not None:
        worst = Worst(**{name: get(worst, name, kind, "worst.") for name, kind in WORST_FIELDS.items()})
    comparisons = get(record, "comparisons", "[object]?") or []
    for number, comparison in enumerate(comparisons):
        for name, kind in COMPARISON_FIELDS.items():
            get(comparison, name, kind, f"comparisons[{number}].")
    rank = get(record, "rank", "object?")
    if rank is not None:
        rank = RankInfo(**{name: get(rank, name, kind, "rank.") for name, kind in RANK_FIELDS.items()})
    facts = get(record, "step_facts", "object?")
    if facts is not None:
        fields = get(facts, "fields", "object", "step_facts.")
        dtypes, digests = (get(facts, name, "object", "step_facts.") for name in ("dtypes", "digests"))
        for prefix, mapping in (("step_facts.dtypes.", dtypes), ("step_facts.digests.", digests)):
            for name in mapping:
                get(mapping, name, "str", prefix)
        facts = StepFacts(fields=fields, dtypes=dtypes, digests=digests)
    result = FileResult(
        path=get(record, "path", "str"), status=status, exit_code=exit_code, layer=get(record, "layer", "str?"),
        steps=get(record, "steps", "[count]?") or [], worst=worst,
        error_findings=get(record, "error_findings", "[str]?") or [], summary=get(record, "verdict", "str?") or "",
        # Results written before the count was kept: each file's distinct codes, a lower bound.
        error_finding_count=get(record, "error_finding_count", "count?") or len(get(record, "error_findings",
                                                                                    "[str]?") or []),
        comparisons=comparisons, seconds=float(get(record, "seconds", "number?") or 0.0),
        rank=rank if rank is not None and rank.is_shard else None, step_facts=facts)
    files = get(record, "files", "[object]")
    if not files:
        raise ResultsError(f"{where}: row record field files is empty (a row names at least one file)")
    keys = [FileKey(*(get(f, name, kind, f"files[{number}].") for name, kind in FILE_KEY_FIELDS.items()))
            for number, f in enumerate(files)]
    placement = get(record, "placement", "object?")
    if placement is not None:
        placement = Placement(**{name: get(placement, name, kind, "placement.")
                                 for name, kind in PLACEMENT_FIELDS.items() if name in placement or kind[-1] != "?"})
    return Row(path=result.path, files=keys, result=result, ranks=get(record, "ranks", "[int]?") or [],
               step=get(record, "engine_step", "int?"), placement=placement,
               attempts=get(record, "attempts", "count?"), finished=get(record, "finished", "str?") or "")


# --------------------------------------------------------------------------- the fields a reader checks

STATUSES = (STATUS_PASS, STATUS_FAIL, STATUS_UNVERIFIED, STATUS_BAD_INPUT, STATUS_CRASHED)
ROW_EXIT_CODES = (0, 1, 2, 3)  # a file's own verdict (kvdbg.judge.verdict); 130 is the run's, never a row's

# Kinds: "str", "int", "count" (>= 0), "bool", "number" (finite), "object"; "[kind]" a list of them;
# a trailing "?" allows null or the field's absence.
WORST_FIELDS = {"actual": "str", "expected": "str", "step": "count", "passed": "bool", "max_abs": "number?",
                "failed_heads": "count", "heads": "count", "counted": "bool"}
COMPARISON_FIELDS = {"actual": "str", "expected": "str", "step": "count?", "passed": "bool?", "counted": "bool?",
                     "max_abs": "number?", "failed_heads": "count?", "heads": "count?", "not_compared": "count?",
                     "failed_head_ids": "[count]?", "query_heads": "count?", "actual_nonfinite": "count?",
                     "unwritten": "count?", "expected_nonfinite": "count?"}
FILE_KEY_FIELDS = {"path": "str", "size": "int", "mtime_ns": "int"}  # -1: the file could not be stat'ed
RANK_FIELDS = {"layer": "str", "step": "int?", "tp_rank": "int?", "tp_size": "int?", "engine_instance": "str?",
               "dp_rank": "int?", "rank": "int?", "total_num_kv_heads": "int?"}
PLACEMENT_FIELDS = {"device": "str", "pid": "int?", "node_ip": "str?", "node_id": "str?", "kvdbg": "str?"}
OPTIONS_FIELDS = {"backends": "[str]?", "steps": "str?", "device": "str?", "device_kind": "str?", "exact": "bool?",
                  "compile": "bool?", "atol": "number?", "rtol": "number?"}
RUN_FIELDS = {"kvdbg": "str?", "started": "str?", "resumed": "bool?", "planned": "count?", "skipped": "count?",
              "executor": "object?"}
END_FIELDS = {"finished": "str?", "rows": "count?", "exit_code": "int?", "interrupted": "bool?"}

_KINDS = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "count": ("a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "number": ("a finite number",
               lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
    "object": ("an object", lambda v: isinstance(v, dict)),
}


def _field(obj: dict[str, Any], key: str, kind: str, where: str, record: str, prefix: str = "") -> Any:
    """``obj[key]`` checked against ``kind``; a one-line ResultsError naming the line and the field otherwise."""
    name = prefix + key
    if key not in obj:
        if kind.endswith("?"):
            return None
        raise ResultsError(f"{where}: {record} record has no field {name!r}")
    return _checked(obj[key], kind, where, record, name)


def _checked(value: Any, kind: str, where: str, record: str, name: str) -> Any:
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    if kind.startswith("["):
        if not isinstance(value, list):
            raise _field_error(where, record, name, f"a list of {_KINDS[kind[1:-1]][0].split(' ', 1)[1]}s", value)
        return [_checked(item, kind[1:-1], where, record, f"{name}[{i}]") for i, item in enumerate(value)]
    expected, fits = _KINDS[kind]
    if not fits(value):
        raise _field_error(where, record, name, expected, value)
    return value


def _field_error(where: str, record: str, name: str, expected: str, value: Any) -> ResultsError:
    if isinstance(value, (str, int, float, bool, type(None))):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:40] + "…"
    else:
        shown = "a list" if isinstance(value, list) else "an object"
    return ResultsError(f"{where}: {record} record field {name} must be {expected}, got {shown}")


def died_result(path: str, how: str, *, retried: bool) -> FileResult:
    """The row of a file whose worker process died under it (after the retry, when there was one)."""
    from kvdbg.judge.verdict import EXIT_FINDING

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
        except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested thousands deep
            raise ResultsError(f"{where}: not a JSON line (is {path} a kvdbg results file?)") from None
        kind = record.get("record") if isinstance(record, dict) else None
        if number == 1 and kind != RECORD_RUN:
            raise ResultsError(f"{path}: not a kvdbg results file (line 1 is not a run record)")
        if kind == RECORD_RUN:
            if type(record.get("version")) is not int or record["version"] != RESULTS_VERSION:
                raise ResultsError(f"{where}: results format version {record.get('version')!r}; this kvdbg reads "
                                   f"version {RESULTS_VERSION}")
            if not isinstance(record.get("options"), dict):
                raise ResultsError(f"{where}: run record has no options")
            for name, field_kind in RUN_FIELDS.items():
                _field(record, name, field_kind, where, "run")
            for name, field_kind in OPTIONS_FIELDS.items():
                _field(record["options"], name, field_kind, where, "run", "options.")
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
            for name, field_kind in END_FIELDS.items():
                _field(record, name, field_kind, where, "end")
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
        from kvdbg.util.atomic import atomic_write

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
