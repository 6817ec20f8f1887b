"""The picture of `kvdbg window` laid out on kvdbg.render.canvas: SVG text (no torch), PNG through matplotlib.

Both files show the same panels: an overview of the whole request, a zoom at
one key per cell around the first difference (page starts marked), and a legend.
"""

from __future__ import annotations

import textwrap

from kvdbg.moves.picture import EXTRA, LOADED, MEANING, MISSED, NONE, SEEN, Picture, cell_kind, merged_rows, row_groups
from kvdbg.render.canvas import CHAR_W, FAINT, LINE_H, MARGIN, Drawing, Label, Rect
from kvdbg.render.canvas import png_bytes as drawing_png
from kvdbg.render.canvas import svg_text as drawing_svg
from kvdbg.render.picture import panels

COLORS = {SEEN: (46, 125, 50), "partial": (129, 199, 132), EXTRA: (249, 168, 37), MISSED: (198, 40, 40),
          LOADED: (176, 190, 197), NONE: (240, 240, 240)}
PAGE_LINE = (66, 66, 66)

ROW_H = 10
GRID_COLUMNS = 800  # overview cells at most (one key each when the request is shorter)
ZOOM_CELL = 8  # px per key in the zoom
ZOOM_KEYS = 96  # keys in the zoom (whole pages when the page size divides it)
MAX_IMAGE_ROWS = 64  # display rows per grid; longer query blocks merge tokens


def layout(p: Picture) -> Drawing:
    """Panels of grids as rectangles (runs of equal cells merged) and labels, top to bottom."""
    groups = row_groups(p.query_len, MAX_IMAGE_ROWS)
    label_w = CHAR_W * (len(f"i {p.query_len - 1}-{p.query_len - 1}") + 1)
    grid_x = MARGIN + label_w
    overview, *zoom = panels(p, GRID_COLUMNS, ZOOM_KEYS)
    cell_w = {id(overview): max(1, GRID_COLUMNS // overview.columns)}
    for panel in zoom:
        cell_w[id(panel)] = ZOOM_CELL
    width = grid_x + max(overview.columns * cell_w[id(overview)],
                         *(z.columns * ZOOM_CELL for z in zoom), 560) + MARGIN
    chars = (width - 2 * MARGIN) // CHAR_W
    rects: list[Rect] = []
    labels: list[Label] = []
    y = MARGIN
    mask = "causal" if p.causal else "dense"
    who = f"request {p.request}: " if p.request is not None else ""
    title = (f"{who}L {p.seq_len}, q {p.query_len}, page_size {p.page_size}, {mask}, "
             f"window {p.window if p.window else 'none'}")
    labels.append(Label(MARGIN, y, title[: chars // 2], scale=2))
    y += 2 * LINE_H + 4
    for panel in [overview, *zoom]:
        cw = cell_w[id(panel)]
        scale = "1 key per cell" if panel.per_column == 1 else f"{panel.per_column} keys per cell"
        labels.append(Label(MARGIN, y, f"{panel.label}: keys {panel.first}..{panel.last - 1}, {scale}"[:chars]))
        y += LINE_H
        # Ruler: the first key of a few cells (every page start in a zoom).
        if panel.per_column == 1:
            marks = [c for c in range(panel.columns) if (panel.first + c) % p.page_size == 0]
        else:
            marks = sorted({0, panel.columns - 1, *[round(i * (panel.columns - 1) / 4) for i in range(1, 4)]})
        used = -1
        for c in marks:
            text = str(panel.cell(c)[0])
            x = grid_x + c * cw
            if x > used:
                labels.append(Label(x, y, text, FAINT))
                used = x + CHAR_W * (len(text) + 1)
        y += LINE_H
        for grid in p.grids:
            line = grid.title + (f" - {grid.note}" if grid.note else "")
            for part in textwrap.wrap(line, chars) or [""]:
                labels.append(Label(MARGIN, y, part))
                y += LINE_H
            top = y
            for first, last in groups:
                name = f"i {first}" if last - first == 1 else f"i {first}-{last - 1}"
                labels.append(Label(MARGIN, y + 1, name, FAINT))
                row = merged_rows(grid.rows, first, last)
                start, kind_run = 0, None
                for column in range(panel.columns + 1):
                    kind = cell_kind(row, *panel.cell(column)) if column < panel.columns else None
                    if kind != kind_run:
                        if kind_run is not None:
                            rects.append(Rect(grid_x + start * cw, y, (column - start) * cw, ROW_H - 1,
                                              COLORS[kind_run]))
                        start, kind_run = column, kind
                y += ROW_H
            if panel.per_column == 1:
                for c in range(panel.columns):
                    if (panel.first + c) % p.page_size == 0:
                        rects.append(Rect(grid_x + c * cw, top, 1, y - top, PAGE_LINE))
            y += 4
        y += LINE_H // 2
    x = MARGIN
    for kind, meaning in ((SEEN, MEANING[SEEN]), ("partial", "part of the cell's keys attended"),
                          (EXTRA, MEANING[EXTRA]), (MISSED, MEANING[MISSED]), (LOADED, MEANING[LOADED]),
                          (NONE, MEANING[NONE])):
        need = 14 + CHAR_W * (len(meaning) + 2)
        if x + need > width - MARGIN:
            x, y = MARGIN, y + LINE_H
        rects.append(Rect(x, y, 10, 9, COLORS[kind]))
        labels.append(Label(x + 14, y + 1, meaning))
        x += need
    y += LINE_H
    for note in p.notes:
        labels.append(Label(MARGIN, y, note[:chars], FAINT))
        y += LINE_H
    mask_name = "causal" if p.causal else "dense"
    return Drawing(width, y + MARGIN, rects, labels,
                   title=f"kvdbg window picture: {who}L {p.seq_len}, {mask_name}, window {p.window or 'none'}")


def svg_text(p: Picture) -> str:
    return drawing_svg(layout(p))


def png_bytes(p: Picture) -> bytes:
    """The same layout as a PNG (matplotlib, the ``plot`` extra; without it a one-line error names the extra)."""
    return drawing_png(layout(p), what="--png")


__all__ = ["COLORS", "Drawing", "Label", "Rect", "layout", "png_bytes", "svg_text"]
