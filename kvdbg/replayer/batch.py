"""`kvdbg replay DIR|FILES...`: replay many snapshots, one summary row each, one exit code over all.

Each file is replayed exactly as ``kvdbg replay FILE`` would (same backends,
same comparisons, same verdict rule, kvdbg.judge.verdict); a file that is bad input
becomes a row saying why, and the others still run.

The exit code over all files (:func:`batch_exit_code`):

====  ==========================================================================
code  when
====  ==========================================================================
2     any file is bad input (unreadable, not a snapshot, a backend named with
      --backend cannot run on it, --step out of its range), or files grouped
      as the ranks of one step do not agree or are not ranks of it
1     otherwise, any file fails (its own exit code is 1), or kvdbg raised on it
      (a bug: the row names the exception; replay that file alone for the trace)
3     otherwise, no file verified anything (every file's own exit code is 3)
0     otherwise (at least one file passed, none failed; files that verified
      nothing are listed as such)
====  ==========================================================================

The tensor-parallel ranks of one captured step (kvdbg.snapshot.ranks) are replayed
file by file and shown as one row (:class:`StepRow`) whose verdict is the
worst of theirs: the step fails if any rank's heads fail. A row that joins
files which ``kvdbg merge`` would refuse (a rank beyond ``tp_size`` or given
twice, head counts, batches or dtypes that differ: kvdbg.snapshot.ranks.check_step) is
bad input, its reason on one line. A row of some ranks of a step (a capture
filtered to them) is judged on the heads it holds, and says how many of the
step's ranks it holds.

Nothing here imports torch at module level: the parent of a ``--jobs N`` run
only schedules; each worker process imports torch once and replays its files.
"""

from __future__ import annotations

import glob
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

from kvdbg.errors import KvdbgError, OptionError
from kvdbg.snapshot.ranks import MergeError, RankInfo, StepFacts, check_step, group_by_step, rank_info

SNAPSHOT_GLOB = "*.safetensors"

# Row statuses; "bad input" and "crashed" carry a one-line message instead of a verdict.
STATUS_PASS, STATUS_FAIL, STATUS_UNVERIFIED = "pass", "fail", "unverified"
STATUS_BAD_INPUT, STATUS_CRASHED = "bad input", "crashed"


@dataclass(frozen=True)
class BatchOptions:
    """What `kvdbg replay` passes on to every file (the single-file replay's options)."""

    backends: tuple[str, ...] = ()  # named with --backend (judged, and required); empty: the default set
    steps: Any = None  # kvdbg.util.ranges.IntRanges of --step (None: every step), checked against each file
    device: str = "cpu"
    exact: bool = False
    compile: bool | None = None
    atol: float | None = None
    rtol: float | None = None


@dataclass
class Worst:
    """The comparison that decides a file's row: the worst counted one (failing first, then largest error)."""

    actual: str
    expected: str
    step: int
    passed: bool
    # A failing comparison's error is its failing heads' (never a passing head's); None: none of those heads (or,
    # when it passes, none at all) has an element compared (every one non-finite or unwritten).
    max_abs: float | None
    failed_heads: int
    heads: int
    counted: bool  # False: a what-if column (shown because nothing counted was compared)


@dataclass
class FileResult:
    """One snapshot's row (plain data: it crosses process boundaries)."""

    path: str
    status: str  # pass | fail | unverified | bad input | crashed
    exit_code: int
    layer: str | None = None
    steps: list[int] = field(default_factory=list)
    worst: Worst | None = None
    error_findings: list[str] = field(default_factory=list)  # distinct codes of counted error findings
    error_finding_count: int = 0  # counted error findings (the file's verdict's error_findings)
    summary: str = ""  # the file's verdict line, or the one-line reason it was not replayed
    comparisons: list[dict[str, Any]] = field(default_factory=list)  # one summary per comparison
    seconds: float = 0.0
    rank: RankInfo | None = None  # set for one tensor-parallel rank's share of a step (kvdbg.snapshot.ranks)
    step_facts: StepFacts | None = None  # set with rank: what the other ranks of its step must share

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key != "step_facts"}  # digests: not for users


# How bad a status is, for the row of several files: its worst member's.
_STATUS_ORDER = (STATUS_PASS, STATUS_UNVERIFIED, STATUS_FAIL, STATUS_CRASHED, STATUS_BAD_INPUT)


@dataclass
class StepRow:
    """One row of the summary: one snapshot, or every tensor-parallel rank of one step (ordered by rank)."""

    files: list[FileResult]
    problem: str | None = None  # why the files are not ranks of one step (the row is then bad input)

    @property
    def tp_ranks(self) -> list[int]:
        return [f.rank.tp_rank for f in self.files if f.rank is not None]

    @property
    def tp_size(self) -> int | None:
        return self.files[0].rank.tp_size if self.files[0].rank is not None else None

    @property
    def partial(self) -> bool:
        """Some ranks of the step are not here (say, a capture filtered to them): the row judges their heads only."""
        return self.tp_size is not None and len(self.tp_ranks) < self.tp_size

    @property
    def exit_code(self) -> int:
        if self.problem is not None:
            from kvdbg.judge.verdict import EXIT_BAD_INPUT

            return EXIT_BAD_INPUT
        return self.files[0].exit_code if len(self.files) == 1 else batch_exit_code(self.files)

    @property
    def status(self) -> str:
        if self.problem is not None:
            return STATUS_BAD_INPUT
        statuses = {f.status for f in self.files}
        if statuses == {STATUS_UNVERIFIED}:
            return STATUS_UNVERIFIED
        return max(statuses - {STATUS_UNVERIFIED} or statuses, key=_STATUS_ORDER.index)

    @property
    def layer(self) -> str | None:
        return next((f.layer for f in self.files if f.layer), None)

    @property
    def steps(self) -> list[int]:
        return self.files[0].steps

    @property
    def error_findings(self) -> list[str]:
        return sorted({code for f in self.files for code in f.error_findings})

    @property
    def worst(self) -> Worst | None:
        """The worst comparison over the ranks, its failing heads counted over all of them."""
        members = [f.worst for f in self.files if f.worst is not None]
        if len(self.files) == 1 or not members:
            return members[0] if members else None

        def badness(w: Worst):
            return (not w.passed, w.max_abs is None, -1.0 if w.max_abs is None else w.max_abs)

        worst = max(members, key=badness)
        same = [c for f in self.files for c in f.comparisons
                if (c["actual"], c["expected"], c["step"]) == (worst.actual, worst.expected, worst.step)]
        return Worst(worst.actual, worst.expected, worst.step, all(c["passed"] for c in same), worst.max_abs,
                     sum(c["failed_heads"] for c in same), sum(c["heads"] for c in same), worst.counted)

    @property
    def summary(self) -> str:
        if self.problem is not None:
            return self.problem
        if len(self.files) == 1:
            return self.files[0].summary
        bad = [f for f in self.files if f.status == self.status]
        text = "; ".join(f"tp_rank {f.rank.tp_rank}: {f.summary}" for f in bad)
        if self.partial:
            text += (f"; {len(self.tp_ranks)} of the step's {self.tp_size} ranks are here: the others' heads were "
                     "not replayed")
        return text

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {"files": [f.path for f in self.files], "tp_ranks": self.tp_ranks, "tp_size": self.tp_size,
                "status": self.status,
                "exit_code": self.exit_code, "layer": self.layer, "steps": self.steps,
                "worst": None if worst is None else asdict(worst), "error_findings": self.error_findings,
                "summary": self.summary}


def step_rows(files: list[FileResult]) -> list[StepRow]:
    """The summary's rows: the ranks of one step together, every other file alone (kvdbg.snapshot.ranks.group_by_step).

    A row of several files is held to ``kvdbg merge``'s rule (kvdbg.snapshot.ranks.check_step); one it refuses keeps its
    files together, with the reason as the row's ``problem``.
    """
    return [StepRow(group, _step_problem(group) if len(group) > 1 else None)
            for group in group_by_step(files, lambda f: f.rank)]


def _step_problem(group: list[FileResult]) -> str | None:
    facts = [f.step_facts for f in group]
    if any(fact is None for fact in facts):
        return "what the rank files hold was not recorded with their rows, so whether they are one step is unknown"
    try:
        # Some ranks only (a capture filtered to them) is not a refusal: the row says which ranks it judges.
        check_step([os.path.basename(f.path) for f in group], [f.rank for f in group], facts, complete=False)
    except MergeError as exc:
        return _one_line(str(exc))
    return None


@dataclass
class BatchResult:
    files: list[FileResult]
    exit_code: int
    summary: str

    @property
    def rows(self) -> list[StepRow]:
        return step_rows(self.files)

    @property
    def verdict(self):
        """The closing verdict (kvdbg.judge.verdict.Verdict): pass (0), fail (1 or 2: bad input), unverified (3)."""
        from kvdbg.judge.verdict import simple_verdict

        status = {0: "pass", 3: "unverified"}.get(self.exit_code, "fail")
        # The files' own counts, summed (each file's verdict's).
        counted = [c for f in self.files for c in f.comparisons if c.get("counted")]
        return simple_verdict(status, self.exit_code, self.summary, comparisons=len(counted),
                              failed_comparisons=sum(not c.get("passed") for c in counted),
                              error_findings=sum(f.error_finding_count for f in self.files))

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.files:
            out[f.status] = out.get(f.status, 0) + 1
        return out


# --------------------------------------------------------------------------- which files


def find_snapshots(paths: Iterable[str], *, recursive: bool = False) -> list[str]:
    """Every snapshot the arguments name: files as given, directories' ``*.safetensors`` sorted.

    A directory is not searched below its top level unless ``recursive``. A file
    named twice is replayed once. A path that does not exist, or a directory
    holding no snapshot, is an OptionError (the whole command is then bad input:
    nothing to replay is never a pass).
    """
    out: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            pattern = os.path.join(glob.escape(path), "**", SNAPSHOT_GLOB) if recursive else \
                os.path.join(glob.escape(path), SNAPSHOT_GLOB)
            found = sorted(p for p in glob.glob(pattern, recursive=recursive) if os.path.isfile(p))
            if not found:
                where = "in or below" if recursive else "in"
                hint = "" if recursive else " (--recursive searches subdirectories)"
                raise OptionError(f"no {SNAPSHOT_GLOB} file {where} directory {path}{hint}")
            out.extend(found)
        elif os.path.exists(path):
            out.append(path)
        else:
            raise OptionError(f"{path}: no such file or directory")
    seen: set[str] = set()
    unique = []
    for p in out:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


# --------------------------------------------------------------------------- one file


def replay_file(path: str, options: BatchOptions) -> FileResult:
    """Replay one snapshot as ``kvdbg replay FILE`` does and reduce it to its row; never raises for bad input."""
    import time

    started = time.perf_counter()
    try:
        result = _replay_file(path, options)
    except KvdbgError as exc:
        result = FileResult(path, STATUS_BAD_INPUT, exc.exit_code, summary=_one_line(str(exc)))
    except MemoryError:
        result = FileResult(path, STATUS_BAD_INPUT, 2,
                            summary="out of memory while reading the input; is the snapshot consistent?")
    except OSError as exc:
        result = FileResult(path, STATUS_BAD_INPUT, 2, summary=_one_line(f"cannot read {path}: {exc.strerror or exc}"))
    except Exception as exc:  # a bug in kvdbg: keep the other files going, and say so plainly
        from kvdbg.judge.verdict import EXIT_FINDING

        result = FileResult(path, STATUS_CRASHED, EXIT_FINDING,
                            summary=_one_line(f"kvdbg raised {type(exc).__name__}: {exc} (a bug; run "
                                              f"`kvdbg replay {path}` alone for the traceback)"))
    result.seconds = time.perf_counter() - started
    return result


def _replay_file(path: str, options: BatchOptions) -> FileResult:
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.replayer.runner import replay as run_replay
    from kvdbg.snapshot.store import load_snapshot

    snap = load_snapshot(path)
    names = list(options.backends) or None
    if names is not None and "reference" not in names:
        names.insert(0, "reference")  # every comparison needs the exact answer
    replay_options = ReplayOptions(device=options.device, exact=options.exact, compile=options.compile)
    steps = None
    if options.steps is not None:
        beyond = options.steps.out_of(len(snap.steps))
        if beyond is not None:
            raise OptionError(f"--step {beyond} is out of range: the snapshot has {len(snap.steps)} step(s)")
        steps = options.steps.below(len(snap.steps))
    result = run_replay(snap, names, replay_options, steps=steps, required=list(options.backends))
    report = result.judge(atol=options.atol, rtol=options.rtol)  # the single-file replay's own verdict
    comparisons, findings, verdict = report.comparisons, report.findings, report.verdict
    counted = result.counted
    rank = rank_info(snap.meta.layer.name, snap.meta.capture)
    facts = None
    if rank.is_shard:
        from kvdbg.snapshot.merge import step_facts

        facts = step_facts(snap)
    return FileResult(
        path=path, status=verdict.status, exit_code=verdict.exit_code, layer=snap.meta.layer.name,
        steps=[s.step for s in result.steps], worst=worst_comparison(comparisons, counted),
        error_findings=sorted({f.code for f in findings if f.severity == "error" and f.backend in counted}),
        error_finding_count=verdict.error_findings, summary=verdict.summary,
        comparisons=[_comparison_record(c, c.actual in counted) for c in comparisons if c.heads],
        rank=rank if rank.is_shard else None, step_facts=facts)


def worst_comparison(comparisons, counted) -> Worst | None:
    """The counted comparison that fails worst (or, all passing, errs most); a what-if one if none counted."""
    compared = [c for c in comparisons if c.heads]
    pool = [c for c in compared if c.actual in counted] or compared
    if not pool:
        return None

    def badness(c):
        error = c.shown_max_abs
        # Failing first; among those a comparison that could not be measured (NaN) first, then by error.
        return (not c.passed, error != error, -1.0 if error != error else error)

    c = max(pool, key=badness)
    error = c.shown_max_abs
    return Worst(c.actual, c.expected, c.step, c.passed, None if error != error else error, len(c.failed),
                 len(c.heads), c.actual in counted)


def _comparison_record(c, counted: bool) -> dict[str, Any]:
    error = c.max_abs
    return {"actual": c.actual, "expected": c.expected, "step": c.step, "passed": c.passed, "counted": counted,
            "max_abs": None if error != error else error, "failed_heads": len(c.failed), "heads": len(c.heads),
            "not_compared": c.nonfinite,
            # What kvdbg.fleet.triage groups failures by: which query heads fail, and how.
            "failed_head_ids": sorted({h.head for h in c.failed}), "query_heads": len({h.head for h in c.heads}),
            **c.counts()}


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text[:400] + ("…" if len(text) > 400 else "")


# --------------------------------------------------------------------------- many files


def _worker_init() -> None:
    # Ctrl-C reaches every process of the terminal's group: workers leave it to the parent, which
    # stops them, so one message is printed instead of a traceback per worker.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker(args: tuple[int, str, BatchOptions]) -> tuple[int, FileResult]:
    index, path, options = args
    return index, replay_file(path, options)


def iter_results(paths: list[str], options: BatchOptions, *, jobs: int = 1) -> Iterator[tuple[int, FileResult]]:
    """(index into ``paths``, result) as each file finishes; with ``jobs`` > 1, in worker processes.

    Workers are started fresh (spawn): a fork of a process that may already hold
    torch's thread pools can deadlock. On KeyboardInterrupt the workers are
    terminated before it propagates.
    """
    if jobs <= 1 or len(paths) <= 1:
        for index, path in enumerate(paths):
            yield index, replay_file(path, options)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    pool = context.Pool(processes=min(jobs, len(paths)), initializer=_worker_init)
    try:
        for item in pool.imap_unordered(_worker, [(i, p, options) for i, p in enumerate(paths)]):
            yield item
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def replay_many(paths: list[str], options: BatchOptions, *, jobs: int = 1,
                progress: Callable[[int, int, FileResult], None] | None = None) -> BatchResult:
    """Replay every file (in parallel with ``jobs``); rows in the order of ``paths`` whatever finishes first."""
    results: list[FileResult | None] = [None] * len(paths)
    done = 0
    for index, result in iter_results(paths, options, jobs=jobs):
        results[index] = result
        done += 1
        if progress is not None:
            progress(done, len(paths), result)
    files = [r for r in results if r is not None]
    code, summary = batch_verdict(files)
    return BatchResult(files, code, summary)


def batch_exit_code(files: list[FileResult]) -> int:
    """The rule of the module doc: 2 bad input > 1 fail or crash > 3 nothing verified anywhere > 0."""
    from kvdbg.judge.verdict import EXIT_BAD_INPUT, EXIT_FINDING, EXIT_NOTHING_VERIFIED, EXIT_OK

    statuses = {f.status for f in files}
    if STATUS_BAD_INPUT in statuses:
        return EXIT_BAD_INPUT
    if statuses & {STATUS_FAIL, STATUS_CRASHED}:
        return EXIT_FINDING
    if not files or statuses == {STATUS_UNVERIFIED}:
        return EXIT_NOTHING_VERIFIED
    return EXIT_OK


def batch_verdict(files: list[FileResult]) -> tuple[int, str]:
    """(exit code, one summary line) over all files, and over the rows of a step's ranks (bad input if refused)."""
    from kvdbg.judge.verdict import EXIT_BAD_INPUT

    code = batch_exit_code(files)
    refused = [row for row in step_rows(files) if row.problem is not None]
    if refused:
        code = EXIT_BAD_INPUT
    by_status: dict[str, list[str]] = {}
    for f in files:
        by_status.setdefault(f.status, []).append(os.path.basename(f.path))

    def names(status: str) -> str:
        shown = by_status[status][:4]
        more = len(by_status[status]) - len(shown)
        return ", ".join(shown) + (f", … {more} more" if more else "")

    parts = [f"{len(by_status[s])} {label}" + (f" ({names(s)})" if s not in (STATUS_PASS,) else "")
             for s, label in ((STATUS_FAIL, "fail"), (STATUS_CRASHED, "crashed"), (STATUS_BAD_INPUT, "bad input"),
                              (STATUS_UNVERIFIED, "verified nothing"), (STATUS_PASS, "pass")) if s in by_status]
    if refused:
        shown = [os.path.basename(row.files[0].path) for row in refused[:4]]
        more = len(refused) - len(shown)
        parts.insert(0, f"{len(refused)} step(s) whose rank files do not agree or are not ranks of one step "
                        f"({', '.join(shown)}{f', … {more} more' if more else ''})")
    head = {0: "PASS", 1: "FAIL", 2: "BAD INPUT", 3: "NOTHING VERIFIED"}[code]
    return code, f"{head}: {len(files)} snapshot(s): " + "; ".join(parts)


__all__ = ["BatchOptions", "BatchResult", "FileResult", "StepRow", "Worst", "batch_exit_code", "batch_verdict",
           "find_snapshots", "iter_results", "replay_file", "replay_many", "step_rows", "worst_comparison"]
