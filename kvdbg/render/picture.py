"""`kvdbg window --picture`: the query x key grids of kvdbg.moves.picture as terminal text (no torch).

Each grid row is one query token (rows are merged when the block is long),
each column a run of keys: an overview of the whole request scaled to the
width, then a zoom at one key per column where the first difference (or the
window's edge) lies, with page boundaries marked. A difference from the exact
mask wins its cell at any scale, so compression never hides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text

from kvdbg.moves.picture import EXTRA, LOADED, MEANING, MISSED, NONE, SEEN, Picture, cell_kind, merged_rows, row_groups

SYMBOL = {SEEN: "█", "partial": "▒", EXTRA: "+", MISSED: "!", LOADED: "░", NONE: "·"}
STYLE = {SEEN: "green", "partial": "green", EXTRA: "bold yellow", MISSED: "bold red", LOADED: "dim", NONE: "dim"}
MAX_TEXT_ROWS = 16  # display rows per grid; longer query blocks merge tokens into rows


@dataclass(frozen=True)
class Panel:
    """A range of keys drawn at a fixed number of keys per column."""

    first: int
    last: int  # exclusive
    per_column: int
    label: str

    @property
    def columns(self) -> int:
        return -(-(self.last - self.first) // self.per_column)

    def cell(self, column: int) -> tuple[int, int]:
        lo = self.first + column * self.per_column
        return lo, min(self.last, lo + self.per_column)


def panels(p: Picture, columns: int, zoom_columns: int | None = None) -> list[Panel]:
    """The overview (whole request) and, when it is compressed, a zoom at one key per column around the focus.

    ``zoom_columns`` (default ``columns``) is the zoom's width in keys.
    """
    columns = max(8, columns)
    per = max(1, -(-p.seq_len // columns))
    columns = max(8, zoom_columns or columns) if per > 1 else columns
    out = [Panel(0, p.seq_len, per, "whole request" if per == 1 else "overview")]
    if per > 1 and p.focus is not None:
        # Whole pages around the focus, the focus's page a little left of the middle.
        pages = max(1, columns // p.page_size)
        start_page = max(0, p.focus // p.page_size - (pages - 1) // 2)
        first = start_page * p.page_size
        last = min(p.seq_len, first + pages * p.page_size if pages * p.page_size <= columns else first + columns)
        first = max(0, min(first, last - columns)) if last - first < columns and last == p.seq_len else first
        out.append(Panel(first, last, 1, "zoom"))
    return out


def _ruler(panel: Panel, page_size: int, indent: int) -> list[Text]:
    """Key labels above the columns; in a zoom, a tick at every page start."""
    width = panel.columns
    labels = [" "] * width
    ticks = [" "] * width
    if panel.per_column == 1:
        marks = [c for c in range(width) if (panel.first + c) % page_size == 0]
        for c in marks:
            ticks[c] = "|"
    else:
        marks = sorted({0, width - 1, *[round(i * (width - 1) / 4) for i in range(1, 4)]})
        for c in marks:
            ticks[c] = "|"
    used = -1
    for c in marks:
        label = str(panel.cell(c)[0])
        start = min(c, width - len(label))  # a label at the right edge ends there instead of wrapping
        if start > used:
            labels[start:start + len(label)] = list(label)
            used = start + len(label)
    return [Text(" " * indent + "".join(labels).rstrip(), style="dim"), Text(" " * indent + "".join(ticks), style="dim")]


def picture_lines(p: Picture, width: int) -> list[Text]:
    label_width = len(f"i {max(p.query_len - 1, 0)}") + 1
    groups = row_groups(p.query_len, MAX_TEXT_ROWS)
    if len(groups) < p.query_len:
        label_width = len(f"i {p.query_len - 1}-{p.query_len - 1}") + 1
    indent = label_width + 1
    mask = "causal" if p.causal else "dense"
    who = f"request {p.request}: " if p.request is not None else ""
    lines = [Text(f"{who}query tokens x keys, L {p.seq_len}, q {p.query_len}, page_size {p.page_size}, {mask}, "
                  f"window {p.window if p.window else 'none'}", style="bold")]
    for panel in panels(p, width - indent):
        scale = "one column = 1 key" if panel.per_column == 1 else f"one column = {panel.per_column} keys"
        lines.append(Text(f"{panel.label}: keys {panel.first}..{panel.last - 1}, {scale}"
                          + (", | = page start" if panel.per_column == 1 else ""), style="italic"))
        lines.extend(_ruler(panel, p.page_size, indent))
        for grid in p.grids:
            title = Text(grid.title, style="bold")
            if grid.note:
                title.append(f" — {grid.note}", style="dim")
            lines.append(title)
            for first, last in groups:
                name = f"i {first}" if last - first == 1 else f"i {first}-{last - 1}"
                row = merged_rows(grid.rows, first, last)
                text = Text(name.rjust(label_width) + " ")
                for column in range(panel.columns):
                    kind = cell_kind(row, *panel.cell(column))
                    text.append(SYMBOL[kind], style=STYLE[kind])
                lines.append(text)
    legend = Text("legend: ", style="dim")
    for kind, meaning in ((SEEN, MEANING[SEEN]), ("partial", "part of the column's keys attended"),
                          (EXTRA, MEANING[EXTRA]), (MISSED, MEANING[MISSED]), (LOADED, MEANING[LOADED]),
                          (NONE, MEANING[NONE])):
        legend.append(SYMBOL[kind], style=STYLE[kind])
        legend.append(f" {meaning}  ", style="dim")
    lines.append(legend)
    lines.extend(Text(note, style="yellow") for note in p.notes)
    return lines


class PictureText:
    """A rich renderable: laid out at the console's width."""

    def __init__(self, picture: Picture):
        self.picture = picture

    def __rich_console__(self, console, options):
        yield from picture_lines(self.picture, options.max_width)


__all__ = ["MAX_TEXT_ROWS", "Panel", "PictureText", "SYMBOL", "panels", "picture_lines"]
