"""The front door of `kvdbg replay SNAP`: one screen at 80 columns -- verdict, what is wrong, what to run next.

What `render_replay` prints in full (every backend's notes, every head, the pass
rule) is behind ``--full``; this summary names the comparisons (one row per
backend pair over all steps), the findings with their one-line meaning, and for
each failure and finding the command that digs into it, with the snapshot's
own steps, requests and heads filled in (:func:`next_commands`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.judge.compare import Comparison, HeadDiff
from kvdbg.judge.findings import SEVERITY_STYLES, lookup
from kvdbg.render.fit import Column, FitTable
from kvdbg.render.shell import continuation_indent, shell_lines
from kvdbg.render.replay import _fmt, dedupe_findings, nothing_to_compare, render_verdict
from kvdbg.replayer.runner import ReplayReport
from kvdbg.util.ranges import ranges_text as ranges

MAX_FAILING_REQUESTS = 3  # requests named per comparison row; the rest are counted (--full lists every head)
# Finding topics whose condition a table of another command shows: paging -> map, the FLASHINFER_TS rules -> window.
MAP_TOPICS = ("paging", "inputs")
WINDOW_TOPICS = ("flashinfer_ts", "prims_ts")


@dataclass(frozen=True)
class Hint:
    """One command to run next, and why (printed after it when the line has room)."""

    command: str
    why: str


def _pairs(comparisons: list[Comparison]) -> dict[tuple[str, str], list[Comparison]]:
    """The comparisons by (actual, expected), in the order they first appear; steps with no head left out."""
    pairs: dict[tuple[str, str], list[Comparison]] = {}
    for comp in comparisons:
        pairs.setdefault((comp.actual, comp.expected), [])
        if comp.heads:
            pairs[(comp.actual, comp.expected)].append(comp)
    return pairs


def _worst_key(head: HeadDiff) -> tuple:
    error = head.max_abs if head.max_abs == head.max_abs else -1.0
    return (head.not_compared, error)


def _failing_text(comps: list[Comparison]) -> Text:
    """``16/48: req 1 heads 0-7`` (failing/compared) over every step of one pair; why, when it is not the tolerance."""
    failed = [(c, h) for c in comps for h in c.failed]
    total = sum(len(c.heads) for c in comps)
    if not failed:
        return Text("-", style="dim")
    by_request: dict[int, set[int]] = {}
    for _, h in failed:
        by_request.setdefault(h.request, set()).add(h.head)
    named = sorted(by_request)[:MAX_FAILING_REQUESTS]
    text = Text(f"{len(failed)}/{total}: ", style="red")
    text.append("; ".join(f"req {r} head{'s' if len(by_request[r]) > 1 else ''} {ranges(by_request[r])}"
                          for r in named))
    if len(by_request) > len(named):
        text.append(f"; {len(by_request) - len(named)} more request(s)")
    causes = [word for word, count in (("unwritten", sum(h.unwritten for _, h in failed)),
                                       ("NaN/inf", sum(h.actual_nonfinite + h.expected_nonfinite for _, h in failed)))
              if count]
    if causes:
        text.append(f" ({', '.join(causes)})", style="red")
    return text


def render_comparisons(report: ReplayReport) -> FitTable | None:
    """One row per backend pair over all steps: the steps, PASS/FAIL, the worst error, which heads fail."""
    pairs = _pairs(report.comparisons)
    if not pairs:
        return None
    counted = report.result.counted
    what_if = False
    table = FitTable([Column("comparison", whole=True, justify="left", priority=10),
                      Column("step", whole=True, justify="left", priority=6),
                      Column("verdict", whole=True, justify="left", priority=10),
                      Column("max abs", whole=True, priority=9),
                      Column("failing heads", priority=8, min_width=16)])
    for (actual, expected), comps in pairs.items():
        if not comps:
            verdict = Text("none", style="yellow")  # --request/--head left no head, or no query token
        elif any(not c.passed for c in comps):
            verdict = Text("FAIL", style="bold red")
        else:
            verdict = Text("PASS", style="bold green")
        if comps and actual not in counted:
            verdict.append("*", style="dim")
            what_if = True
        errors = [c.max_abs for c in comps if c.max_abs == c.max_abs]
        error = _fmt(max(errors)) if errors else ("nan" if comps else "-")
        failing = [c for c in comps if not c.passed]
        if failing:  # a FAIL states its failing heads' error, never a passing head's
            errors = [c.shown_max_abs for c in failing if c.shown_max_abs == c.shown_max_abs]
            error = _fmt(max(errors)) if errors else "nan"
        table.add_row(f"{actual} vs {expected}", ranges(c.step for c in comps) or "-", verdict, error,
                      _failing_text(comps))
    if what_if:
        table.caption = "*: a what-if column, not counted (name it with --backend to judge it)"
    return table


def render_findings_brief(report: ReplayReport) -> Table | None:
    """Each distinct finding once: severity, code, its one-line meaning, and who/where."""
    merged = dedupe_findings(report.findings)
    if not merged:
        return None
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    for finding, steps, _ in merged:
        style = SEVERITY_STYLES.get(finding.severity, "")
        where = [finding.backend] if finding.backend else []
        if steps:
            where.append(f"step {ranges(steps)}")
        if finding.requests:
            where.append(f"req {ranges(finding.requests)}")
        line = Text(finding.code, style="bold")
        line.append(f": {lookup(finding.code).title}")
        if where:
            line.append(f" ({'; '.join(where)})", style="dim")
        grid.add_row(Text(finding.severity, style=style), line)
    return grid


def next_commands(report: ReplayReport, snapshot: str) -> list[Hint]:
    """The commands that dig into what this replay found, most telling first; every one runs as written.

    A failing comparison: `attention` on its worst head. A finding: the table that shows its condition
    (`map` for paging and inputs, `window` for the FLASHINFER_TS rules) and `explain CODE`. A failure:
    `shrink` to a small repro. The engine's own output failing, on a layer with features: `replay --what-if`.
    Always: `replay --full`, everything this summary leaves out.
    """
    path = shlex.quote(snapshot)
    hints: list[Hint] = []
    counted = report.result.counted
    worst: dict[str, tuple[Comparison, HeadDiff]] = {}
    failing = [c for c in report.comparisons if c.heads and not c.passed]
    for comp in sorted(failing, key=lambda c: c.actual not in counted):
        head = max(comp.failed, key=_worst_key)
        held = worst.get(comp.actual)
        if held is None or _worst_key(head) > _worst_key(held[1]):
            worst[comp.actual] = (comp, head)
    for actual, (comp, head) in worst.items():
        hints.append(Hint(f"kvdbg attention {path} --step {comp.step} --request {head.request} --head {head.head}",
                          f"where {actual}'s worst head put its attention"))
    for finding, steps, _ in dedupe_findings(report.findings):
        code = lookup(finding.code)
        step = min(steps) if steps else None
        at_step = f" --step {step}" if step is not None else ""
        request = finding.request if finding.request is not None else (
            finding.requests[0] if len(finding.requests) == 1 else None)
        for_request = f" --request {request}" if request is not None else ""
        if finding.severity != "info" and code.topic in MAP_TOPICS:
            hints.append(Hint(f"kvdbg map {path}{at_step}{for_request}", f"the block table behind {code.name}"))
        elif finding.severity != "info" and code.topic in WINDOW_TOPICS and request is not None:
            hints.append(Hint(f"kvdbg window {path}{at_step}{for_request}",
                              f"the keys FLASHINFER_TS's kernel sees for request {request}"))
        hints.append(Hint(f"kvdbg explain {code.name}", "what it means, what to do"))
    # shrink keeps one backend's failure: there must be a counted backend column (not the engine's output) failing.
    if any(c.actual in counted and c.actual != "captured" for c in failing):
        hints.append(Hint(f"kvdbg shrink {path} -o small.safetensors", "the smallest snapshot that still fails"))
    if any(c.actual == "captured" for c in failing):
        from kvdbg.moves.whatif import WHAT_IFS

        if any(w.applies(report.result.meta.layer) for w in WHAT_IFS):
            hints.append(Hint(f"kvdbg replay {path} --what-if",
                              "whether the engine's output is attention with a feature of the layer left out"))
    hints.append(Hint(f"kvdbg replay {path} --full", "every table: backends, notes, each head, the pass rule"))
    seen: set[str] = set()
    return [h for h in hints if not (h.command in seen or seen.add(h.command))]


class HintLines:
    """``next:`` and one command a line, its reason after it when the line has room; a command too long for
    the line goes on after `` \\`` between words, and a word (a path) longer than the line is shown whole:
    print with ``crop=False``, so that every command is copied whole."""

    def __init__(self, hints: list[Hint]):
        self.hints = hints

    def __rich_console__(self, console, options):
        yield Text("next:", style="bold")
        for hint in self.hints:
            lines = shell_lines(hint.command, options.max_width - 2)
            comment = f"  # {hint.why}"
            for number, line in enumerate(lines):
                indent = 2 if number == 0 else continuation_indent(2, line, options.max_width)
                text = Text(" " * indent + line, style="cyan", no_wrap=True, overflow="ignore")
                if len(lines) == 1 and len(text) + len(comment) <= options.max_width:
                    text.append(comment, style="dim")
                yield text


def _backends_line(report: ReplayReport) -> Text:
    """``backends: reference, flex, flashinfer_ts (emulated) ran on cpu; unavailable: vllm``."""
    result = report.result
    errors = {name for step in result.steps for name, run in step.runs.items() if run.error}
    ran, raised, unavailable, skipped = [], [], [], []
    for st in result.backends:
        if not st.available:
            unavailable.append(st.name)
            continue
        runs = [step.runs[st.name] for step in result.steps if st.name in step.runs]
        if st.name in errors:
            raised.append(st.name)
        elif runs and all(run.not_applicable is not None for run in runs):
            skipped.append(st.name)
        else:
            ran.append(st.name + (" (emulated)" if st.info is not None and st.info.emulated else ""))
    devices = sorted({st.info.device for st in result.backends if st.available and st.info is not None})
    text = Text("backends: ", style="bold")
    text.append(", ".join(ran) or "none")
    if ran and devices:
        text.append(f" ran on {', '.join(devices)}")
    if raised:
        text.append("; raised: " + ", ".join(raised), style="bold red")
    if skipped:
        text.append("; not applicable: " + ", ".join(skipped), style="yellow")
    if unavailable:
        text.append("; unavailable: " + ", ".join(unavailable), style="yellow")
    return text


def render_front(report: ReplayReport, snapshot: str, *, explain: bool = False, saved: str | None = None,
                 before_verdict: list | None = None) -> Group:
    """`kvdbg replay SNAP` without --full: one screen, ending on the verdict line (``report.verdict``).

    ``explain`` adds each backend's builder decisions per request (`replay --builder`) above the commands.
    """
    from kvdbg.render.replay import render_title

    parts: list[Any] = [render_title(report.result), _backends_line(report)]
    table = render_comparisons(report)
    if table is not None:
        parts.append(table)
    else:
        parts.append(nothing_to_compare(report.result))
    findings = render_findings_brief(report)
    if findings is not None:  # each line opens on its severity: no heading needed
        parts.append(findings)
    if explain:
        from kvdbg.render.replay import render_explain

        parts.extend(render_explain(report.result, report.requests))
    parts.append(HintLines(next_commands(report, snapshot)))
    if saved:
        parts.append(Text(f"outputs written to {saved}", style="dim"))
    parts.extend(before_verdict or [])
    parts.append(render_verdict(report.verdict))
    return Group(*parts)


__all__ = ["Hint", "HintLines", "next_commands", "ranges", "shell_lines", "render_comparisons",
           "render_findings_brief", "render_front"]
