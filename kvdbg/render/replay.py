"""Tables and JSON for `kvdbg replay`: what ran, findings, per-head diffs, the tolerance rule."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.diff import Comparison, HeadDiff
from kvdbg.replay import ReplayResult
from kvdbg.verdict import Verdict, replay_verdict

MAX_FAILING_ROWS = 32
MAX_PASSING_ROWS = 8
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _fmt(value: float, spec: str = ".3g") -> str:
    if value != value:
        return "nan"
    return format(value, spec)


def _mode(info) -> str:
    if info is None:
        return "-"
    return "compiled" if info.compiled else "eager"


def render_backends(result: ReplayResult) -> Table:
    table = Table(title="backends", title_justify="left")
    for col in ("backend", "engine name", "status", "kernel", "device", "mode", "dtype", "emulated", "time"):
        table.add_column(col, justify="right" if col == "time" else "left")
    times: dict[str, float] = {}
    for step in result.steps:
        for name, run in step.runs.items():
            times[name] = times.get(name, 0.0) + run.build_s + run.forward_s
    errors = {name for step in result.steps for name, run in step.runs.items() if run.error}
    for st in result.backends:
        if not st.available:
            table.add_row(st.name, st.engine_name or "-", Text("unavailable", style="yellow"),
                          Text(st.reason or "", style="yellow"), "", "", "", "", "")
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


def not_applicable_notes(result: ReplayResult) -> list[tuple[str, str]]:
    """(backend, "step N not applicable: why") for every step a backend's builder would not run."""
    return [(name, f"step {step.step} not applicable, not compared: {run.not_applicable}")
            for step in result.steps for name, run in step.runs.items() if run.not_applicable is not None]


def render_notes(result: ReplayResult) -> Table | None:
    rows = [(st.name, note) for st in result.backends if st.info for note in st.info.notes]
    rows += not_applicable_notes(result)
    if not rows:
        return None
    table = Table(title="what each backend did", title_justify="left", show_header=False)
    table.add_column("backend", style="bold")
    table.add_column("note")
    for name, note in rows:
        table.add_row(name, note)
    return table


def render_findings(result: ReplayResult) -> Table | None:
    findings = sorted(result.findings, key=lambda f: (("error", "warning", "info").index(f.severity)
                                                      if f.severity in ("error", "warning", "info") else 3,
                                                      f.step or 0, f.request if f.request is not None else -1))
    if not findings:
        return None
    table = Table(title=f"findings ({len(findings)})", title_justify="left")
    for col in ("severity", "backend", "step", "request", "code", "message"):
        table.add_column(col)
    for f in findings:
        style = SEVERITY_STYLE.get(f.severity, "")
        table.add_row(Text(f.severity, style=style), f.backend, "-" if f.step is None else str(f.step),
                      "-" if f.request is None else str(f.request), f.code, Text(f.message, style=style))
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


def render_comparison(comp: Comparison, *, full: bool = False) -> Table:
    if not comp.heads:
        verdict = Text("nothing compared (no head selected)", style="yellow")
    elif comp.passed:
        verdict = Text("PASS", style="bold green")
    else:
        verdict = Text(f"FAIL: {len(comp.failed)} of {len(comp.heads)} heads", style="bold red")
    counts = comp.counts()
    causes = [f"{counts['actual_nonfinite']} {comp.actual} NaN/inf" if counts["actual_nonfinite"] else "",
              f"{counts['unwritten']} unwritten" if counts["unwritten"] else "",
              f"{counts['expected_nonfinite']} {comp.expected} NaN/inf" if counts["expected_nonfinite"] else ""]
    title = Text.assemble(f"step {comp.step}: {comp.actual} vs {comp.expected} — ", verdict,
                          f"  (max abs {_fmt(comp.max_abs)}"
                          + "".join(f", {c}" for c in causes if c) + ")")
    table = Table(title=title, title_justify="left")
    for col in ("request", "head", "status", "max abs", "mean abs", "max rel", "cosine", "worst token (pos)",
                "failing", "not compared"):
        table.add_column(col, justify="left" if col == "status" else "right")
    rows, hidden = _head_rows(comp.heads, full)
    for h in rows:
        status = Text("ok", style="green") if h.passed else Text("FAIL", style="bold red")
        table.add_row(str(h.request), str(h.head), status, _fmt(h.max_abs), _fmt(h.mean_abs), _fmt(h.max_rel),
                      _fmt(h.cosine, ".6f"), f"{h.worst_token} ({h.worst_position})", str(h.failing),
                      Text(_not_compared(h), style="red" if h.not_compared else ""))
    if hidden:
        table.caption = f"… {hidden} more passing heads (--full)"
        table.caption_justify = "left"
    return table


def render_explain(result: ReplayResult) -> list[Table]:
    tables = []
    for step in result.steps:
        for name, run in step.runs.items():
            if not run.explain:
                continue
            table = Table(title=f"step {step.step}: {name} builder decisions", title_justify="left")
            columns = list(dict.fromkeys(k for row in run.explain for k in row))
            for col in columns:
                table.add_column(col, justify="right")
            for row in run.explain:
                table.add_row(*(str(row.get(col, "")) for col in columns))
            tables.append(table)
    return tables


def render_footer(comparisons: list[Comparison]) -> Text:
    text = Text("pass rule: an element passes when |a - e| <= atol + rtol·|e| (e: expected); "
                "NaN or inf on either side, or a token not written, always fails\n", style="dim")
    seen = set()
    for c in comparisons:
        key = (c.actual, c.expected, c.tolerance)
        if key in seen:
            continue
        seen.add(key)
        text.append(f"  {c.actual} vs {c.expected}: atol {c.tolerance.atol:g}, rtol {c.tolerance.rtol:g} "
                    f"({c.tolerance.source})\n", style="dim")
    return text


def render_verdict(verdict: Verdict) -> Text:
    style = {"pass": "bold green", "fail": "bold red"}.get(verdict.status, "bold yellow")
    return Text(f"{verdict.summary} (exit {verdict.exit_code})", style=style)


def render_replay(result: ReplayResult, comparisons: list[Comparison], verdict: Verdict | None = None, *,
                  explain: bool = False, full: bool = False, saved: str | None = None) -> Group:
    verdict = verdict or replay_verdict(comparisons, result.findings)
    layer = result.meta.layer
    mask = ("causal" if layer.causal else "dense") + (f", window {layer.sliding_window}" if layer.sliding_window else "")
    steps = ", ".join(str(s.step) for s in result.steps)
    parts: list[Any] = [Text(f"replay {result.path or '<memory>'}: Hq {layer.num_heads} / Hkv {layer.num_kv_heads}, "
                             f"head_size {layer.head_size}, {mask}, kv cache {layer.kv_cache_dtype}; step(s) {steps}",
                             style="bold")]
    parts.append(render_backends(result))
    notes = render_notes(result)
    if notes is not None:
        parts.append(notes)
    findings = render_findings(result)
    if findings is not None:
        parts.append(findings)
    if explain:
        parts.extend(render_explain(result))
    parts.extend(render_comparison(c, full=full) for c in comparisons)
    if not comparisons:
        ref = next((st for st in result.backends if st.name == "reference"), None)
        why = (f"the reference is unavailable ({ref.reason})" if ref is not None and not ref.available
               else "no other backend produced an output to compare and the snapshot holds no engine output")
        parts.append(Text(f"nothing to compare: {why}", style="yellow"))
    parts.append(render_footer(comparisons))
    if saved:
        parts.append(Text(f"outputs written to {saved}", style="dim"))
    parts.append(render_verdict(verdict))
    return Group(*parts)


def _info_json(info) -> dict | None:
    if info is None:
        return None
    return {"kernel": info.kernel, "device": info.device, "dtype": info.dtype, "emulated": info.emulated,
            "compiled": info.compiled, "notes": list(info.notes)}


def replay_json(result: ReplayResult, comparisons: list[Comparison], verdict: Verdict | None = None, *,
                explain: bool = False) -> dict:
    verdict = verdict or replay_verdict(comparisons, result.findings)
    steps = []
    for step in result.steps:
        record: dict[str, Any] = {
            "step": step.step,
            "num_reqs": step.common.num_reqs,
            "num_tokens": step.common.num_actual_tokens,
            "has_captured_output": step.captured_output is not None,
            "runs": {name: {"build_s": run.build_s, "forward_s": run.forward_s, "error": run.error,
                            "not_applicable": run.not_applicable}
                     for name, run in step.runs.items()},
        }
        if explain:
            record["explain"] = {name: run.explain for name, run in step.runs.items() if run.explain}
        steps.append(record)
    findings = [{"backend": f.backend, "code": f.code, "severity": f.severity, "step": f.step, "request": f.request,
                 "message": f.message, "details": {k: v for k, v in f.details.items() if k != "traceback"}}
                for f in result.findings]
    return {
        "snapshot": result.path,
        "passed": verdict.passed,
        "verdict": verdict.to_json_dict(),
        "backends": [{"name": st.name, "engine_name": st.engine_name, "available": st.available,
                      "reason": st.reason, "run": _info_json(st.info)} for st in result.backends],
        "findings": findings,
        "steps": steps,
        "comparisons": [c.to_json_dict() for c in comparisons],
        "rule": "|a - e| <= atol + rtol*|e|",
    }
