"""Exit codes and the verdict of a replay, defined once (no torch): every command and renderer reads them here.

====  =====================  ==========================================================
code  name                   when
====  =====================  ==========================================================
0     EXIT_OK                everything compared agreed within tolerance, and no finding
                             is an error
1     EXIT_FINDING           a comparison failed (outside tolerance, a side non-finite,
                             or a token the backend could not write), or an *error*
                             finding: a condition that makes the engine's output wrong
                             or that the user must act on
2     EXIT_BAD_INPUT         bad input or options, or a backend asked for by name that
                             cannot run here (one line on stderr)
3     EXIT_NOTHING_VERIFIED  the run compared nothing: no backend output and no captured
                             output to hold against the reference (e.g. only the
                             reference could run and the snapshot has no engine output)
130   EXIT_INTERRUPTED       Ctrl-C
====  =====================  ==========================================================

Every command's verdict is built here: :func:`replay_verdict` for a replay
(read through ``ReplayReport.verdict`` by `replay`, its --json and `report`),
:func:`map_verdict` for `map` and `info --check`, :func:`simple_verdict`
for the others.

Warnings and notes never change the exit code: a condition vLLM produces by
design (the null block before a sliding window, a page reused after it left the
window, a prefill batch FLASHINFER_TS never runs) is a note, not a failure.

**What counts.** A replay judges the engine the snapshot came from: the
engine's captured output against the reference, the backends that implement
the snapshot's own backend (``meta.backend.name``: vllm, which runs vLLM's own
code for whichever backend the snapshot names; flex and vllm_flex for
FLEX_ATTENTION; flashinfer_ts for FLASHINFER_TS), every backend the user named
with ``--backend``, and the findings about the inputs themselves. The other
default columns are *what-if* columns -- how another backend would handle this
batch (FLASHINFER_TS on a CPU_ATTN capture, say). They are shown in full, with
their findings; their failures are named in the verdict line but do not set
the exit code, since they say nothing about the engine's output. Name a backend
with ``--backend`` to have it judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_BAD_INPUT = 2
EXIT_NOTHING_VERIFIED = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Verdict:
    """The overall result of a replay: ``status`` is "pass", "fail" or "unverified"."""

    status: str
    exit_code: int
    comparisons: int  # comparisons that held at least one head and count toward the verdict
    failed_comparisons: int
    error_findings: int
    summary: str  # one line, for the end of the output
    what_if_failures: tuple[str, ...] = ()  # what-if columns that fail or have error findings (not counted)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_json(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "comparisons": self.comparisons,
                "failed_comparisons": self.failed_comparisons, "error_findings": self.error_findings,
                "what_if_failures": list(self.what_if_failures), "summary": self.summary}


# Sources that always count: the engine's own output, the reference, and findings about the inputs.
ALWAYS_COUNTED = frozenset({"captured", "reference", "replay"})


def counted_backends(engine_backend: str, backends: Iterable, named: Iterable[str] = ()) -> frozenset[str]:
    """The backend columns whose results set the exit code (see the module doc).

    ``backends`` are (name, engine_name) pairs of the columns that were set up; ``named`` the ones the
    user asked for with --backend.
    """
    own = {name for name, engine_name in backends if engine_name and engine_name == engine_backend}
    return frozenset(own) | frozenset(named) | ALWAYS_COUNTED


def replay_verdict(comparisons: Iterable, findings: Iterable, counted: Iterable[str] | None = None) -> Verdict:
    """The verdict of a replay from its comparisons (kvdbg.judge.compare.Comparison) and findings.

    ``counted`` (default: everything) are the sources that set the exit code; the failures of the
    others are what-if results, named in the summary.
    """
    comparisons, findings = list(comparisons), list(findings)
    counts = (lambda source: True) if counted is None else frozenset(counted).__contains__
    compared = [c for c in comparisons if c.heads and counts(c.actual)]
    failed = [c for c in compared if not c.passed]
    errors = [f for f in findings if f.severity == "error" and counts(f.backend)]
    what_if = tuple(sorted({c.actual for c in comparisons if c.heads and not counts(c.actual) and not c.passed}
                           | {f.backend for f in findings if f.severity == "error" and not counts(f.backend)}))
    others = sorted({c.actual for c in comparisons if c.heads and not counts(c.actual)} - set(what_if))
    aside = (f"; what-if column(s) {', '.join(what_if)} fail, not counted (not this snapshot's backend; "
             "name it with --backend to judge it)") if what_if else ""
    if others:
        aside += f"; what-if column(s) {', '.join(others)} pass too"
    if failed or errors:
        parts = []
        if failed:
            names = sorted({f"{c.actual} vs {c.expected}" for c in failed})
            parts.append(f"{len(failed)} of {len(compared)} comparison(s) failed ({', '.join(names)})")
        if errors:
            codes = sorted({f.code for f in errors})
            parts.append(f"{len(errors)} error finding(s) ({', '.join(codes)})")
        return Verdict("fail", EXIT_FINDING, len(compared), len(failed), len(errors),
                       "FAIL: " + "; ".join(parts) + aside, what_if)
    if not compared:
        what = ("no backend output and no captured output could be compared with the reference"
                if not any(c.heads for c in comparisons) else
                "no captured output, and no column of this snapshot's own backend or named with --backend")
        return Verdict("unverified", EXIT_NOTHING_VERIFIED, 0, 0, 0, f"NOTHING VERIFIED: {what}{aside}", what_if)
    return Verdict("pass", EXIT_OK, len(compared), 0, 0,
                   f"PASS: {len(compared)} comparison(s) agree within tolerance, no error finding{aside}", what_if)


def simple_verdict(status: str, exit_code: int, summary: str, *, comparisons: int = 0, failed_comparisons: int = 0,
                   error_findings: int = 0) -> Verdict:
    """A command's closing verdict when it is not one replay: status pass/fail/unverified, one line, and the
    counts the command really has (0 where it makes no comparison or finding of that kind)."""
    return Verdict(status, exit_code, comparisons, failed_comparisons, error_findings, summary)


def map_verdict(maps: Iterable) -> Verdict:
    """`kvdbg map` / `info --check`: FAIL (exit 1) when a paging finding is an error; notes and warnings never fail.

    ``maps`` are kvdbg.snapshot.pagemap.PageMap records, one per step.
    """
    maps = list(maps)
    errors = [a for m in maps for a in m.anomalies if a.severity == "error"]
    others = sum(len(m.anomalies) for m in maps) - len(errors)
    where = ", ".join(f"step {m.step}" for m in maps) or "no step"
    if errors:
        codes = ", ".join(sorted({a.code for a in errors}))
        return simple_verdict("fail", EXIT_FINDING,
                              f"FAIL: {len(errors)} harmful paging anomal{'y' if len(errors) == 1 else 'ies'} "
                              f"({codes}) in {where}", error_findings=len(errors))
    tail = f"; {others} note(s) or warning(s)" if others else ""
    return simple_verdict("pass", EXIT_OK, f"PASS: no harmful paging anomaly in {where}{tail}")


__all__ = ["ALWAYS_COUNTED", "EXIT_BAD_INPUT", "EXIT_FINDING", "EXIT_INTERRUPTED", "EXIT_NOTHING_VERIFIED", "EXIT_OK",
           "Verdict", "counted_backends", "map_verdict", "replay_verdict", "simple_verdict"]
