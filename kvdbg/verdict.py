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

Warnings and notes never change the exit code: a condition vLLM produces by
design (the null block before a sliding window, a page reused after it left the
window, a prefill batch FLASHINFER_TS never runs) is a note, not a failure.
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
    comparisons: int  # comparisons that held at least one head
    failed_comparisons: int
    error_findings: int
    summary: str  # one line, for the end of the output

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_json_dict(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "comparisons": self.comparisons,
                "failed_comparisons": self.failed_comparisons, "error_findings": self.error_findings,
                "summary": self.summary}


def replay_verdict(comparisons: Iterable, findings: Iterable) -> Verdict:
    """The verdict of a replay from its comparisons (kvdbg.diff.Comparison) and findings."""
    compared = [c for c in comparisons if c.heads]
    failed = [c for c in compared if not c.passed]
    errors = [f for f in findings if f.severity == "error"]
    if failed or errors:
        parts = []
        if failed:
            names = sorted({f"{c.actual} vs {c.expected}" for c in failed})
            parts.append(f"{len(failed)} of {len(compared)} comparison(s) failed ({', '.join(names)})")
        if errors:
            codes = sorted({f.code for f in errors})
            parts.append(f"{len(errors)} error finding(s) ({', '.join(codes)})")
        return Verdict("fail", EXIT_FINDING, len(compared), len(failed), len(errors), "FAIL: " + "; ".join(parts))
    if not compared:
        return Verdict("unverified", EXIT_NOTHING_VERIFIED, 0, 0, 0,
                       "NOTHING VERIFIED: no backend output and no captured output could be compared "
                       "with the reference")
    return Verdict("pass", EXIT_OK, len(compared), 0, 0,
                   f"PASS: {len(compared)} comparison(s) agree within tolerance, no error finding")


__all__ = ["EXIT_BAD_INPUT", "EXIT_FINDING", "EXIT_INTERRUPTED", "EXIT_NOTHING_VERIFIED", "EXIT_OK", "Verdict",
           "replay_verdict"]
