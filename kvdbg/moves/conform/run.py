"""`kvdbg conform`: a backend's cells run, judged, explained (float32 re-run), minimised and written out.

The driver (:func:`conform_backend`) knows nothing of vLLM: it asks a *runner*
(anything with ``backend``, ``refusal(row)`` and ``run(row, kind)``) to judge
cells; a runner that also has ``refusals(rows)`` and ``run_many(requests)``
(`--jobs`: kvdbg.fleet.conform_pool) is handed every cell of a phase at once
and runs them side by side, and the failing cells' explanations advance in
waves (each wave runs the next cell every explanation needs).
:class:`EngineRunner` is the real one: it synthesises the cell's step
(kvdbg.moves.conform.matrix), replays it through the ``vllm`` column (the
installed vLLM's own builder, cache write and impl for the backend) and the
exact reference, and compares them with replay's rule and tolerances.

Steps for one backend:

1. each non-baseline level alone is offered to the backend; a level it refuses
   is left out of the matrix, and its row is a refused cell with the reason;
2. the rows: a pairwise covering array of what is left (or the whole product);
3. every row in every batch kind is a cell: pass, FAIL, or refused (a
   combination the backend refuses, in its words);
4. a failing cell is run again on the float32 path (model dtype float32):
   passing there makes the failure *rounding*, failing there *semantic*; a
   backend without that path leaves it *unknown*. On a GPU that path runs
   with IEEE float32 products (Triton's default for a float32 ``tl.dot`` is
   TF32, which rounds like float16), in worker processes of their own
   (kvdbg.fleet.conform_pool), so TF32 rounding is never called semantic;
5. a failing cell's features are dropped one at a time (back to baseline)
   while it keeps failing: the smallest combination that still fails;
6. with an output directory, the failing cell's snapshot and the minimal one's
   are written there, each holding the backend's output as the engine's (so
   `kvdbg report` shows the failure without vLLM, too).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol

from kvdbg.errors import BackendUnavailable, OptionError
from kvdbg.moves.conform.covering import Factor, full_product, pairwise, product_size
from kvdbg.moves.conform.matrix import FACTORS, KINDS, allowed, completed, full_row, label, spec_for

if TYPE_CHECKING:
    from kvdbg.judge.verdict import Verdict

logger = logging.getLogger("kvdbg.conform")

PASS, FAIL, REFUSED = "pass", "fail", "refused"
MAX_FULL = 512  # rows of --full: the whole product beyond this is not "small"
FLOAT32 = "float32"
FILE_PREFIX = "conform-"
TRITON_F32 = "TRITON_F32_DEFAULT"  # Triton's default precision of float32 tl.dot (tf32 on tensor-core GPUs)


@dataclass
class Outcome:
    """A runner's answer for one cell."""

    status: str  # pass | fail | refused
    max_abs: float | None = None  # the largest error (of the failing heads, for a FAIL)
    first: dict | None = None  # the first wrong (step, request, head) and its worst token, for a FAIL
    reason: str | None = None  # refused: the backend's words; FAIL: what failed when no error is measured
    tolerance: str | None = None  # the rule and where it comes from
    kernel: str | None = None  # what ran
    snapshot: Any = None  # the cell's snapshot, the backend's output stored as the engine's (written on a FAIL)
    seconds: float | None = None  # the cell's replay, wall time (builds included)
    build_seconds: float | None = None  # of which in kernel builds the replay made (FlashInfer's JIT), if any


class Runner(Protocol):
    backend: str

    def refusal(self, row: Mapping[str, str]) -> str | None: ...

    def run(self, row: Mapping[str, str], kind: str) -> Outcome: ...  # and exact=True where exact_float32


@dataclass
class Cell:
    row_id: int  # index of the row in the backend's table
    row: dict  # every factor's level
    kind: str  # decode | prefill | mixed
    status: str
    max_abs: float | None = None
    first: dict | None = None
    reason: str | None = None
    tolerance: str | None = None
    kernel: str | None = None
    cause: str | None = None  # FAIL: semantic | rounding | unknown
    cause_detail: str | None = None
    minimal: dict | None = None  # FAIL: the smallest row that still fails in this kind
    # FAIL (not rounding): what the output is instead, kvdbg.moves.whatif's answer as JSON; None: no change of the
    # layer's features explains it ({"error": ...} when the what-if itself could not run)
    engine_computed: dict | None = None
    snapshot_path: str | None = None
    minimal_path: str | None = None
    probe: bool = False  # a refused level alone (left out of the matrix)

    @property
    def label(self) -> str:
        return label(self.row)

    def to_json(self) -> dict:
        return {"row": self.row_id, "combination": self.label, "features": dict(self.row), "kind": self.kind,
                "status": self.status, "max_abs": self.max_abs, "first_wrong": self.first, "reason": self.reason,
                "tolerance": self.tolerance, "kernel": self.kernel, "cause": self.cause,
                "cause_detail": self.cause_detail, "engine_computed": self.engine_computed,
                "minimal": None if self.minimal is None else label(self.minimal),
                "minimal_features": self.minimal, "snapshot": self.snapshot_path,
                "minimal_snapshot": self.minimal_path, "level_probe": self.probe}


@dataclass
class BackendConform:
    """One backend's matrix and cells (``reason`` when it could not be run at all)."""

    backend: str
    matrix: str  # "pairwise" | "full"
    kinds: tuple[str, ...]
    factors: list[Factor] = field(default_factory=list)  # the levels the backend took alone
    rows: list[dict] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    reason: str | None = None
    seconds: float = 0.0
    runs: int = 0  # cells run, float32 re-runs and minimisation runs included
    jobs: int = 1  # cells run side by side (worker processes)
    cell_seconds: float = 0.0  # the replays' wall times, summed over every run (> seconds with several jobs)
    build_seconds: float = 0.0  # of which in kernel builds (FlashInfer's JIT)
    built_runs: int = 0  # runs that built a kernel
    # Interrupted (Ctrl-C, SIGTERM): the cells that ran, of ``planned``; failing ones unexplained past the stop.
    interrupted: bool = False
    planned: int = 0  # cells of the matrix (levels refused alone not counted)
    only_rows: list[int] | None = None  # `--rows`: the matrix's rows that ran (None: every row)
    matrix_size: int = 0  # rows of the matrix (``rows`` less the refused levels' rows)

    def rows_note(self) -> str:
        """``rows 1, 3 of 15`` when only some rows ran, else ``""``."""
        if self.only_rows is None:
            return ""
        of = f" of {self.matrix_size}" if self.matrix_size else ""  # none yet: stopped before the matrix was made
        return f"row{'s' if len(self.only_rows) > 1 else ''} {', '.join(map(str, self.only_rows))}{of}"

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.cells) for s in (PASS, FAIL, REFUSED)}

    def to_json(self) -> dict:
        return {"backend": self.backend, "matrix": self.matrix, "kinds": list(self.kinds), "reason": self.reason,
                "factors": [{"name": f.name, "levels": list(f.levels)} for f in self.factors],
                "rows": [{"row": i, "combination": label(r), "features": r} for i, r in enumerate(self.rows)],
                "counts": self.counts(), "seconds": self.seconds, "runs": self.runs, "jobs": self.jobs,
                "cell_seconds": self.cell_seconds, "jit_build_seconds": self.build_seconds,
                "jit_built_runs": self.built_runs, "interrupted": self.interrupted, "planned_cells": self.planned,
                "only_rows": self.only_rows}


@dataclass
class ConformResult:
    backends: list[BackendConform]
    out_dir: str | None = None

    @property
    def cells(self) -> list[Cell]:
        return [c for b in self.backends for c in b.cells]

    @property
    def interrupted(self) -> bool:
        return any(b.interrupted for b in self.backends)

    def to_json(self) -> dict:
        cells = []
        for b in self.backends:
            cells.extend({"backend": b.backend, **c.to_json()} for c in b.cells)
        return {"backends": [b.to_json() for b in self.backends], "out_dir": self.out_dir,
                "interrupted": self.interrupted, "cells": cells}


def conform_verdict(result: ConformResult) -> "Verdict":
    """Exit 1 when a cell fails, 3 when no cell ran (every one refused, or no backend could run), else 0."""
    from kvdbg.judge.verdict import EXIT_FINDING, EXIT_NOTHING_VERIFIED, EXIT_OK, simple_verdict

    cells = result.cells
    failed = [c for c in cells if c.status == FAIL]
    ran = [c for c in cells if c.status in (PASS, FAIL)]
    refused = sum(c.status == REFUSED for c in cells)
    names = ", ".join(b.backend + (f" ({b.rows_note()})" if b.rows_note() else "") for b in result.backends) \
        or "no backend"
    aside = f"; {refused} refused by the backend" if refused else ""
    if result.interrupted:
        from kvdbg.judge.verdict import EXIT_INTERRUPTED

        stopped = next(b for b in result.backends if b.interrupted)
        done = sum(not c.probe for c in stopped.cells)
        found = f"; {len(failed)} FAIL among them" if failed else ""
        return simple_verdict("interrupted", EXIT_INTERRUPTED,
                              f"INTERRUPTED: {stopped.backend} stopped after {done} of {stopped.planned} cell(s)"
                              f"{found}; the cells shown ran, the rest did not", comparisons=len(ran),
                              failed_comparisons=len(failed))
    if failed:
        by_cause = {}
        for c in failed:
            by_cause[c.cause or "unknown"] = by_cause.get(c.cause or "unknown", 0) + 1
        causes = ", ".join(f"{n} {cause}" for cause, n in sorted(by_cause.items()))
        return simple_verdict("fail", EXIT_FINDING, f"FAIL: {len(failed)} of {len(ran)} cell(s) of {names} differ "
                              f"from the exact reference ({causes}){aside}", comparisons=len(ran),
                              failed_comparisons=len(failed))
    if not ran:
        why = "; ".join(f"{b.backend}: {b.reason}" for b in result.backends if b.reason)
        what = why or (f"every cell was refused by {names}" if cells else "no backend of the engine can run here")
        return simple_verdict("unverified", EXIT_NOTHING_VERIFIED, f"NOTHING VERIFIED: {what}")
    return simple_verdict("pass", EXIT_OK, f"PASS: {len(ran)} cell(s) of {names} agree with the exact reference "
                          f"within tolerance{aside}", comparisons=len(ran))


# --------------------------------------------------------------------------- the driver


def matrix_rows(factors: list[Factor], full: bool) -> list[dict]:
    """The rows of the matrix: the whole product (refused beyond MAX_FULL) or a pairwise covering array."""
    if full:
        size = product_size(factors)
        if size > MAX_FULL:
            raise OptionError(f"--full: the whole product of these features is {size} combinations (at most "
                              f"{MAX_FULL}); name fewer with --features, or leave out --full for pairwise")
        return [full_row(r) for r in full_product(factors, allowed)]
    return [full_row(r) for r in pairwise(factors, allowed)]


def cell_key(row: Mapping[str, str], kind: str, exact: bool = False) -> tuple:
    return (tuple(sorted(full_row(row).items())), kind, exact)


class _Cached:
    """A runner's outcomes by (row, kind, exact): minimisation and re-runs meet cells already run.

    ``run_all`` hands the runner every cell not yet run at once: a runner with
    ``run_many`` (worker processes, kvdbg.fleet.conform_pool) runs them side by
    side, any other one after the other.
    """

    def __init__(self, runner: Runner):
        self.runner, self.outcomes, self.runs = runner, {}, 0

    def run(self, row: Mapping[str, str], kind: str, exact: bool = False) -> Outcome:
        return self.run_all([(row, kind, exact)])[0]

    def run_all(self, requests: list[tuple[Mapping[str, str], str, bool]],
                done: Callable[[tuple, Outcome], None] | None = None) -> list[Outcome]:
        keys = [cell_key(*request) for request in requests]
        todo = [(full_row(r[0]), r[1], r[2]) for key, r in dict(zip(keys, requests)).items()
                if key not in self.outcomes]
        if todo:
            many = getattr(self.runner, "run_many", None)
            if many is not None:
                for request, outcome in many(todo):
                    self._keep(request, outcome, done)
            else:
                for request in todo:
                    row, kind, exact = request
                    outcome = self.runner.run(row, kind, exact=True) if exact else self.runner.run(row, kind)
                    self._keep(request, outcome, done)
        return [self.outcomes[key] for key in keys]

    def _keep(self, request: tuple, outcome: Outcome, done: Callable[[tuple, Outcome], None] | None) -> None:
        self.outcomes[cell_key(*request)] = outcome
        self.runs += 1  # counted as answered: a run an interrupt stopped is not one
        if done:
            done(request, outcome)


def _refusals(runner: Runner, rows: list[dict], progress, offered: int) -> list[str | None]:
    many = getattr(runner, "refusals", None)
    if many is not None:
        if progress:
            progress(0, offered, f"{runner.backend} takes {len(rows)} level(s) alone?")
        return many(rows)
    reasons = []
    for asked, row in enumerate(rows):
        if progress:
            progress(asked, offered, f"{runner.backend} takes {label(row)}?")
        reasons.append(runner.refusal(row))
    return reasons


def conform_backend(runner: Runner, factors: Iterable[Factor] = FACTORS, *, kinds: Iterable[str] = KINDS,
                    full: bool = False, out_dir: str | None = None, force: bool = False,
                    progress: Callable[[int, int, str], None] | None = None,
                    only_rows: Iterable[int] | None = None) -> BackendConform:
    """Every cell of ``runner``'s backend over ``factors`` (the others at baseline); see the module doc.
    ``only_rows``: run only these rows of the matrix (numbered as its table numbers them; the matrix itself is
    made as without them, so a row's number names the same combination)."""
    started = time.perf_counter()
    kinds = tuple(kinds)
    factors = list(factors)
    result = BackendConform(runner.backend, "full" if full else "pairwise", kinds)
    result.only_rows = None if only_rows is None else sorted(set(only_rows))
    cached = _Cached(runner)
    stage = _Stage()
    try:
        _conform_cells(result, stage, runner, cached, factors, kinds, full, out_dir, force, progress,
                       result.only_rows)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (the command turns it into this): keep what ran
        _keep_what_ran(result, stage, cached, out_dir, force)
    if progress:
        ran = sum(not c.probe for c in result.cells)
        progress(ran, max(ran, result.planned), f"{runner.backend} "
                 + (f"interrupted after {ran} of {result.planned} cells" if result.interrupted else "done"))
    result.runs = cached.runs
    result.seconds = time.perf_counter() - started
    result.jobs = int(getattr(runner, "jobs", 1))
    for outcome in cached.outcomes.values():
        result.cell_seconds += outcome.seconds or 0.0
        if outcome.build_seconds:
            result.build_seconds += outcome.build_seconds
            result.built_runs += 1
    return result


@dataclass
class _Stage:
    """How far one backend's conform got: its matrix rows, the refused levels' cells, and whether the matrix's
    cells were all collected (after which an interrupt leaves only explanations unfinished)."""

    rows: list[dict] = field(default_factory=list)
    probe_cells: list[Cell] = field(default_factory=list)
    collected: bool = False


def _keep_what_ran(result: BackendConform, stage: _Stage, cached: _Cached, out_dir: str | None,
                   force: bool) -> None:
    """After an interrupt: the matrix's cells that have an answer, in matrix order (failing ones with their
    snapshots, unexplained where the stop came first), then the refused levels; the result says it stopped."""
    result.interrupted = True
    if not stage.collected:
        result.cells = [_cell(row_id, row, kind, cached.outcomes[cell_key(row, kind)])
                        for row_id, row in enumerate(stage.rows) for kind in result.kinds
                        if cell_key(row, kind) in cached.outcomes
                        and (result.only_rows is None or row_id in result.only_rows)]
    result.cells += stage.probe_cells
    for cell in result.cells:
        if cell.status == FAIL and cell.snapshot_path is None:
            try:
                _write_cell(cell, cached, out_dir, force, result.backend)
            except Exception:  # noqa: BLE001 - a snapshot not written shows as no path
                logger.debug("conform: the snapshot of an interrupted run's failing cell was not written",
                             exc_info=True)


def _conform_cells(result: BackendConform, stage: _Stage, runner: Runner, cached: _Cached, factors: list,
                   kinds: tuple, full: bool, out_dir: str | None, force: bool, progress,
                   only_rows: list[int] | None = None) -> None:
    serial = getattr(runner, "run_many", None) is None

    # 1. each level alone: a level the backend refuses leaves the matrix and shows as one refused row
    alone = [(factor, level, completed(full_row({factor.name: level})))  # with the window it needs, if any
             for factor in factors for level in factor.levels[1:]]
    reasons = _refusals(runner, [row for _, _, row in alone], progress, len(alone))
    kept, probes = [], []
    for factor in factors:
        levels = [factor.baseline]
        for (of, level, row), reason in zip(alone, reasons):
            if of is not factor:
                continue
            if reason is None:
                levels.append(level)
            else:
                probes.append((row, reason))
        kept.append(Factor(factor.name, tuple(levels)))
    result.factors = kept
    rows = matrix_rows(kept, full)
    result.rows = rows + [row for row, _ in probes]
    result.matrix_size = len(rows)
    stage.rows = rows
    stage.probe_cells = [Cell(len(rows) + offset, row, kind, REFUSED, reason=reason, probe=True)
                         for offset, (row, reason) in enumerate(probes) for kind in kinds]

    # 2. every cell (of the rows asked for)
    if only_rows is not None:
        beyond = [r for r in only_rows if r >= len(rows)]
        if beyond:
            raise OptionError(f"--rows: {runner.backend}'s matrix has rows 0 to {len(rows) - 1}, not "
                              f"{', '.join(map(str, beyond))} (its table numbers them)")
    run_rows = [(row_id, row) for row_id, row in enumerate(rows) if only_rows is None or row_id in only_rows]
    total = result.planned = len(run_rows) * len(kinds)
    cells = [(row_id, row, kind) for row_id, row in run_rows for kind in kinds]
    count = [0]

    def done(request, outcome):
        count[0] += 1
        if progress and not serial:
            progress(count[0], total, f"{runner.backend} {label(request[0])} ({request[1]}): {_briefly(outcome)}")

    if serial:  # one at a time: the bar names the cell about to run
        outcomes = []
        for done_so_far, (_, row, kind) in enumerate(cells):
            if progress:
                progress(done_so_far, total, f"{runner.backend} {label(row)} ({kind})")
            outcomes.append(cached.run(row, kind))
    else:
        if progress:
            progress(0, total, f"{runner.backend} {total} cells")
        outcomes = cached.run_all([(row, kind, False) for _, row, kind in cells], done)
    for (row_id, row, kind), outcome in zip(cells, outcomes):
        result.cells.append(_cell(row_id, row, kind, outcome))
    stage.collected = True

    # 3. the failing cells explained, side by side: each asks for one cell at a time
    failing = [c for c in result.cells if c.status == FAIL]
    if failing:
        chains = {id(c): _explanation(c.row, c.kind, kept, exact_float32=_has_exact_float32(runner))
                  for c in failing}
        answers = _drive_all(chains, cached, progress, runner.backend)
        for cell in failing:
            cell.cause, cell.cause_detail, cell.minimal = answers[id(cell)]
            _what_the_output_is(cell, cached, runner)
            _write_cell(cell, cached, out_dir, force, runner.backend)
    result.cells += stage.probe_cells


def failure_kind(status: str, max_abs: float | None, reason: str | None) -> str | None:
    """What a FAIL without a finite error was, in a word: ``raised`` (the backend raised on the step),
    ``non-finite`` (NaN/inf where the reference is finite, or rows it did not write), or ``""`` (another cause,
    which its reason says: a worker that died, a verdict failed on a finding); None for a FAIL with an error to
    show, or another status."""
    if status != FAIL or (max_abs is not None and max_abs == max_abs):
        return None
    if reason and reason.startswith("step ") and ": raised " in reason:
        return "raised"
    if reason and reason.startswith("the failing heads hold no finite number"):
        return "non-finite"
    return ""


def _briefly(outcome: Outcome) -> str:
    """``pass 2.4e-04`` / ``fail 1.2e+00 r1h3`` / ``fail raised: ...`` / ``refused``: a cell's answer on one
    progress line."""
    if outcome.status == REFUSED:
        return REFUSED
    where = f" r{outcome.first['request']}h{outcome.first['head']}" if outcome.first else ""
    kind = failure_kind(outcome.status, outcome.max_abs, outcome.reason)
    if kind is not None:
        said = f": {outcome.reason[:100]}" if outcome.reason and kind != "non-finite" else ""
        return f"{outcome.status}{' ' + kind if kind else ''}{where}{said}"
    return f"{outcome.status} {_num(outcome.max_abs)}{where}"


def _cell(row_id: int, row: dict, kind: str, outcome: Outcome) -> Cell:
    return Cell(row_id, dict(row), kind, outcome.status, max_abs=outcome.max_abs, first=outcome.first,
                reason=outcome.reason, tolerance=outcome.tolerance, kernel=outcome.kernel)


def _has_exact_float32(runner: Runner) -> bool:
    return bool(getattr(runner, "exact_float32", False))


def _explanation(row: Mapping[str, str], kind: str, factors: list[Factor], *, exact_float32: bool = False):
    """A failing cell's explanation, as a generator: it yields the (row, kind, exact) cells it needs one at a
    time, is sent their outcomes, and returns (cause, detail, minimal row).

    The cause: a cell that passes on the float32 path is *rounding*; one that fails there too is *semantic*.
    A runner with ``exact_float32`` (a Triton backend on a GPU) runs the float32 path with IEEE float32
    products, since Triton's default for float32 ``tl.dot`` is TF32 (10 mantissa bits, about float16's), so
    that TF32 rounding is never called semantic; a float32 cell that fails with TF32 and passes with IEEE
    products is *rounding* too.
    """
    row = full_row(row)
    if row.get("dtype") == FLOAT32 and not exact_float32:
        cause, detail = "semantic", "fails on the float32 path itself"
    else:
        again = yield ({**row, "dtype": FLOAT32}, kind, exact_float32)
        products = " with IEEE float32 products (TRITON_F32_DEFAULT=ieee)" if exact_float32 else ""
        tf32 = (" (it fails with Triton's default TF32 products for float32 dot, which round as float16 "
                "does)" if exact_float32 and row.get("dtype") == FLOAT32 else "")
        if again.status == PASS:
            cause = "rounding"
            detail = (f"passes on the float32 path{products} (max abs {_num(again.max_abs)} under "
                      f"{again.tolerance}){tf32}")
        elif again.status == FAIL:
            cause = "semantic"
            detail = f"fails on the float32 path{products} too (max abs {_num(again.max_abs)})"
        else:
            cause = "unknown"
            detail = f"no float32 path: {again.reason}"
    minimal = yield from _minimal(row, kind, factors)
    return cause, detail, minimal


def _minimal(row: Mapping[str, str], kind: str, factors: Iterable[Factor]):
    """Drop features one at a time (each back to its baseline) while the cell keeps failing, until none can go;
    a generator as :func:`_explanation`, returning the smallest row."""
    current = full_row(row)
    changed = True
    while changed:
        changed = False
        for factor in factors:
            if current[factor.name] == factor.baseline:
                continue
            trial = {**current, factor.name: factor.baseline}
            if not allowed(trial):
                continue
            outcome = yield (trial, kind, False)
            if outcome.status == FAIL:
                current, changed = trial, True
    return current


def _drive_all(chains: dict, cached: _Cached, progress, backend: str) -> dict:
    """Run every chain of :func:`_explanation` to its end, in waves: each wave runs the next cell of every
    chain still going at once (side by side on a pool), so N failing cells cost the waves of the longest."""
    answers, asked = {}, {}
    for key, chain in chains.items():
        try:
            asked[key] = next(chain)
        except StopIteration as stop:  # nothing to re-run and nothing to drop (a float32 row at every baseline)
            answers[key] = stop.value
    wave = 0
    while asked:
        wave += 1
        if progress:
            progress(0, len(asked), f"{backend} explaining {len(asked)} failing cell(s), wave {wave}")
        outcomes = cached.run_all(list(asked.values()))
        for (key, _), outcome in zip(list(asked.items()), outcomes):
            try:
                asked[key] = chains[key].send(outcome)
            except StopIteration as stop:
                answers[key] = stop.value
                del asked[key]
    return answers


def _what_the_output_is(cell: Cell, cached: "_Cached", runner: Runner) -> None:
    """A failing cell that is not rounding: whether its output is exact attention of the layer with a feature taken
    away (kvdbg.moves.whatif), on this process's CPU from the cell's snapshot. A match makes an unknown cause
    semantic (a backend with no float32 path, FLASHINFER) and says which feature the backend did not apply."""
    if cell.cause == "rounding":
        return
    snapshot = cached.run(cell.row, cell.kind).snapshot
    if snapshot is None:
        return
    from kvdbg.moves.whatif import explain_output

    args = getattr(runner, "args", runner)
    try:
        found = explain_output(snapshot, atol=getattr(args, "atol", None), rtol=getattr(args, "rtol", None))
    except Exception as exc:  # noqa: BLE001 - the cell's verdict stands; the JSON says the what-if did not run
        cell.engine_computed = {"error": f"{type(exc).__name__}: {exc}"}
        return
    if found is None:
        return
    cell.engine_computed = found.to_json()
    if cell.cause == "unknown":
        cell.cause = "semantic"
    cell.cause_detail = f"{cell.cause_detail}; {found.sentence()}" if cell.cause_detail else found.sentence()


def _write_cell(cell: Cell, cached: _Cached, out_dir: str | None, force: bool, backend: str) -> None:
    """With an output directory, the failing cell's snapshot and its minimal combination's."""
    if out_dir is None:
        return
    stem = f"{FILE_PREFIX}{_file_name(backend)}-{cell.row_id:02d}-{cell.kind}"
    outcome = cached.run(cell.row, cell.kind)
    cell.snapshot_path = _write(outcome.snapshot, os.path.join(out_dir, f"{stem}.safetensors"), force)
    if cell.minimal is not None and cell.minimal != full_row(cell.row):
        smallest = cached.run(cell.minimal, cell.kind)
        cell.minimal_path = _write(smallest.snapshot, os.path.join(out_dir, f"{stem}-minimal.safetensors"), force)


def minimise(cached, row: Mapping[str, str], kind: str, factors: Iterable[Factor]) -> dict:
    """Drop features one at a time (each back to its baseline) while the cell keeps failing, until none can go."""
    chain = _minimal(row, kind, list(factors))
    try:
        request = next(chain)
        while True:
            request = chain.send(cached.run(request[0], request[1]))
    except StopIteration as stop:
        return stop.value


def _write(snapshot, path: str, force: bool) -> str | None:
    if snapshot is None:
        return None
    from kvdbg.snapshot.store import save_snapshot

    os.makedirs(os.path.dirname(path), exist_ok=True)
    return save_snapshot(snapshot, path, overwrite=force)


def _file_name(backend: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in backend)


def _num(value: float | None) -> str:
    return "nan" if value is None or value != value else format(value, ".2e")


def check_out_dir(out_dir: str | None, force: bool) -> None:
    """Refuse, before any work, an --out that is a file, whose parent does not exist, or that already holds
    conform snapshots (unless --force). The directory itself is made when the first snapshot is written."""
    if out_dir is None:
        return
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OptionError(f"--out {out_dir}: exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise OptionError(f"--out {out_dir}: its parent directory {parent} does not exist")
    if os.path.isdir(out_dir) and not force:
        taken = sorted(n for n in os.listdir(out_dir) if n.startswith(FILE_PREFIX) and n.endswith(".safetensors"))
        if taken:
            raise OptionError(f"--out {out_dir}: already holds {len(taken)} conform snapshot(s) ({taken[0]}, ...); "
                              "give another directory, or --force to replace them")


# --------------------------------------------------------------------------- the real runner


ENGINE_ALIASES = {"FLEX": "FLEX_ATTENTION", "CPU": "CPU_ATTN"}


def engine_backend_name(name: str) -> str:
    key = name.strip().upper().replace("-", "_")
    return ENGINE_ALIASES.get(key, key)


def engine_backends(device: str) -> tuple[list[str], str | None]:
    """The backends of the installed vLLM's registry that can run on ``device`` here, and why none can."""
    from kvdbg.backends._vllm_engine import platform_reason, vllm_installed

    if not vllm_installed():
        return [], ("vLLM is not installed in this environment: conform runs an installed engine's backends "
                    "(install kvdbg into the engine's environment)")
    import importlib

    from kvdbg.backends._vllm_engine import REGISTRY_MODULE, _quiet_vllm, _vllm_warnings_off

    _quiet_vllm()
    try:
        with _vllm_warnings_off():
            registry = importlib.import_module(REGISTRY_MODULE)
    except Exception as exc:
        return [], f"vLLM's backend registry does not import: {type(exc).__name__}: {str(exc)[:200]}"
    names = [n for n in registry.AttentionBackendEnum.__members__ if platform_reason(n, device) is None]
    return names, None if names else f"no backend of vLLM's registry runs on {device} here"


class EngineRunner:
    """Cells through the ``vllm`` column (the installed vLLM's own code for ``backend``) and the reference."""

    def __init__(self, backend: str, device: str = "cpu", *, seed: int = 0, atol: float | None = None,
                 rtol: float | None = None):
        from kvdbg.backends._vllm_engine import backend_class, platform_reason, registered, vllm_installed
        from kvdbg.replayer.runner import resolve_device

        self.backend, self.seed, self.atol, self.rtol = engine_backend_name(backend), seed, atol, rtol
        self.device = resolve_device(device)
        if not vllm_installed():
            raise BackendUnavailable(f"--backend {backend}: vLLM is not installed in this environment, so its "
                                     "backends cannot run here")
        registered(self.backend)
        reason = platform_reason(self.backend, self.device)
        if reason is not None:
            raise BackendUnavailable(f"--backend {backend}: {reason}")
        backend_class(self.backend)

    def _replay(self, row: Mapping[str, str], kind: str):
        from kvdbg.backends.base import ReplayOptions
        from kvdbg.moves.synth import synth_snapshot
        from kvdbg.replayer.runner import replay

        snap = synth_snapshot(spec_for(self.backend, row, kind, self.seed))
        return snap, replay(snap, ["reference", "vllm"], ReplayOptions(device=self.device), required=["vllm"])

    def refusal(self, row: Mapping[str, str]) -> str | None:
        """What the backend says against ``row`` when the vllm column is set up for it (vLLM's own checks)."""
        from kvdbg.backends.base import ReplayOptions
        from kvdbg.moves.synth import synth_snapshot
        from kvdbg.replayer.runner import load_backends

        snap = synth_snapshot(spec_for(self.backend, row, KINDS[0], self.seed))
        statuses = load_backends(["vllm"], snap.meta, ReplayOptions(device=self.device))[0]
        return None if statuses[0].available else statuses[0].reason

    # In one process the float32 path runs as the backend runs it (Triton: TF32 products on a GPU). IEEE float32
    # products need a process started with TRITON_F32_DEFAULT=ieee (Triton keys a compiled kernel in a process
    # by its arguments, not by that variable): the workers of kvdbg.fleet.conform_pool, where ``exact`` runs go.
    exact_float32 = False

    def run(self, row: Mapping[str, str], kind: str, exact: bool = False) -> Outcome:
        start = time.perf_counter()
        try:
            snap, result = self._replay(row, kind)
        except BackendUnavailable as exc:
            return Outcome(REFUSED, reason=_refusal_text(str(exc)))
        seconds = time.perf_counter() - start
        outcome = self._judge(snap, result)
        outcome.seconds = seconds
        outcome.build_seconds = next((st.info.jit_build_seconds for st in result.backends
                                      if st.name == "vllm" and st.info), None)
        return outcome

    def _judge(self, snap, result) -> Outcome:
        from kvdbg.judge.compare import compare_step
        from kvdbg.judge.verdict import EXIT_OK, judge
        from kvdbg.snapshot.store import torch_dtype

        vllm = next(st for st in result.backends if st.name == "vllm")
        kernel = vllm.info.kernel if vllm.info else None
        comparisons, errors = [], []
        for step in result.steps:
            run = step.runs.get("vllm")
            if run is not None and run.error:
                errors.append(f"step {step.step}: raised {run.error}")
            comparisons += [c for c in compare_step(step, snap.meta, atol=self.atol, rtol=self.rtol)
                            if c.actual == "vllm" and c.expected == "reference"]
        tolerance = comparisons[0].tolerance if comparisons else None
        rule = f"{tolerance.rule} ({tolerance.source})" if tolerance else None
        for step in result.steps:  # the backend's output, stored as the engine's: the snapshot shows the failure
            run = step.runs.get("vllm")
            if run is not None and run.output is not None:
                snap.steps[step.step].output = run.output.detach().cpu().to(torch_dtype(snap.meta.layer.dtype))
        failed = [(c.step, h) for c in comparisons for h in c.failed]
        # The one verdict rule: the column's comparisons with the reference, its error findings (a raise is one)
        # and those about the step's inputs.
        findings = [f for f in result.findings if f.backend in ("vllm", "replay")]
        verdict = judge(comparisons, findings)
        if verdict.exit_code != EXIT_OK:
            first = None
            if failed:
                step, head = min(failed, key=lambda sh: (sh[0], sh[1].request, sh[1].head))
                starts = next(s.common.query_start_loc for s in result.steps if s.step == step)
                first = {"step": step, "request": head.request, "head": head.head,
                         "token": head.worst_token - int(starts[head.request]),
                         "max_abs": _finite(head.max_abs)}
            worst = [c.failed_max_abs for c in comparisons if c.failed and c.failed_max_abs == c.failed_max_abs]
            reason = "; ".join(errors) or (None if failed else verdict.summary)
            if failed and not worst:
                reason = "the failing heads hold no finite number (NaN/inf, or tokens the backend did not write)"
            return Outcome(FAIL, max_abs=max(worst) if worst else None, first=first, reason=reason, tolerance=rule,
                           kernel=kernel, snapshot=snap)
        return Outcome(PASS, max_abs=_finite(max(c.max_abs for c in comparisons)), tolerance=rule, kernel=kernel)


def _finite(value: float | None) -> float | None:
    return None if value is None or value != value else float(value)


def _refusal_text(text: str) -> str:
    for prefix in ("backend vllm cannot run: ",):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def conform(backends: Iterable[str] | None = None, device: str = "cpu", *, features: Iterable[str] | None = None,
            kinds: Iterable[str] = KINDS, full: bool = False, out_dir: str | None = None, force: bool = False,
            seed: int = 0, atol: float | None = None, rtol: float | None = None,
            progress: Callable[[int, int, str], None] | None = None,
            make_runner: Callable[[str], Runner] | None = None,
            rows: Iterable[int] | None = None) -> ConformResult:
    """Conform the named backends (default: every backend of the installed engine that runs on ``device``).

    ``make_runner(name)`` makes each backend's runner (default: an :class:`EngineRunner` in this process;
    `kvdbg conform --jobs N` gives worker processes, kvdbg.fleet.conform_pool); a runner with ``close``
    is closed when its backend is done. ``rows``: only these rows of each backend's matrix (`--rows`)."""
    from kvdbg.moves.conform.matrix import factors_named

    factors = list(FACTORS if features is None else factors_named(features))
    kinds = tuple(dict.fromkeys(kinds))
    rows = None if rows is None else sorted(set(rows))
    if rows is not None and (not rows or rows[0] < 0):
        raise OptionError("--rows: give row numbers from 0, as conform's table numbers them")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise OptionError(f"--batch: unknown batch kind {bad[0]!r} (choose from: {', '.join(KINDS)})" if bad
                          else "--batch: give at least one batch kind")
    if full:
        matrix_rows(factors, True)  # refuse a product that is not small before any work
    check_out_dir(out_dir, force)
    result = ConformResult([], out_dir)
    if backends is None:
        from kvdbg.replayer.runner import resolve_device

        names, reason = engine_backends(resolve_device(device))
        if not names:
            result.backends.append(BackendConform("engine", "full" if full else "pairwise", kinds, reason=reason))
            return result
    else:
        names = [engine_backend_name(n) for n in backends]
    make = make_runner or (lambda name: EngineRunner(name, device, seed=seed, atol=atol, rtol=rtol))
    for name in dict.fromkeys(names):  # one backend at a time: a pooled runner's workers leave with it
        if progress:
            progress(0, 0, f"{name} loading the engine")
        try:
            runner = make(name)
        except BackendUnavailable as exc:
            if backends is not None:
                raise
            result.backends.append(BackendConform(name, "full" if full else "pairwise", kinds, reason=str(exc)))
            continue
        try:
            result.backends.append(conform_backend(runner, factors, kinds=kinds, full=full, out_dir=out_dir,
                                                   force=force, progress=progress, only_rows=rows))
        except OptionError as exc:
            if rows is None or not result.backends:
                raise  # nothing ran yet: the option is refused outright
            # --rows beyond a later backend's (smaller) matrix: the backends before it keep what they ran
            result.backends.append(BackendConform(name, "full" if full else "pairwise", kinds, reason=str(exc)))
        finally:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
        if result.interrupted:  # the backends after it are not begun
            break
    return result


__all__ = ["BackendConform", "Cell", "ConformResult", "EngineRunner", "Outcome", "conform", "conform_backend",
           "failure_kind",
           "conform_verdict", "engine_backend_name", "engine_backends", "matrix_rows", "minimise", "check_out_dir"]
