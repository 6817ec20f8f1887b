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

Every command's verdict is built here: :func:`judge` (alias
:func:`replay_verdict`) for a replay -- read through ``ReplayReport.verdict`` by
`replay`, its --json, `report` and fleet rows, and fed by `attention`, `poison`
and `sweep` with their own findings -- and :func:`inputs_verdict` (through
:func:`map_verdict`) for `map`, `info --check` and `window SNAP`.
:func:`simple_verdict` is left for commands that judge no snapshot (`diff`
compares two, `shrink` writes one).

**The one rule** (:func:`judge`; every command's verdict goes through it, and
:func:`fails` is the same rule for one piece of evidence):

- a *comparison* fails when a head is outside tolerance, non-finite, or left
  unwritten (kvdbg.judge.compare);
- a *finding* fails when its registered severity is ``error``
  (kvdbg.judge.findings); warnings and notes never change the exit code;
- only what counts (below) sets the exit code; the rest is named as what-if.

Whatever a command observes beyond a replay (`attention`'s weights, `poison`'s
reads, `map`'s and `window`'s checks of the inputs) it states as findings with
registered codes, and :func:`judge` weighs them with the replay's own
comparisons and findings. So one snapshot gets one verdict word and one exit
code from every command that judges it.

**A backend's documented behaviour is not a failure.** FLASHINFER_TS's
builder restricts a dense (non-causal) windowed batch to whole pages, so each
query token sees up to ``page_size - 1`` keys before its exact window, and the
block shares one window start (``query_len - 1`` tokens of drift). vLLM's
backend documents both consequences of the restriction (its module docstring,
and ``_max_kv_len``'s "at most one partial page in front of the window"): it
is what FLASHINFER_TS is, not a deviation from it. kvdbg reports it as the
warning ``window_restriction_extra_keys`` with its size (the keys, and in
`attention` their share of the weight), and judges its effect where it
matters: the backend's output against the exact reference, within tolerance.
When those keys move the output beyond tolerance, the comparison fails, and
every command says FAIL. Reading keys *beyond* the documented ones (or
skipping keys of the exact mask) is an error finding.

A condition vLLM produces by design (the null block before a sliding window, a
page reused after it left the window, a prefill batch FLASHINFER_TS never
runs) is a note, not a failure.

Commands that read the inputs only (`map`, `info --check`, `window SNAP`)
judge the input findings by the same rule (:func:`inputs_verdict`) and say
that the outputs were not compared.

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


# The one set of verdict words: every verdict line starts with the word of its exit code (and nothing else: no
# OK, SAME/DIFFER or DONE), so a script or a reader tells every command's result the same way.
VERDICT_WORDS = {EXIT_OK: "PASS", EXIT_FINDING: "FAIL", EXIT_BAD_INPUT: "BAD INPUT",
                 EXIT_NOTHING_VERIFIED: "NOTHING VERIFIED"}
STATUS_OF_WORD = {"PASS": "pass", "FAIL": "fail", "BAD INPUT": "fail", "NOTHING VERIFIED": "unverified"}


@dataclass(frozen=True)
class Verdict:
    """The overall result of a replay: ``status`` is "pass", "fail" or "unverified".

    Its summary starts with the word of its exit code (:data:`VERDICT_WORDS`): a verdict built otherwise is a
    programming error, refused here, in the one place every command's verdict is made.
    """

    status: str
    exit_code: int
    comparisons: int  # comparisons that held at least one head and count toward the verdict
    failed_comparisons: int
    error_findings: int
    summary: str  # one line, for the end of the output
    what_if_failures: tuple[str, ...] = ()  # what-if columns that fail or have error findings (not counted)

    def __post_init__(self) -> None:
        word = VERDICT_WORDS.get(self.exit_code)
        if word is not None and not (self.summary.startswith(word + ":") and STATUS_OF_WORD[word] == self.status):
            raise ValueError(f"a verdict with exit code {self.exit_code} is {word!r} (status "
                             f"{STATUS_OF_WORD[word]!r}): got {self.status!r}, {self.summary[:60]!r}")

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


# Which kvdbg column's rules a snapshot's own engine backend is judged by, for the commands that read the
# inputs only (no backend is set up there, so kvdbg.backends' specs, which need torch, are not read). `map`'s
# paging findings apply vLLM's FLEX_ATTENTION rule (page 0 is the null block, a page mapped twice keeps one).
INPUT_RULES = {"FLASHINFER_TS": frozenset({"flashinfer_ts"}), "FLEX_ATTENTION": frozenset({"flex"})}
# `map`'s findings that are FLEX_ATTENTION's rule (a replay reports them as flex's); its others (NaN in a live
# page, ...) concern the inputs whatever the backend, as a replay's own ("replay") findings do.
FLEX_PAGING_CODES = frozenset({"live_page_zero", "page_mapped_twice"})


def input_counted(engine_backend: str | None) -> frozenset[str]:
    """The finding sources that count for a snapshot whose engine backend is ``engine_backend`` (inputs only)."""
    return INPUT_RULES.get(engine_backend or "", frozenset()) | ALWAYS_COUNTED


def _source(finding) -> str:
    """Whose rule a finding applies, for counting: `map`'s paging findings are FLEX_ATTENTION's or the inputs'."""
    if finding.backend == "map":
        return "flex" if finding.code in FLEX_PAGING_CODES else "replay"
    return finding.backend


def fails(item) -> bool:
    """The one rule for one piece of evidence: a comparison (with heads) that did not pass, or an error finding."""
    if hasattr(item, "severity"):
        return item.severity == "error"
    return bool(item.heads) and not item.passed


def judge(comparisons: Iterable = (), findings: Iterable = (), counted: Iterable[str] | None = None) -> Verdict:
    """THE verdict rule (see the module doc): comparisons (kvdbg.judge.compare.Comparison) and findings
    (kvdbg.judge.findings.Finding, from any command) in, one verdict out.

    ``counted`` (default: everything) are the sources that set the exit code; the failures of the
    others are what-if results, named in the summary.
    """
    comparisons, findings = list(comparisons), list(findings)
    counts = (lambda source: True) if counted is None else frozenset(counted).__contains__
    compared = [c for c in comparisons if c.heads and counts(c.actual)]
    failed = [c for c in compared if fails(c)]
    errors = [f for f in findings if fails(f) and counts(f.backend)]
    what_if = tuple(sorted({c.actual for c in comparisons if fails(c) and not counts(c.actual)}
                           | {f.backend for f in findings if fails(f) and not counts(f.backend)}))
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


replay_verdict = judge  # the name replay's callers know


def inputs_verdict(findings: Iterable, counted: Iterable[str] | None = None, *, checked: str = "the inputs") -> Verdict:
    """:func:`judge` for a command that reads the inputs only (`map`, `info --check`, `window SNAP`): the same
    rule over the findings; with no error finding it passes, saying the outputs were not compared."""
    findings = list(findings)
    counts = (lambda source: True) if counted is None else frozenset(counted).__contains__
    errors = [f for f in findings if fails(f) and counts(_source(f))]
    what_if = tuple(sorted({_source(f) for f in findings if fails(f) and not counts(_source(f))}))
    labels = {"flex": "FLEX_ATTENTION's rules", "flashinfer_ts": "FLASHINFER_TS's rules"}
    aside = (f"; what-if error finding(s) under {', '.join(sorted({labels.get(b, b) for b in what_if}))}, not "
             "counted (not this snapshot's backend)" if what_if else "")
    if errors:
        codes = ", ".join(sorted({f.code for f in errors}))
        return Verdict("fail", EXIT_FINDING, 0, 0, len(errors),
                       f"FAIL: {len(errors)} error finding(s) ({codes}) in {checked}{aside}", what_if)
    others = sum(1 for f in findings if not fails(f))
    tail = f"; {others} warning(s) or note(s)" if others else ""
    return Verdict("pass", EXIT_OK, 0, 0, 0,
                   f"PASS: no error finding in {checked}{tail}{aside} (outputs not compared: kvdbg replay "
                   "compares them)", what_if)


def simple_verdict(status: str, exit_code: int, summary: str, *, comparisons: int = 0, failed_comparisons: int = 0,
                   error_findings: int = 0) -> Verdict:
    """A command's closing verdict when it is not one replay: status pass/fail/unverified, one line, and the
    counts the command really has (0 where it makes no comparison or finding of that kind)."""
    return Verdict(status, exit_code, comparisons, failed_comparisons, error_findings, summary)


def map_verdict(maps: Iterable, findings: Iterable = (), counted: Iterable[str] | None = None) -> Verdict:
    """`kvdbg map` / `info --check`: :func:`inputs_verdict` over the paging findings of ``maps``
    (kvdbg.snapshot.pagemap.PageMap records, one per step) and any other input ``findings``."""
    maps = list(maps)
    where = ", ".join(f"step {m.step}" for m in maps) or "no step"
    return inputs_verdict([a for m in maps for a in m.anomalies] + list(findings), counted,
                          checked=f"the inputs of {where}")


__all__ = ["ALWAYS_COUNTED", "EXIT_BAD_INPUT", "EXIT_FINDING", "EXIT_INTERRUPTED", "EXIT_NOTHING_VERIFIED", "EXIT_OK",
           "INPUT_RULES", "STATUS_OF_WORD", "VERDICT_WORDS", "Verdict", "counted_backends", "fails", "input_counted", "inputs_verdict", "judge",
           "map_verdict", "replay_verdict", "simple_verdict"]
