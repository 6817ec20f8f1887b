"""Tables and JSON for `kvdbg replay`: what ran, findings, per-head diffs, the tolerance rule."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.text import Text

from kvdbg.judge.compare import Comparison, HeadDiff
from kvdbg.judge.findings import SEVERITY_STYLES, explain_hint, severity_rank
from kvdbg.render.fit import Column, FitTable
from kvdbg.render.util import verdict_line
from kvdbg.replayer.runner import ReplayReport, ReplayResult
from kvdbg.judge.verdict import Verdict

MAX_FAILING_ROWS = 32
MAX_PASSING_ROWS = 8


def _fmt(value: float, spec: str = ".2e") -> str:
    """Three significant digits in a fixed width (``7.81e-03``), so a column of them lines up and reads whole."""
    if value != value:
        return "nan"
    if value == 0:
        return "0"
    return format(value, spec)


def _mode(info) -> str:
    if info is None:
        return "-"
    return "compiled" if info.compiled else "eager"


def render_backends(result: ReplayResult) -> FitTable:
    """What ran, one row per backend that could run; the ones that could not are in render_unavailable."""
    table = FitTable([Column("backend", priority=10, style="bold"), Column("engine name", priority=2),
                      Column("status", priority=9), Column("kernel", priority=8), Column("device", priority=5),
                      Column("mode", priority=4), Column("dtype", priority=6), Column("emulated", priority=7),
                      Column("time", whole=True, priority=3)], title="backends")
    times: dict[str, float] = {}
    for step in result.steps:
        for name, run in step.runs.items():
            times[name] = times.get(name, 0.0) + run.build_s + run.forward_s
    errors = {name for step in result.steps for name, run in step.runs.items() if run.error}
    for st in result.backends:
        if not st.available:
            table.add_row(st.name, st.engine_name or "-", Text("unavailable", style="yellow"),
                          Text("see below", style="yellow"), "", "", "", "", "")
            continue
        info = st.info
        runs = [step.runs[st.name] for step in result.steps if st.name in step.runs]
        skipped = sum(run.not_applicable is not None for run in runs)
        if st.name in errors:
            status = Text("raised", style="bold red")
        elif runs and skipped == len(runs):
            status = Text("not applicable", style="yellow")
        elif skipped:
            status = Text(f"ran; {skipped} step(s) n/a", style="yellow")
        else:
            status = Text("ran", style="green")
        table.add_row(st.name, st.engine_name or "-", status, info.kernel, info.device, _mode(info), info.dtype,
                      "yes" if info.emulated else "no", f"{times.get(st.name, 0.0) * 1e3:.1f} ms")
    return table


def render_unavailable(result: ReplayResult) -> FitTable | None:
    """Why a backend could not run, in its own section: a reason is a paragraph, not a table cell."""
    rows = [(st.name, st.reason or "no reason given") for st in result.backends if not st.available]
    if not rows:
        return None
    table = FitTable([Column("backend", priority=10, style="bold"), Column("why it did not run", priority=9)],
                     title="unavailable backends", show_header=False)
    for name, reason in rows:
        table.add_row(name, Text(reason, style="yellow"))
    return table


def not_applicable_notes(result: ReplayResult) -> list[tuple[str, str]]:
    """(backend, "step N not applicable: why") for every step a backend's builder would not run."""
    return [(name, f"step {step.step} not applicable, not compared: {run.not_applicable}")
            for step in result.steps for name, run in step.runs.items() if run.not_applicable is not None]


def render_notes(result: ReplayResult) -> FitTable | None:
    rows = [(st.name, note) for st in result.backends if st.info for note in st.info.notes]
    rows += not_applicable_notes(result)
    if not rows:
        return None
    table = FitTable([Column("backend", priority=10, style="bold"), Column("note", priority=9)],
                     title="what each backend did", show_header=False)
    for name, note in rows:
        table.add_row(name, note)
    return table


def dedupe_findings(findings) -> list[tuple[Any, list[int], bool]]:
    """Each distinct finding once, with the steps it appears in (a condition repeats every step it lasts).

    Findings are the same when severity, backend, code and request are; the third item says
    whether the steps' messages differ (in their numbers: the key range moves as the request grows).
    """
    merged: dict[tuple, list] = {}
    for f in findings:
        key = (f.severity, f.backend, f.code, f.request)
        entry = merged.setdefault(key, [f, [], False])
        if f.step is not None and f.step not in entry[1]:
            entry[1].append(f.step)
        entry[2] = entry[2] or f.message != entry[0].message
    return sorted((tuple(e) for e in merged.values()), key=lambda e: (
        severity_rank(e[0].severity), min(e[1], default=0), e[0].request if e[0].request is not None else -1))


def _steps_label(steps: list[int]) -> str:
    return ", ".join(map(str, sorted(steps))) or "-"


def render_findings(findings) -> FitTable | None:
    merged = dedupe_findings(findings)
    if not merged:
        return None
    backends = sorted({f.backend for f, _, _ in merged})
    title = f"findings ({len(merged)}" + (f", all {backends[0]})" if len(backends) == 1 else ")")
    table = FitTable([Column("severity", priority=10), Column("backend", whole=True, justify="left", priority=8),
                      Column("step", priority=5, min_width=4), Column("req", whole=True, priority=7),
                      Column("code", whole=True, justify="left", priority=6),
                      Column("message", priority=9)], title=title,
                     caption=explain_hint(f.code for f, _, _ in merged))
    if len(backends) == 1:
        table.columns[1].priority = 0  # the title names it; the column drops first
    for f, steps, differ in merged:
        style = SEVERITY_STYLES.get(f.severity, "")
        message = f.message
        if differ:
            message += f" (as of step {f.step}; the other steps' numbers differ: --json lists each)"
        table.add_row(Text(f.severity, style=style), f.backend, _steps_label(steps),
                      "-" if f.request is None else str(f.request), f.code, Text(message, style=style))
    return table


def _head_rows(heads: list[HeadDiff], full: bool) -> tuple[list[HeadDiff], int]:
    failing = sorted((h for h in heads if not h.passed), key=lambda h: (-h.not_compared, -_num(h.max_abs)))
    passing = sorted((h for h in heads if h.passed), key=lambda h: -_num(h.max_abs))
    if full:
        return failing + passing, 0
    shown = failing[:MAX_FAILING_ROWS] + passing[:MAX_PASSING_ROWS]
    return shown, len(heads) - len(shown)


def _num(value: float) -> float:
    return -1.0 if value != value else value


def error_text(comp: Comparison) -> str:
    """The error a comparison's title states: a FAIL's from its failing heads (never a passing head's), and when
    those hold no finite number, that said in words."""
    error = comp.shown_max_abs
    if comp.failed and error != error:
        return "failing heads: no finite error"
    return f"max abs {_fmt(error)}"


def _not_compared(h: HeadDiff) -> str:
    """Why elements of a head were not compared, by cause (a side may have several)."""
    parts = []
    if h.actual_nonfinite:
        parts.append(f"{h.actual_nonfinite} produced NaN/inf")
    if h.unwritten:
        parts.append(f"{h.unwritten} unwritten")
    if h.expected_nonfinite:
        parts.append(f"{h.expected_nonfinite} expected NaN/inf")
    return ", ".join(parts) or "0"


def render_comparison(comp: Comparison, *, full: bool = False, starts: dict[int, list[int]] | None = None) -> FitTable:
    """One backend against one expectation, per request × head.

    ``starts`` maps a step to its query_start_loc, so the worst token is given as the
    request's own token index (0 .. q-1) rather than the batch-wide row.
    """
    if not comp.heads:  # no query token in the step, or --request/--head left none
        verdict = Text("nothing compared (no query token or head selected)", style="yellow")
    elif comp.passed:
        verdict = Text("PASS", style="bold green")
    else:
        verdict = Text(f"FAIL: {len(comp.failed)} of {len(comp.heads)} heads", style="bold red")
    counts = comp.counts()
    causes = [f"{counts['actual_nonfinite']} {comp.actual} NaN/inf" if counts["actual_nonfinite"] else "",
              f"{counts['unwritten']} unwritten" if counts["unwritten"] else "",
              f"{counts['expected_nonfinite']} {comp.expected} NaN/inf" if counts["expected_nonfinite"] else ""]
    title = Text.assemble(f"step {comp.step}: {comp.actual} vs {comp.expected} — ", verdict,
                          f"  ({error_text(comp)}" + "".join(f", {c}" for c in causes if c) + ")"
                          if comp.heads else "")
    table = FitTable([Column("req", whole=True, priority=10), Column("head", whole=True, priority=10),
                      Column("status", priority=10, min_width=4), Column("max abs", whole=True, priority=9),
                      Column("mean abs", whole=True, priority=4), Column("max rel", whole=True, priority=5),
                      Column("cosine", whole=True, priority=3),
                      Column("worst token (pos)", whole=True, priority=2),
                      Column("failing elements", whole=True, priority=7),
                      Column("not compared", priority=8, min_width=8)], title=title)
    first = (starts or {}).get(comp.step)
    rows, hidden = _head_rows(comp.heads, full)
    if not any(h.not_compared for h in rows):
        table.columns[-1].priority = 1  # a column of zeros drops first (the title counts what was skipped)
    for h in rows:
        status = Text("ok", style="green") if h.passed else Text("FAIL", style="bold red")
        own = h.worst_token - first[h.request] if first is not None and h.request < len(first) else h.worst_token
        table.add_row(str(h.request), str(h.head), status, _fmt(h.max_abs), _fmt(h.mean_abs), _fmt(h.max_rel),
                      _fmt(h.cosine, ".6f"), f"{own} ({h.worst_position})", str(h.failing),
                      Text(_not_compared(h), style="red" if h.not_compared else ""))
    if hidden:
        table.caption = f"… {hidden} more passing heads (--full)"
    return table


def _flatten(row: dict[str, Any]) -> dict[str, str]:
    """One builder-decision record as key → text: nested records become dotted keys, lists comma lists.

    A nested value that repeats a top-level one (the restriction's own seq_len) is shown once.
    """
    out: dict[str, str] = {}

    def text(value: Any) -> str:
        if isinstance(value, (list, tuple)):
            return ", ".join(text(v) for v in value) or "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:.6g}"
        return "-" if value is None or value == "" else str(value)

    for key, value in row.items():
        if isinstance(value, dict):
            for sub, inner in value.items():
                if sub in row and text(row[sub]) == text(inner):
                    continue
                if isinstance(inner, dict):
                    inner = ", ".join(f"{k} {text(v)}" for k, v in inner.items())
                out[f"{key}.{sub}"] = text(inner)
        else:
            out[key] = text(value)
    return out


def render_explain(result: ReplayResult, requests: list[int] | None = None) -> list[FitTable]:
    """Builder decisions per step and request: one key/value table, one value column per backend."""
    tables = []
    for step in result.steps:
        per_request: dict[int, dict[str, dict[str, str]]] = {}
        for name, run in step.runs.items():
            for index, row in enumerate(run.explain):
                request = row.get("request", index)
                if requests is not None and request not in requests:
                    continue
                flat = _flatten({k: v for k, v in row.items() if k != "request"})
                per_request.setdefault(request, {})[name] = flat
        for request, by_backend in sorted(per_request.items(), key=lambda kv: kv[0]):
            names = list(by_backend)
            keys = list(dict.fromkeys(k for flat in by_backend.values() for k in flat))
            table = FitTable([Column("decision", priority=10, style="bold", min_width=30)]
                             + [Column(name, priority=9 - i) for i, name in enumerate(names)],
                             title=f"step {step.step}, request {request}: builder decisions")
            for key in keys:
                table.add_row(key, *(by_backend[name].get(key, "") for name in names))
            tables.append(table)
    return tables


def render_footer(comparisons: list[Comparison]) -> Text:
    text = Text("pass rule: an element passes when |a - e| <= atol + rtol·|e| (e: expected); "
                "NaN or inf on either side, or a token not written, always fails\n", style="dim")
    # One line per tolerance, naming the comparisons it was used for (usually one line in all).
    by_tolerance: dict[Any, list[str]] = {}
    for c in comparisons:
        pairs = by_tolerance.setdefault(c.tolerance, [])
        if f"{c.actual} vs {c.expected}" not in pairs:
            pairs.append(f"{c.actual} vs {c.expected}")
    for tol, pairs in by_tolerance.items():
        text.append(f"  atol {tol.atol:g}, rtol {tol.rtol:g} ({tol.source}): {', '.join(pairs)}\n", style="dim")
    if any(c.heads for c in comparisons):
        text.append("failing elements: elements (query tokens × head_size) of the head outside tolerance or not "
                    "compared; worst token: the request's own query token index (its position in the request)\n",
                    style="dim")
    return text


def render_verdict(verdict: Verdict) -> Text:
    return verdict_line(verdict)


def nothing_to_compare(result: ReplayResult) -> Text:
    """Why a replay compared nothing (its verdict is then NOTHING VERIFIED, exit 3)."""
    ref = next((st for st in result.backends if st.name == "reference"), None)
    why = (f"the reference is unavailable ({ref.reason})" if ref is not None and not ref.available
           else "no other backend produced an output to compare and the snapshot holds no engine output")
    return Text(f"nothing to compare: {why}", style="yellow")


def render_title(result: ReplayResult) -> Text:
    """The first line: the snapshot and the layer it holds."""
    layer = result.meta.layer
    mask = ("causal" if layer.causal else "dense") + (f", window {layer.sliding_window}" if layer.sliding_window else "")
    steps = ", ".join(str(s.step) for s in result.steps)
    return Text(f"replay {result.path or '<memory>'}: Hq {layer.num_heads} / Hkv {layer.num_kv_heads}, "
                f"head_size {layer.head_size}, {mask}, kv cache {layer.kv_cache_dtype}; step(s) {steps}", style="bold")


def render_replay(report: ReplayReport, *, explain: bool = False, full: bool = False,
                  saved: str | None = None, before_verdict: list | None = None) -> Group:
    """Everything `kvdbg replay` prints, ending on the verdict line (``report.verdict``).

    ``before_verdict``: renderables shown just above the verdict line (`replay --picture`'s pictures).
    """
    result, comparisons = report.result, report.comparisons
    parts: list[Any] = [render_title(result)]
    parts.append(render_backends(result))
    for section in (render_unavailable(result), render_notes(result), render_findings(report.findings)):
        if section is not None:
            parts.append(section)
    if explain:
        parts.extend(render_explain(result, report.requests))
    starts = result.query_starts()
    parts.extend(render_comparison(c, full=full, starts=starts) for c in comparisons)
    if not comparisons:
        parts.append(nothing_to_compare(result))
    parts.append(render_footer(comparisons))
    if saved:
        parts.append(Text(f"outputs written to {saved}", style="dim"))
    parts.extend(before_verdict or [])
    parts.append(render_verdict(report.verdict))
    return Group(*parts)
