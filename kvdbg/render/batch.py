"""The summary table and JSON of `kvdbg replay DIR|FILES...` (one row per snapshot)."""

from __future__ import annotations

import os
import re
from typing import Any

from rich.console import Group
from rich.text import Text

from kvdbg.batch import (STATUS_BAD_INPUT, STATUS_CRASHED, STATUS_FAIL, STATUS_PASS, STATUS_UNVERIFIED, BatchResult,
                         FileResult)
from kvdbg.render.fit import Column, FitTable

STATUS_TEXT = {STATUS_PASS: ("PASS", "bold green"), STATUS_FAIL: ("FAIL", "bold red"),
               STATUS_UNVERIFIED: ("UNVERIFIED", "yellow"), STATUS_BAD_INPUT: ("BAD INPUT", "bold red"),
               STATUS_CRASHED: ("CRASHED", "bold red")}
EXIT_RULE = ("exit: 2 if any file is bad input; else 1 if any fails (or kvdbg raised on it); else 3 if no file "
             "verified anything; else 0. Each row's verdict is `kvdbg replay FILE`'s.")


def _fmt(value: float | None) -> str:
    if value is None:
        return "nan"
    return "0" if value == 0 else f"{value:.2e}"


def _steps(steps: list[int]) -> str:
    if not steps:
        return "-"
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}-{steps[-1]}"
    return ",".join(map(str, steps))


def display_names(files: list[FileResult]) -> tuple[list[str], str | None]:
    """(names to show, their common directory): the file names when every file lies in one directory, else
    the paths as given."""
    if not files:
        return [], None
    directories = {os.path.dirname(os.path.abspath(f.path)) for f in files}
    if len(directories) == 1:
        directory = os.path.dirname(files[0].path) or "."
        return [os.path.basename(f.path) for f in files], directory
    return [f.path for f in files], None


def short_layer(name: str | None) -> str:
    """``model.layers.7.self_attn.attn`` -> ``layers.7`` (the column must stay narrow; --json has the name)."""
    if not name:
        return "-"
    match = re.search(r"(?:^|\.)(layers?\.\d+)(?:\.|$)", name)
    return match.group(1) if match else name


def _why(f: FileResult) -> str:
    """The one-line reason, without the path the row already names."""
    text = f.summary
    for prefix in (f"{f.path}: ", f"{os.path.abspath(f.path)}: "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _worst(f: FileResult) -> Text:
    text = Text()
    w = f.worst
    if w is not None:
        text.append(w.actual if w.expected == "reference" else f"{w.actual} vs {w.expected}")
        if not w.passed:
            text.append(f": {w.failed_heads}/{w.heads} heads fail", style="red")
        if len(f.steps) > 1:
            text.append(f" (step {w.step})")
        if not w.counted:
            text.append(" (what-if, not counted)", style="dim")
    if f.error_findings:
        text.append(("; " if text else "") + ", ".join(f.error_findings), style="red")
    return text if text else Text("-")


def render_batch(result: BatchResult) -> Group:
    names, directory = display_names(result.files)
    title = f"{len(result.files)} snapshot(s)" + (f" in {directory}" if directory else "")
    table = FitTable([Column("file", priority=10, min_width=14), Column("layer", whole=True, justify="left", priority=2),
                      Column("step", whole=True, justify="left", priority=4),
                      Column("verdict", whole=True, justify="left", priority=9),
                      Column("worst backend / why", priority=8), Column("max abs", whole=True, priority=7)],
                     title=title,
                     caption="worst: the backend whose comparison (with the reference unless named) fails worst, "
                             "else errs most; its error findings; why: a file not replayed")
    for name, f in zip(names, result.files):
        label, style = STATUS_TEXT[f.status]
        if f.status in (STATUS_BAD_INPUT, STATUS_CRASHED):
            table.add_row(name, short_layer(f.layer), "-", Text(label, style=style), Text(_why(f), style="red"), "-")
            continue
        error = _fmt(f.worst.max_abs) if f.worst is not None else "-"
        table.add_row(name, short_layer(f.layer), _steps(f.steps), Text(label, style=style), _worst(f), error)
    return Group(table, Text(EXIT_RULE, style="dim"))


def batch_json(result: BatchResult) -> dict[str, Any]:
    """One object per file, in the order replayed, then the overall verdict (the last key)."""
    return {"files": [f.to_json() for f in result.files], "counts": result.counts, "rule": EXIT_RULE,
            "verdict": result.verdict.to_json()}


__all__ = ["EXIT_RULE", "batch_json", "display_names", "render_batch"]
