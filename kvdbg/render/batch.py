"""The summary table and JSON of `kvdbg replay DIR|FILES...` (one row per snapshot)."""

from __future__ import annotations

import os
import re
from typing import Any

from rich.console import Group
from rich.text import Text

from kvdbg.replayer.batch import (STATUS_BAD_INPUT, STATUS_CRASHED, STATUS_FAIL, STATUS_PASS, STATUS_UNVERIFIED, BatchResult,
                         FileResult, StepRow)
from kvdbg.render.fit import Column, FitTable

STATUS_TEXT = {STATUS_PASS: ("PASS", "bold green"), STATUS_FAIL: ("FAIL", "bold red"),
               STATUS_UNVERIFIED: ("UNVERIFIED", "yellow"), STATUS_BAD_INPUT: ("BAD INPUT", "bold red"),
               STATUS_CRASHED: ("CRASHED", "bold red")}
FILE_NAME_WHOLE = 32  # file names up to this many characters are never broken across lines
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


def _why(f: FileResult | StepRow) -> str:
    """The one-line reason, without the path the row already names."""
    text = f.summary
    paths = [f.path] if isinstance(f, FileResult) else [m.path for m in f.files]
    for path in paths:
        for prefix in (f"{path}: ", f"{os.path.abspath(path)}: "):
            text = text.replace(prefix, "")
    return text


def _ranks(ranks: list[int]) -> str:
    return _steps(ranks) if ranks else "-"


def _worst(f: FileResult | StepRow) -> Text:
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


def _title(result: BatchResult) -> str:
    _, directory = display_names([row.files[0] for row in result.rows])
    title = f"{len(result.files)} snapshot(s)" + (f" in {directory}" if directory else "")
    if any(len(row.files) > 1 for row in result.rows):
        title += f"; {len(result.rows)} rows, a step's ranks in one"
    return title


def render_batch_title(result: BatchResult) -> Text:
    """The first line of `kvdbg replay DIR` without --full (the groups by cause follow; --full adds a row per file)."""
    return Text(_title(result), style="bold")


def render_batch(result: BatchResult) -> Group:
    rows = result.rows
    names, directory = display_names([row.files[0] for row in rows])
    grouped = any(len(row.files) > 1 for row in rows)
    title = _title(result)
    # A file name is what a reader copies: whole when it leaves room for the verdict and the error, else broken
    # at its boundaries (before the extension, after _ / -), never inside a word.
    whole_names = max((len(name) for name in names), default=0) <= FILE_NAME_WHOLE
    columns = [Column("file", whole=whole_names, justify="left", priority=10, min_width=14),
               Column("layer", whole=True, justify="left", priority=2),
               Column("step", whole=True, justify="left", priority=4)]
    if grouped:
        columns.append(Column("ranks", whole=True, justify="left", priority=5))
    columns += [Column("verdict", whole=True, justify="left", priority=9),
                Column("worst backend / why", priority=8), Column("max abs", whole=True, priority=7)]
    caption = ("worst: the backend whose comparison (with the reference unless named) fails worst, else errs most; "
               "its error findings; why: a file not replayed")
    if grouped:
        caption += "; ranks: the first rank's file is named, heads are counted over the ranks"
    table = FitTable(columns, title=title, caption=caption)
    for name, row in zip(names, rows):
        label, style = STATUS_TEXT[row.status]
        ranks = [_ranks(row.tp_ranks) + (f" of {row.tp_size}" if row.partial else "")] if grouped else []
        if row.status in (STATUS_BAD_INPUT, STATUS_CRASHED):
            table.add_row(name, short_layer(row.layer), "-", *ranks, Text(label, style=style),
                          Text(_why(row), style="red"), "-")
            continue
        worst = row.worst
        error = _fmt(worst.max_abs) if worst is not None else "-"
        table.add_row(name, short_layer(row.layer), _steps(row.steps), *ranks, Text(label, style=style), _worst(row),
                      error)
    return Group(table, Text(EXIT_RULE, style="dim"))


def batch_json(result: BatchResult) -> dict[str, Any]:
    """One object per file, in the order replayed; the rows (a step's ranks in one); the verdict (the last key)."""
    return {"files": [f.to_json() for f in result.files], "rows": [row.to_json() for row in result.rows],
            "counts": result.counts, "rule": EXIT_RULE, "verdict": result.verdict.to_json()}


__all__ = ["EXIT_RULE", "batch_json", "display_names", "render_batch", "render_batch_title"]
