"""Which heads are wrong: a judged replay's errors as request x head maps, and each comparison's error over steps.

A map is one comparison (a backend against the reference, a backend or the
engine's output against the captured output) over the steps replayed: each
cell is one (request, head), holding the worst of its steps. Cells are graded
against the comparison's own absolute tolerance (``atol``), so one scale reads
for every dtype: exact, below atol/100, atol/10, atol, 10·atol, above; a cell
outside the pass rule is *failing* whatever its grade, and a cell whose error
is not a number says why (the compared side produced NaN/inf, did not write
the token, or the expected side is non-finite). Built from
:class:`kvdbg.judge.compare.Comparison` records only: no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

# Grades, weakest first; a cell's grade is where its max abs error falls against atol.
EXACT, TINY, SMALL, BELOW, ABOVE, FAR = "exact", "< atol/100", "< atol/10", "< atol", "< 10 atol", ">= 10 atol"
GRADES = (EXACT, TINY, SMALL, BELOW, ABOVE, FAR)
# Why a cell has no number (compare.HeadDiff's causes), strongest first.
NONFINITE, UNWRITTEN, EXPECTED_NONFINITE = "nan/inf", "unwritten", "expected nan/inf"
CAUSES = (NONFINITE, UNWRITTEN, EXPECTED_NONFINITE)


@dataclass(frozen=True)
class Cell:
    """One (request, head) of one comparison: the worst of the steps shown."""

    request: int
    head: int
    step: int  # the step the worst value comes from
    max_abs: float  # NaN when nothing could be compared
    failed: bool
    cause: str  # "" or one of CAUSES: why some elements were not compared
    worst_token: int  # within the request (0 .. query_len - 1)
    grade: str  # one of GRADES ("" when nothing was compared)

    @property
    def rank(self) -> tuple:
        """Orders cells worst last: failing, then a missing number, then the error."""
        error = self.max_abs if self.max_abs == self.max_abs else math.inf
        return (self.failed, bool(self.cause), error)

    def to_json(self) -> dict[str, Any]:
        return {"request": self.request, "head": self.head, "step": self.step,
                "max_abs": None if self.max_abs != self.max_abs else self.max_abs, "failed": self.failed,
                "cause": self.cause or None, "worst_token": self.worst_token, "grade": self.grade or None}


@dataclass
class ErrorMap:
    """One comparison as a request x head grid (rows: requests, columns: heads)."""

    actual: str  # backend name, or "captured"
    expected: str  # "reference" or "captured"
    steps: list[int]
    counted: bool  # its failures set the exit code (False: a what-if column)
    atol: float
    rtol: float
    requests: list[int]
    heads: list[int]
    cells: dict[tuple[int, int], Cell] = field(default_factory=dict)  # (request, head) -> worst cell

    @property
    def title(self) -> str:
        return f"{self.actual} vs {self.expected}"

    @property
    def failed(self) -> list[Cell]:
        return [c for c in self.cells.values() if c.failed]

    @property
    def max_abs(self) -> float:
        finite = [c.max_abs for c in self.cells.values() if c.max_abs == c.max_abs]
        return max(finite) if finite else float("nan")

    def worst(self) -> Cell | None:
        return max(self.cells.values(), key=lambda c: c.rank, default=None)

    @property
    def failed_max_abs(self) -> float:
        """The largest finite error over the failing cells; NaN when none of them holds one."""
        finite = [c.max_abs for c in self.failed if c.max_abs == c.max_abs]
        return max(finite) if finite else float("nan")

    def summary(self) -> str:
        steps = _steps_text(self.steps)
        failed = len(self.failed)
        verdict = f"{failed} of {len(self.cells)} heads fail" if failed else f"all {len(self.cells)} heads pass"
        what_if = "" if self.counted else " (what-if: does not set the exit code)"
        # A failure's error comes from its failing heads, never from a passing one (kvdbg.judge.compare's rule).
        if failed and self.failed_max_abs != self.failed_max_abs:
            error = "failing heads: no finite error"
        else:
            error = f"max abs {_fmt(self.failed_max_abs if failed else self.max_abs)}"
        return f"{self.title}, {steps}: {verdict}, {error}{what_if}"

    def to_json(self) -> dict[str, Any]:
        worst = self.worst()
        return {"actual": self.actual, "expected": self.expected, "steps": self.steps, "counted": self.counted,
                "atol": self.atol, "rtol": self.rtol, "requests": self.requests, "heads": self.heads,
                "failed_cells": len(self.failed), "cells_compared": len(self.cells),
                "max_abs": None if self.max_abs != self.max_abs else self.max_abs,
                "worst": None if worst is None else worst.to_json(), "summary": self.summary(),
                "cells": [self.cells[key].to_json() for key in sorted(self.cells)]}


@dataclass(frozen=True)
class StepPoint:
    step: int
    max_abs: float  # NaN when nothing was compared
    failed_heads: int
    heads: int


@dataclass
class StepSeries:
    """One comparison's worst error and failing heads, step by step."""

    actual: str
    expected: str
    counted: bool
    points: list[StepPoint]

    @property
    def title(self) -> str:
        return f"{self.actual} vs {self.expected}"

    @property
    def first_failure(self) -> int | None:
        return next((p.step for p in self.points if p.failed_heads), None)

    def to_json(self) -> dict[str, Any]:
        return {"actual": self.actual, "expected": self.expected, "counted": self.counted,
                "first_failing_step": self.first_failure,
                "points": [{"step": p.step, "max_abs": None if p.max_abs != p.max_abs else p.max_abs,
                            "failed_heads": p.failed_heads, "heads": p.heads} for p in self.points]}


@dataclass
class ErrorPictures:
    """Everything the error pictures of a replay show."""

    snapshot: str | None
    maps: list[ErrorMap]
    series: list[StepSeries]  # empty for a one-step replay
    steps: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot, "steps": self.steps, "grades": list(GRADES), "causes": list(CAUSES),
                "maps": [m.to_json() for m in self.maps], "over_steps": [s.to_json() for s in self.series]}


def grade(max_abs: float, atol: float) -> str:
    if max_abs != max_abs:
        return ""
    if max_abs == 0:
        return EXACT
    if atol <= 0:
        return FAR
    for limit, name in ((atol / 100, TINY), (atol / 10, SMALL), (atol, BELOW), (10 * atol, ABOVE)):
        if max_abs < limit:
            return name
    return FAR


def _cause(head) -> str:
    if head.actual_nonfinite:
        return NONFINITE
    if head.unwritten:
        return UNWRITTEN
    if head.expected_nonfinite:
        return EXPECTED_NONFINITE
    return ""


def error_pictures(report, *, counted: Iterable[str] | None = None) -> ErrorPictures:
    """The maps and step series of a judged replay (kvdbg.replayer.runner.ReplayReport)."""
    result = report.result
    counted = set(result.counted if counted is None else counted)
    starts = result.query_starts()
    steps = [s.step for s in result.steps]
    num_heads = result.meta.layer.num_heads
    maps: dict[tuple[str, str], ErrorMap] = {}
    per_step: dict[tuple[str, str], list[StepPoint]] = {}
    for c in report.comparisons:
        key = (c.actual, c.expected)
        m = maps.get(key)
        if m is None:
            # The engine's output is judged whenever it is compared; a backend by the verdict's rule.
            judged = c.actual == "captured" or c.actual in counted
            m = maps[key] = ErrorMap(c.actual, c.expected, [], judged, c.tolerance.atol, c.tolerance.rtol, [], [])
        if c.step not in m.steps:
            m.steps.append(c.step)
        first = starts.get(c.step, [])
        for h in c.heads:
            token = h.worst_token - first[h.request] if h.request < len(first) else h.worst_token
            cell = Cell(h.request, h.head, c.step, h.max_abs, not h.passed, _cause(h), token,
                        grade(h.max_abs, c.tolerance.atol))
            old = m.cells.get((h.request, h.head))
            if old is None or cell.rank > old.rank:
                m.cells[(h.request, h.head)] = cell
        per_step.setdefault(key, []).append(StepPoint(c.step, c.max_abs, len(c.failed), len(c.heads)))
    for m in maps.values():
        m.requests = sorted({r for r, _ in m.cells})
        m.heads = sorted({h for _, h in m.cells}) or list(range(num_heads))
    series = []
    if len(steps) > 1:
        series = [StepSeries(a, e, maps[(a, e)].counted, sorted(points, key=lambda p: p.step))
                  for (a, e), points in per_step.items()]
    return ErrorPictures(result.path, list(maps.values()), series, steps)


def worst_failing(pictures: ErrorPictures, backends: Iterable[str] | None = None) -> tuple[ErrorMap, Cell] | None:
    """The worst cell of the backend comparisons against the reference: failing ones first, judged ones first."""
    wanted = None if backends is None else set(backends)
    best = None
    for m in pictures.maps:
        if m.expected != "reference" or m.actual == "captured" or (wanted is not None and m.actual not in wanted):
            continue
        cell = m.worst()
        if cell is None:
            continue
        key = (cell.failed, m.counted, *cell.rank[1:])
        if best is None or key > best[0]:
            best = (key, m, cell)
    return None if best is None else (best[1], best[2])


def _steps_text(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}-{steps[-1]} (worst of each cell)" if steps == list(range(steps[0], steps[-1] + 1)) \
        else "steps " + ",".join(map(str, steps)) + " (worst of each cell)"


def _fmt(value: float) -> str:
    if value != value:
        return "nan"
    return "0" if value == 0 else f"{value:.2e}"


__all__ = ["CAUSES", "Cell", "ErrorMap", "ErrorPictures", "GRADES", "StepPoint", "StepSeries", "error_pictures",
           "grade", "worst_failing"]
