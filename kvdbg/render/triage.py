"""The failing rows grouped by cause (kvdbg.fleet.triage), where a run's files ran, and the JSON of both.

`kvdbg replay DIR` prints these under its per-file table; `kvdbg triage RESULTS`
prints them from a results file. Text wraps to the console's width; an example
command too wide for the line breaks between words with a trailing backslash (still
one shell command), a path wider than the line is shown whole: print with ``crop=False``.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.fleet.triage import KIND_BAD_INPUT, KIND_FAIL, Triage
from kvdbg.render.shell import ShellCommand

KIND_STYLE = {KIND_FAIL: "bold red", KIND_BAD_INPUT: "bold red", "crashed": "bold red", "worker died": "bold red",
              "unverified": "yellow"}
SHOWN_PATHS = 3  # files named per group (--full: all; --json: all)


def _fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}"


def render_triage(result: Triage, *, full: bool = False) -> Group:
    """``By cause: …`` then one block per group: what failed, its files, the command that replays one."""
    parts: list[Any] = [Text(f"By cause: {result.headline()}", style="bold")]
    if not result.groups:
        parts.append(Text("   nothing failed"))
    for number, group in enumerate(result.groups, 1):
        sig = group.signature
        head = Text()
        head.append(sig.kind, style=KIND_STYLE.get(sig.kind, "bold"))
        head.append(f" × {len(group.rows)}: " + "; ".join(sig.parts))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", no_wrap=True)
        grid.add_column()
        grid.add_row(f"{number}.", head)
        span = group.error_range()
        if span is not None:
            grid.add_row("", f"max abs {_fmt(span[0])}" + ("" if span[0] == span[1] else f" to {_fmt(span[1])}"))
        names = [_short(r.path) for r in group.rows]
        shown = names if full else names[:SHOWN_PATHS]
        more = len(names) - len(shown)
        grid.add_row("", "files: " + ", ".join(shown) + (f", … {more} more (--full, --json)" if more else ""))
        parts.append(grid)
        # Broken only between words, with a trailing backslash, so that it is still copied whole (crop=False).
        indent = " " * (len(f"{number}.") + 1)
        parts.append(ShellCommand(result.command(group), f"{indent}$ "))
    return Group(*parts)


def _short(path: str) -> str:
    return os.path.basename(path) or path


def render_fleet(fleet) -> Group:
    """Where the files ran (per device), rows kept by --resume, workers that died, the results file."""
    lines = []
    if fleet.devices:
        each = ", ".join(f"{d.device} {d.files} file{'s' if d.files != 1 else ''}"
                         + (f" ({d.workers} workers)" if d.workers > 1 else "") for d in fleet.devices)
        rate = f"; {fleet.replayed / fleet.wall_s:.1f} files/s over {fleet.wall_s:.1f} s" if fleet.wall_s > 0 else ""
        lines.append(Text(f"Ran on: {each}{rate}"))
    if fleet.resumed:
        lines.append(Text(f"Kept from {fleet.results}: {fleet.resumed} row(s) (--resume); replayed: {fleet.replayed}"))
    for lost in fleet.lost:
        held = "" if lost.index is None else f" while replaying {_short(fleet.rows[lost.index].path)}"
        then = "; replayed again" if lost.retried else ("; reported as such" if lost.index is not None else "")
        lines.append(Text(f"A worker died on {lost.placement.label()} ({lost.how}){held}{then}", style="yellow"))
    if fleet.results:
        lines.append(Text(f"Rows in {fleet.results} (kvdbg triage {fleet.results})", style="dim"))
    return Group(*lines)


def fleet_json(fleet, batch_json: dict[str, Any]) -> dict[str, Any]:
    """`kvdbg replay DIR --json`: the per-file records (with ranks, engine step, where each ran), the groups
    ("triage"), the run; the verdict last."""
    out = dict(batch_json)
    verdict = out.pop("verdict")
    for record, row in zip(out["files"], fleet.rows):
        record.update({"ranks": row.ranks, "engine_step": row.step, "attempts": row.attempts,
                       "placement": row.placement.to_json() if row.placement is not None else None})
    out["triage"] = fleet.triage.to_json()
    out["run"] = fleet.to_json()
    out["verdict"] = verdict
    return out


__all__ = ["fleet_json", "render_fleet", "render_triage"]
