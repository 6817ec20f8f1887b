"""Sweeps: the same snapshot replayed with one knob changed at a time, as a variant × backend matrix.

Every variant is a full replay (kvdbg.replayer.runner) of a modified copy of the
snapshot, compared with kvdbg.judge.compare's rule. What a variant changes decides what
its results are held against:

===========  ===============================================  ========  =========
knob         variant                                          captured  reference
===========  ===============================================  ========  =========
placement    stored pages moved to other engine ids (page     applies   same
             data, block tables and slots relabelled
             together; pages stored in id order)
flex-block   flex's BlockMask query block (BLOCK_M)           applies   same
compile      flex eager vs torch.compile                      applies   same
device       cpu vs cuda                                      applies   same
query-len    each request keeps its last n query tokens       kept rows same rows
             (the step's new K/V are still all written)
kv-dtype     the cache re-stored as bf16 / fp16 (model dtype  no        moves
             too: ``auto`` follows it) or fp8 e4m3 (captured
             or unit scales), from its dequantised values
scales       an FP8 cache's q/k/v scales replaced (unit,      no        moves
             k and v swapped, q only), bytes unchanged
window       the sliding window: none, captured ± 1           no        moves
===========  ===============================================  ========  =========

*captured applies*: the engine's output still answers the variant's inputs
(the attention it defines is unchanged), so backends are compared with it as
in the baseline, and so is the reference. Otherwise the engine's output answers
another configuration: backends are compared with the variant's own reference
only, and the captured column says so.

*reference same*: the exact answer must not move, so the reference column
checks the variant's reference against the baseline's (a pass/fail cell).
*moves*: the knob changes the exact answer itself; the column shows by how much
(max abs against the baseline reference), which is the knob's effect, not a
verdict.

A cell *flips* when its pass/fail differs from the baseline row's in the same
column. The verdict and exit code are the baseline's, the snapshot as
captured, by kvdbg.judge.verdict's one rule (what `kvdbg replay` says);
variants are what-ifs, named after it and never counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable

from kvdbg.errors import KvdbgError
from kvdbg.moves.sweep_variants import (KNOB_MEANING, KNOBS, Variant, free_page_id, parse_knobs, relabel_pages,
                                        retype_snapshot, shorten_queries, variants_for)

if TYPE_CHECKING:
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.judge.compare import Comparison
    from kvdbg.replayer.runner import ReplayResult
    from kvdbg.snapshot.store import Snapshot
    from kvdbg.judge.verdict import Verdict


# --------------------------------------------------------------------------- results


@dataclass
class Cell:
    """One backend (or the engine's output) under one variant."""

    column: str
    status: str  # "pass" | "fail" | "n/a" | "moves" (the exact answer's shift, not a verdict) | "baseline"
    max_abs: float | None = None  # vs the reference (reference column: vs the baseline reference)
    reason: str | None = None  # why n/a, or what failed
    counted: bool = True
    flipped: bool = False

    @property
    def judged(self) -> bool:
        return self.status in ("pass", "fail")

    def to_json(self) -> dict:
        return {"column": self.column, "status": self.status, "max_abs": self.max_abs, "reason": self.reason,
                "counted": self.counted, "flipped": self.flipped}


@dataclass
class SweepRow:
    variant: Variant
    cells: dict[str, Cell] = field(default_factory=dict)
    input_errors: list[str] = field(default_factory=list)  # error findings about the variant's inputs
    error: str | None = None  # the variant could not be replayed (its reference raised)
    # Backends that could not run under this variant, with why (their cell n/a): said in the verdict's summary, not
    # left to the table alone, since the variant then compares nothing of theirs.
    not_run: list[tuple[str, str]] = field(default_factory=list)

    @property
    def flipped(self) -> list[str]:
        return [c.column for c in self.cells.values() if c.flipped]

    def to_json(self) -> dict:
        return {**self.variant.to_json(), "variant": self.variant.name, "error": self.error,
                "input_errors": self.input_errors, "flipped": self.flipped,
                "not_run": [{"backend": name, "reason": reason} for name, reason in self.not_run],
                "cells": {name: cell.to_json() for name, cell in self.cells.items()}}


@dataclass
class SweepColumn:
    name: str
    engine_name: str | None
    counted: bool


@dataclass
class SweepResult:
    path: str | None
    knobs: list[str]
    columns: list[SweepColumn]
    unavailable: list[tuple[str, str]]  # (backend, why) not run under the baseline: no column
    rows: list[SweepRow]  # baseline first
    baseline_verdict: "Verdict | None" = None  # the snapshot's own verdict (kvdbg.judge.verdict.judge)

    @property
    def baseline(self) -> SweepRow:
        return self.rows[0]

    def to_json(self) -> dict:
        return {"snapshot": self.path, "knobs": self.knobs,
                "columns": [{"name": c.name, "engine_name": c.engine_name, "counted": c.counted}
                            for c in self.columns],
                "unavailable": [{"backend": n, "reason": r} for n, r in self.unavailable],
                "rows": [r.to_json() for r in self.rows]}


# --------------------------------------------------------------------------- running


def sweep(snapshot: "Snapshot", knobs: Iterable[str], backends: Iterable[str] | None = None,
          options: "ReplayOptions | None" = None, *, steps: Iterable[int] | None = None,
          required: Iterable[str] = (), atol: float | None = None, rtol: float | None = None,
          progress: Callable[[str], None] | None = None) -> SweepResult:
    """Replay the baseline, then every variant of every knob; see the module docstring."""
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.backends import DEFAULT_ORDER
    from kvdbg.replayer.runner import resolve_device
    from kvdbg.judge.verdict import counted_backends

    knobs = parse_knobs(list(knobs))
    options = options or ReplayOptions()
    options.device = resolve_device(options.device)
    names = list(dict.fromkeys(backends if backends is not None else DEFAULT_ORDER))
    if "reference" not in names:
        names.insert(0, "reference")
    steps = None if steps is None else sorted(set(steps))
    required = list(dict.fromkeys(required))

    baseline = Variant("baseline", "as captured", "the snapshot as captured, with the options given")
    if progress:
        progress("baseline")
    base = _replay_variant(snapshot, options, names, steps, required, None, atol, rtol, progress=None)
    result_0, comparisons_0, _ = base
    counted = counted_backends(snapshot.meta.backend.name,
                               [(st.name, st.engine_name) for st in result_0.backends], required)
    has_captured = any(s.captured_output is not None for s in result_0.steps)
    columns = [SweepColumn(st.name, st.engine_name, st.name in counted) for st in result_0.backends if st.available]
    if has_captured:
        columns.append(SweepColumn("captured", None, True))
    unavailable = [(st.name, st.reason or "") for st in result_0.backends if not st.available]
    reference_0 = {s.step: s.runs["reference"].output.detach().cpu() for s in result_0.steps}
    rows = [_row(baseline, result_0, comparisons_0, None, columns, reference_0, atol, rtol)]

    for knob in knobs:
        for variant in variants_for(snapshot, knob, replace(options), names):
            row = SweepRow(variant)
            if variant.skipped is None:
                if progress:
                    progress(variant.name)
                try:
                    variant_snapshot, variant_options, kept = variant.build()
                    replayed = _replay_variant(variant_snapshot, variant_options, names, steps, (), kept, atol,
                                               rtol)
                except KvdbgError as exc:
                    variant.skipped = str(exc)
                except Exception as exc:  # the variant's reference raised: the row says so and fails
                    row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
                else:
                    row = _row(variant, replayed[0], replayed[1], replayed[2], columns, reference_0, atol, rtol)
                finally:
                    variant.build = None  # drop the closure (and any copy of the cache it made)
            if variant.skipped is not None or row.error is not None:
                for col in columns:
                    row.cells[col.name] = Cell(col.name, "n/a", reason=variant.skipped or row.error,
                                               counted=col.counted)
            rows.append(row)
    _mark_flips(rows)
    return SweepResult(snapshot.path, knobs, columns, unavailable, rows,
                       result_0.judge(atol=atol, rtol=rtol).verdict)


def _replay_variant(snapshot, options, names, steps, required, kept, atol, rtol, progress=None):
    from kvdbg.judge.compare import compare_step
    from kvdbg.replayer.runner import replay

    result = replay(snapshot, names, replace(options), steps=steps, required=required, progress=progress)
    comparisons = [c for s in result.steps for c in compare_step(s, snapshot.meta, atol=atol, rtol=rtol)]
    return result, comparisons, kept


def _row(variant: Variant, result: "ReplayResult", comparisons: list["Comparison"], kept, columns, reference_0,
         atol, rtol) -> SweepRow:
    from kvdbg.judge.compare import compare, default_tolerance

    row = SweepRow(variant)
    findings = result.findings
    row.input_errors = sorted({f.code for f in findings if f.backend == "replay" and f.severity == "error"})
    statuses = {st.name: st for st in result.backends}
    baseline = variant.knob == "baseline"
    for col in columns:
        name = col.name
        if name == "reference":
            if baseline:
                row.cells[name] = Cell(name, "baseline", counted=col.counted,
                                       reason="the exact answer the other columns are held against")
                continue
            shifts = []
            for s in result.steps:
                ref = s.runs["reference"]
                expected = reference_0[s.step]
                if kept is not None:
                    expected = expected.index_select(0, kept[s.step])
                dtype = ref.info.dtype if ref.info is not None else "float32"
                shifts.append(compare(ref.output, expected, s.common.query_start_loc, s.common.seq_lens,
                                      default_tolerance(dtype, atol=atol, rtol=rtol), actual_name="reference",
                                      expected_name="baseline reference", step=s.step))
            worst = _worst(shifts)
            if variant.same_answer:
                failed = [c for c in shifts if not c.passed]
                reason = (f"moved from the baseline's on {sum(len(c.failed) for c in failed)} head(s)"
                          if failed else None)
                row.cells[name] = Cell(name, "fail" if failed else "pass", worst, reason, col.counted)
            else:
                row.cells[name] = Cell(name, "moves", worst, "the knob changes the exact answer: max abs against "
                                       "the baseline reference (its effect, not a verdict)", col.counted)
            continue
        if name == "captured":
            if not variant.captured_applies:
                row.cells[name] = Cell(name, "n/a", counted=col.counted,
                                       reason="the engine's output answers the captured configuration, not this one")
                continue
            mine = [c for c in comparisons if c.actual == "captured" and c.heads]
            row.cells[name] = _judge(name, mine, [], col.counted, "no captured output to compare")
            continue
        status = statuses.get(name)
        if status is None or not status.available:
            reason = (status.reason if status is not None else None) or "not run"
            row.cells[name] = Cell(name, "n/a", counted=col.counted, reason=reason)
            row.not_run.append((name, reason))
            continue
        runs = [s.runs[name] for s in result.steps if name in s.runs]
        if runs and all(r.not_applicable is not None for r in runs):
            row.cells[name] = Cell(name, "n/a", counted=col.counted, reason=runs[0].not_applicable)
            continue
        mine = [c for c in comparisons if c.actual == name and c.heads]
        errors = [f.code for f in findings if f.backend == name and f.severity == "error"]
        row.cells[name] = _judge(name, mine, errors, col.counted, "nothing compared")
    return row


def _worst(comparisons) -> float | None:
    # a failing comparison's error is its failing heads' (a passing head's says nothing about the failure)
    values = [c.shown_max_abs for c in comparisons if c.heads and c.shown_max_abs == c.shown_max_abs]
    return max(values) if values else None


def _judge(name: str, comparisons, errors: list[str], counted: bool, empty: str) -> Cell:
    vs_reference = [c for c in comparisons if c.expected == "reference"] or comparisons
    worst = _worst(vs_reference)
    if not comparisons and not errors:
        return Cell(name, "n/a", None, empty, counted)
    failed = [c for c in comparisons if not c.passed]
    parts = []
    for expected in dict.fromkeys(c.expected for c in failed):
        these = [c for c in failed if c.expected == expected]
        heads = sum(len(c.failed) for c in these)
        total = sum(len(c.heads) for c in comparisons if c.expected == expected)
        parts.append(f"vs {expected}: {heads} of {total} heads fail")
    if errors:
        parts.append(f"{len(errors)} error finding(s) ({', '.join(sorted(set(errors)))})")
    if worst is None and any(c.nonfinite for c in comparisons):
        parts.append("nothing finite to compare")
    return Cell(name, "fail" if parts else "pass", worst, "; ".join(parts) or None, counted)


def _mark_flips(rows: list[SweepRow]) -> None:
    base = rows[0].cells
    for row in rows[1:]:
        for name, cell in row.cells.items():
            before = base.get(name)
            reference_default = name == "reference" and before is not None and before.status == "baseline"
            was = "pass" if reference_default else (before.status if before is not None else None)
            if cell.judged and was in ("pass", "fail") and cell.status != was:
                cell.flipped = True


# --------------------------------------------------------------------------- verdict


def sweep_verdict(result: SweepResult) -> "Verdict":
    """The snapshot's verdict (the baseline replay, by kvdbg.judge.verdict.judge: the same word and exit code as
    `kvdbg replay`), followed by what the variants show. A variant is a what-if -- the snapshot as it was not
    captured -- so its flips are named, never counted: a knob that makes a backend fail is a finding about the
    knob, not about this snapshot."""
    from dataclasses import replace as replace_verdict

    from kvdbg.judge.verdict import replay_verdict

    base = result.baseline
    verdict = result.baseline_verdict or replay_verdict([], [])
    flips = [(row, row.cells[name]) for row in result.rows[1:] for name in row.flipped]
    parts = []
    if flips:
        steady = [c.name for c in result.columns if c.name not in {x.column for _, x in flips}
                  and any(r.cells[c.name].judged for r in result.rows)]
        parts.append("variants (what-if, not counted): verdict flips: "
                     + "; ".join(_flip_phrase(row, cell, base) for row, cell in flips)
                     + (f"; never flips: {', '.join(steady)}" if steady else ""))
    elif len(result.rows) > 1:
        parts.append("no variant flips a verdict")
    errored = sorted({row.variant.name for row in result.rows[1:] if row.input_errors})
    if errored:
        parts.append(f"error findings about the inputs under: {', '.join(errored)}")
    broken = [row.variant.name for row in result.rows[1:] if row.error]
    if broken:
        parts.append(f"could not replay: {', '.join(broken)}")
    # A backend that ran as captured but not under a variant (one that never ran is the baseline verdict's to say).
    absent = {name for name, _ in base.not_run}
    not_run = [f"{name} under {row.variant.name} ({reason})" for row in result.rows[1:] for name, reason in row.not_run
               if name not in absent]
    if not_run:
        parts.append(f"could not run: {'; '.join(not_run)}")
    skipped = [row.variant.name for row in result.rows[1:] if row.variant.unavailable_here]
    if skipped:
        parts.append(f"not run here: {', '.join(skipped)}")
    return replace_verdict(verdict, summary="; ".join([verdict.summary] + parts))


def _flip_phrase(row: SweepRow, cell: Cell, base: SweepRow) -> str:
    before = base.cells.get(cell.column)
    was = "pass" if before is None or before.status == "baseline" else before.status
    return f"{cell.column} under {row.variant.name} ({was} → {cell.status})"


__all__ = ["Cell", "KNOBS", "KNOB_MEANING", "SweepColumn", "SweepResult", "SweepRow", "Variant", "free_page_id",
           "parse_knobs", "relabel_pages", "retype_snapshot", "shorten_queries", "sweep", "sweep_verdict",
           "variants_for"]
