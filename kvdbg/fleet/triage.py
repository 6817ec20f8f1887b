"""Failing rows grouped by what failed, so that "300 files, 2 causes" reads at a glance (no torch).

A row's *signature* is what failed, with what is particular to one file taken
out (its path, its request numbers, sizes and offsets in a message):

- a failing row: each counted comparison that fails — which backend against
  which expectation, which query heads (``all 8 heads`` or ``heads 0-3 of 8``,
  over every request and step of the file) and how (outside tolerance, NaN/Inf
  output, unwritten tokens, NaN/Inf on the expected side) — and the codes of
  its error findings;
- a file that is bad input, or on which kvdbg raised, or whose worker process
  died: the one-line reason with its numbers replaced by ``N``;
- a file that verified nothing: its verdict line.

Rows with the same signature form a group. Groups are listed failures first,
then the biggest; each names the smallest file of the group as its example
(quickest to replay) and the command that replays it with the run's options.
`kvdbg replay DIR` prints this under its table; `kvdbg triage RESULTS` prints it
from a results file alone.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvdbg.replayer.batch import (STATUS_BAD_INPUT, STATUS_CRASHED, STATUS_FAIL, STATUS_PASS, STATUS_UNVERIFIED,
                         FileResult, step_rows)
from kvdbg.util.ranges import IntRanges
from kvdbg.fleet.results import WORKER_DIED, Row

KIND_FAIL, KIND_CRASHED, KIND_DIED = "fail", "crashed", "worker died"
KIND_BAD_INPUT, KIND_UNVERIFIED = "bad input", "unverified"
KIND_ORDER = (KIND_FAIL, KIND_CRASHED, KIND_DIED, KIND_BAD_INPUT, KIND_UNVERIFIED)

_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclass(frozen=True)
class Signature:
    """What failed in a row, without what is particular to the file."""

    kind: str  # one of KIND_ORDER
    parts: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.kind}: " + "; ".join(self.parts)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "parts": list(self.parts), "key": self.key}


def signature(result: FileResult) -> Signature | None:
    """The row's signature; None for a passing row."""
    if result.status == STATUS_PASS:
        return None
    if result.status == STATUS_FAIL:
        return Signature(KIND_FAIL, _failure_parts(result))
    if result.status == STATUS_CRASHED:
        kind = KIND_DIED if result.summary.startswith(WORKER_DIED) else KIND_CRASHED
        return Signature(kind, (_reason(result),))
    if result.status == STATUS_BAD_INPUT:
        return Signature(KIND_BAD_INPUT, (_reason(result),))
    if result.status == STATUS_UNVERIFIED:
        return Signature(KIND_UNVERIFIED, (normalise(result.summary),))
    return Signature(result.status, (_reason(result),))


def _failure_parts(result: FileResult) -> tuple[str, ...]:
    """One part per failing counted (actual vs expected) pair, merged over steps, then the error findings."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for c in result.comparisons:
        if c.get("passed") or not c.get("counted", True):
            continue
        entry = merged.setdefault((c["actual"], c["expected"]), {"heads": set(), "of": 0, "how": set()})
        entry["heads"].update(c.get("failed_head_ids") or [])
        entry["of"] = max(entry["of"], int(c.get("query_heads") or 0))
        entry["how"].update(_how(c))
    parts = []
    for (actual, expected), entry in sorted(merged.items()):
        parts.append(f"{actual} vs {expected}: {_heads(entry['heads'], entry['of'])}, "
                     f"{' + '.join(sorted(entry['how']))}")
    if result.error_findings:
        parts.append("error finding" + ("s " if len(result.error_findings) > 1 else " ") +
                     ", ".join(sorted(result.error_findings)))
    return tuple(parts) or (normalise(result.summary),)


def _how(c: dict[str, Any]) -> set[str]:
    how = set()
    if c.get("actual_nonfinite"):
        how.add("NaN/Inf output")
    if c.get("unwritten"):
        how.add("unwritten tokens")
    if c.get("expected_nonfinite"):
        how.add("NaN/Inf expected")
    if not how:
        how.add("outside tolerance")
    return how


def _heads(heads: set[int], of: int) -> str:
    if not heads:
        return "heads unknown"
    if of and len(heads) >= of:
        return f"all {of} heads"
    text = str(IntRanges.of(sorted(heads), "heads"))
    return f"head{'s' if len(heads) > 1 else ''} {text}" + (f" of {of}" if of else "")


def _reason(result: FileResult) -> str:
    text = result.summary
    for path in (result.path, os.path.abspath(result.path)):
        text = text.replace(f"{path}: ", "").replace(f"`kvdbg replay {path}`", "`kvdbg replay FILE`")
        text = text.replace(path, "FILE")
    return normalise(text)


def normalise(text: str) -> str:
    """Numbers replaced by N, so that one cause in files of other sizes reads as one."""
    return _NUMBER.sub("N", " ".join(text.split()))


# --------------------------------------------------------------------------- groups


@dataclass
class Group:
    signature: Signature
    rows: list[Row] = field(default_factory=list)

    @property
    def example(self) -> Row:
        """The smallest file (the quickest to replay), the first of them on a tie."""
        return min(self.rows, key=lambda r: r.size if r.size > 0 else float("inf"))

    def error_range(self) -> tuple[float, float] | None:
        errors = [r.result.worst.max_abs for r in self.rows
                  if r.result.worst is not None and not r.result.worst.passed and r.result.worst.max_abs is not None]
        return (min(errors), max(errors)) if errors else None


@dataclass
class Triage:
    """Every row of a run grouped: the failing ones by signature, plus the counts."""

    groups: list[Group]
    total: int
    passed: int
    options: dict[str, Any]  # the run's options record (kvdbg.fleet.results.options_record): for example commands

    def command(self, group: Group) -> str:
        if group.signature.parts and group.signature.parts[0].startswith(NOT_ONE_STEP):
            # One rank's file replays on its own; what is wrong is the set: merge names it.
            key = group.example.result.rank.step_key()  # a refused step's files all have one (kvdbg.replayer.batch)
            step = [r.path for r in group.rows if r.result.rank is not None and r.result.rank.step_key() == key]
            return shlex.join(["kvdbg", "merge", *step, "-o", "merged.safetensors"])
        return example_command(group.example.path, self.options)

    def headline(self) -> str:
        """``300 snapshot(s): 298 pass; 2 fail, 1 cause; 1 bad input, 1 cause``."""
        parts = [f"{self.passed} pass"] if self.passed else []
        for kind in KIND_ORDER:
            groups = [g for g in self.groups if g.signature.kind == kind]
            if groups:
                files = sum(len(g.rows) for g in groups)
                parts.append(f"{files} {kind}, {len(groups)} cause{'s' if len(groups) > 1 else ''}")
        return f"{self.total} row(s): " + "; ".join(parts) if parts else f"{self.total} row(s)"

    def to_json(self) -> dict[str, Any]:
        out = []
        for number, g in enumerate(self.groups, 1):
            span = g.error_range()
            example = g.example
            out.append({"group": number, **g.signature.to_json(), "count": len(g.rows),
                        "paths": [r.path for r in g.rows],
                        "max_abs": None if span is None else {"min": span[0], "max": span[1]},
                        "example": {"path": example.path, "command": self.command(g)}})
        return {"headline": self.headline(), "total": self.total, "passed": self.passed, "groups": out}


NOT_ONE_STEP = "rank files that disagree or are not ranks of one step: "


def triage(rows: Iterable[Row], options: dict[str, Any]) -> Triage:
    rows = list(rows)
    # The rank files of one step that disagree, or are not ranks of it, are bad input whatever each
    # file's own verdict (as `kvdbg replay DIR` shows them: kvdbg.replayer.batch.step_rows).
    refused = {id(f): step.problem for step in step_rows([row.result for row in rows]) if step.problem is not None
               for f in step.files}
    by_key: dict[str, Group] = {}
    passed = 0
    for row in rows:
        problem = refused.get(id(row.result))
        sig = signature(row.result) if problem is None else \
            Signature(KIND_BAD_INPUT, (NOT_ONE_STEP + normalise(problem),))
        if sig is None:
            passed += 1
            continue
        by_key.setdefault(sig.key, Group(sig)).rows.append(row)

    def order(g: Group):
        rank = KIND_ORDER.index(g.signature.kind) if g.signature.kind in KIND_ORDER else len(KIND_ORDER)
        return rank, -len(g.rows), g.signature.key

    return Triage(sorted(by_key.values(), key=order), len(rows), passed, options)


def example_command(path: str, options: dict[str, Any]) -> str:
    """``kvdbg replay FILE`` with the run's options: the single-file replay that gives the row's verdict."""
    args = ["kvdbg", "replay", path]
    for name in options.get("backends") or []:
        args += ["--backend", name]
    if options.get("steps"):
        args += ["--step", options["steps"]]
    device = options.get("device") or "cpu"
    if device != "cpu":
        args += ["--device", device]
    if options.get("exact"):
        args.append("--exact")
    if options.get("compile") is not None:
        args.append("--compile" if options["compile"] else "--no-compile")
    for name in ("atol", "rtol"):
        if options.get(name) is not None:
            args += [f"--{name}", repr(options[name])]
    return shlex.join(args)


__all__ = ["Group", "KIND_ORDER", "Signature", "Triage", "example_command", "normalise", "signature", "triage"]
