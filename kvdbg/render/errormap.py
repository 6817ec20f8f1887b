"""The error pictures of a replay: request x head maps and the error over steps, as terminal text and drawings.

Terminal: one character cell per head (wider when there are few heads, heads
grouped when there are more than the width holds), one row per request
(requests grouped past ``MAX_TEXT_ROWS`` unless --full); a grouped cell shows
its worst member, so a failing head is never hidden by scaling. Every grade
has its own glyph, so the map reads without colour (NO_COLOR).
"""

from __future__ import annotations

import math

from rich.text import Text

from kvdbg.judge.errormap import (ABOVE, BELOW, CAUSES, EXACT, EXPECTED_NONFINITE, FAR, GRADES, NONFINITE, SMALL, TINY,
                            UNWRITTEN, Cell, ErrorMap, ErrorPictures, StepSeries)
from kvdbg.render.canvas import CHAR_W, FAINT, INK, LINE_H, MARGIN, Drawing, Label, Line, Rect, stack

MAX_TEXT_ROWS = 32
FAILED = "fails"

SYMBOL = {EXACT: "·", TINY: "-", SMALL: "░", BELOW: "▒", ABOVE: "▓", FAR: "█", FAILED: "X",
          NONFINITE: "N", UNWRITTEN: "U", EXPECTED_NONFINITE: "?", "": " "}
STYLE = {EXACT: "dim", TINY: "green", SMALL: "green", BELOW: "green", ABOVE: "yellow", FAR: "yellow",
         FAILED: "bold red", NONFINITE: "bold red", UNWRITTEN: "bold red", EXPECTED_NONFINITE: "bold magenta",
         "": ""}
MEANING = {EXACT: "exact", TINY: "< atol/100", SMALL: "< atol/10", BELOW: "< atol", ABOVE: "< 10 atol (rtol)",
           FAR: ">= 10 atol (rtol)", FAILED: "fails", NONFINITE: "nan/inf", UNWRITTEN: "unwritten",
           EXPECTED_NONFINITE: "expected nan/inf"}
COLORS = {EXACT: (245, 245, 245), TINY: (199, 233, 192), SMALL: (161, 217, 155), BELOW: (116, 196, 118),
          ABOVE: (253, 208, 162), FAR: (253, 141, 60), FAILED: (203, 24, 29), NONFINITE: (103, 0, 13),
          UNWRITTEN: (37, 37, 37), EXPECTED_NONFINITE: (122, 1, 119), "": (255, 255, 255)}


def cell_key(cell: Cell | None) -> str:
    """The symbol a cell is drawn with: why it has no number, else failing, else its grade."""
    if cell is None:
        return ""
    if cell.cause:
        return cell.cause
    return FAILED if cell.failed else cell.grade


def _groups(values: list[int], most: int) -> list[list[int]]:
    if len(values) <= most:
        return [[v] for v in values]
    size = math.ceil(len(values) / most)
    return [values[i:i + size] for i in range(0, len(values), size)]


def _worst(m: ErrorMap, requests: list[int], heads: list[int]) -> Cell | None:
    cells = [m.cells.get((r, h)) for r in requests for h in heads]
    return max((c for c in cells if c is not None), key=lambda c: c.rank, default=None)


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


# --------------------------------------------------------------------------- terminal


def map_lines(m: ErrorMap, width: int, *, full: bool = False) -> list[Text]:
    requests, heads = m.requests, m.heads
    label_w = max(len(f"r {requests[-1]}") if requests else 3, 5)
    row_groups = _groups(requests, len(requests) if full else MAX_TEXT_ROWS)
    if any(len(g) > 1 for g in row_groups):
        label_w = max(label_w, max(len(f"r {_span(g)}") for g in row_groups))
    avail = max(8, width - label_w - 1)
    head_groups = _groups(heads, avail)
    cw = max(1, min(3, avail // max(1, len(head_groups))))
    style = "bold red" if m.failed else "bold"
    lines = [Text(m.summary(), style=style)]
    per = len(head_groups[0]) if head_groups else 1
    lines.append(Text(f"rows: requests{' (grouped: the worst of each)' if len(row_groups) < len(requests) else ''}; "
                      f"columns: heads{f' ({per} per column, the worst)' if per > 1 else ''}; "
                      f"atol {m.atol:g}, rtol {m.rtol:g}", style="dim"))
    # Head ruler: a label every few columns, never overlapping.
    ruler = [" "] * (len(head_groups) * cw)
    widest = len(str(heads[-1])) if heads else 1
    step = max(1, math.ceil((widest + 1) / cw))
    used = -1
    for index in range(0, len(head_groups), step):
        label = str(head_groups[index][0])
        at = index * cw
        if at > used and at + len(label) <= len(ruler):
            ruler[at:at + len(label)] = list(label)
            used = at + len(label)
    lines.append(Text("head".rjust(label_w) + " " + "".join(ruler).rstrip(), style="dim"))
    for group in row_groups:
        text = Text(f"r {_span(group)}".rjust(label_w) + " ")
        for hg in head_groups:
            key = cell_key(_worst(m, group, hg))
            text.append(SYMBOL[key] * cw, style=STYLE[key])
        lines.append(text)
    return lines


def legend_text() -> Text:
    legend = Text("legend: ", style="dim")
    for key in (*GRADES, FAILED, *CAUSES):
        legend.append(SYMBOL[key], style=STYLE[key])
        legend.append(f" {MEANING[key]}  ", style="dim")
    return legend


class ErrorMapText:
    """Every map of a replay, then the legend, laid out at the console's width."""

    def __init__(self, pictures: ErrorPictures, *, full: bool = False):
        self.pictures, self.full = pictures, full

    def __rich_console__(self, console, options):
        if not self.pictures.maps:
            yield Text("error map: nothing was compared", style="yellow")
            return
        for m in self.pictures.maps:
            yield from map_lines(m, options.max_width, full=self.full)
            yield Text("")
        yield legend_text()


def steps_lines(series: list[StepSeries], width: int) -> list[Text]:
    """Each comparison's worst error per step as a one-line strip (one column per step) with its numbers."""
    if not series:
        return [Text("error over steps: one step replayed", style="dim")]
    lines = [Text("error over steps (worst head of each step; X: a step with failing heads)", style="bold")]
    name_w = max(len(s.title) for s in series)
    for s in series:
        finite = [p.max_abs for p in s.points if p.max_abs == p.max_abs and p.max_abs > 0]
        lo, hi = (min(finite), max(finite)) if finite else (1.0, 1.0)
        text = Text(s.title.ljust(name_w) + " ")
        shown = s.points[:max(8, width - name_w - 30)]
        for p in shown:
            if p.failed_heads:
                text.append("X", style="bold red")
            elif p.max_abs != p.max_abs:
                text.append("?", style="magenta")
            else:
                text.append(_spark(p.max_abs, lo, hi), style="green")
        first = s.first_failure
        worst = max(s.points, key=lambda p: (p.max_abs == p.max_abs, p.max_abs))
        text.append(f" max {_fmt(worst.max_abs)} at step {worst.step}", style="dim")
        text.append(f"; fails from step {first}" if first is not None else "; passes every step",
                    style="red" if first is not None else "dim")
        lines.append(text)
    return lines


SPARKS = "▁▂▃▄▅▆▇█"


def _spark(value: float, lo: float, hi: float) -> str:
    if value <= 0:
        return SPARKS[0]
    if hi <= lo:
        return SPARKS[-1]
    t = (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    return SPARKS[max(0, min(len(SPARKS) - 1, round(t * (len(SPARKS) - 1))))]


class StepsText:
    def __init__(self, series: list[StepSeries]):
        self.series = series

    def __rich_console__(self, console, options):
        yield from steps_lines(self.series, options.max_width)


def _fmt(value: float) -> str:
    if value != value:
        return "nan"
    return "0" if value == 0 else f"{value:.2e}"


# --------------------------------------------------------------------------- drawings

MAP_WIDTH = 640  # px the cells of one map may take
MAP_HEIGHT = 480
MAX_CELL = 16
MIN_CELL = 3


def errormap_drawing(pictures: ErrorPictures, *, title: str = "") -> Drawing:
    """Every map of the replay, stacked, each with its summary, head and request labels; the legend below."""
    width = MARGIN * 2 + 60 + MAP_WIDTH
    d = Drawing(width, 0, title=title or "kvdbg error map")
    y = MARGIN
    d.labels.append(Label(MARGIN, y, (title or "error map: requests x heads")[: (width - 2 * MARGIN) // (2 * CHAR_W)],
                          scale=2))
    y += 2 * LINE_H + 4
    chars = (width - 2 * MARGIN) // CHAR_W
    for m in pictures.maps:
        row_groups = _groups(m.requests, MAP_HEIGHT // MIN_CELL)
        head_groups = _groups(m.heads, MAP_WIDTH // MIN_CELL)
        cell = max(MIN_CELL, min(MAX_CELL, MAP_WIDTH // max(1, len(head_groups)),
                                 MAP_HEIGHT // max(1, len(row_groups))))
        for part in _wrap(m.summary(), chars):
            d.labels.append(Label(MARGIN, y, part, (198, 40, 40) if m.failed else INK))
            y += LINE_H
        grid_x = MARGIN + 60
        # head labels (a few), then the cells
        every = max(1, math.ceil(4 * CHAR_W / cell))
        for index in range(0, len(head_groups), every):
            d.labels.append(Label(grid_x + index * cell, y, str(head_groups[index][0]), FAINT))
        d.labels.append(Label(MARGIN, y, "head", FAINT))
        y += LINE_H
        top = y
        every_row = max(1, math.ceil(LINE_H / cell))
        for ri, group in enumerate(row_groups):
            if ri % every_row == 0:
                d.labels.append(Label(MARGIN, y + max(0, (cell - 9) / 2), f"r {_span(group)}", FAINT))
            for hi, hg in enumerate(head_groups):
                key = cell_key(_worst(m, group, hg))
                if key:
                    d.rects.append(Rect(grid_x + hi * cell, y, max(1, cell - (1 if cell > 4 else 0)),
                                        max(1, cell - (1 if cell > 4 else 0)), COLORS[key]))
            y += cell
        # A frame makes the map's extent visible when most cells are pale.
        d.lines.append(Line(((grid_x - 1, top - 1), (grid_x + len(head_groups) * cell, top - 1),
                             (grid_x + len(head_groups) * cell, y), (grid_x - 1, y), (grid_x - 1, top - 1)), FAINT))
        y += LINE_H
    y = _legend(d, y, [(key, MEANING[key]) for key in (*GRADES, FAILED, *CAUSES)])
    d.height = int(y + MARGIN)
    return d


def _legend(d: Drawing, y: float, items: list[tuple[str, str]]) -> float:
    x = MARGIN
    for key, meaning in items:
        need = 14 + CHAR_W * (len(meaning) + 2)
        if x + need > d.width - MARGIN:
            x, y = MARGIN, y + LINE_H
        d.rects.append(Rect(x, y, 10, 9, COLORS[key], stroke=FAINT if key == EXACT else None))
        d.labels.append(Label(x + 14, y, meaning))
        x += need
    return y + LINE_H


SERIES_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189), (140, 86, 75), (227, 119, 194),
                 (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def steps_drawing(series: list[StepSeries], *, title: str = "") -> Drawing:
    """Max abs error per step, one line per comparison, on a log scale; failing steps marked by a red square."""
    plot_w, plot_h = 600, 240
    left = MARGIN + 9 * CHAR_W
    width = left + plot_w + MARGIN
    d = Drawing(width, 0, title=title or "kvdbg error over steps")
    y = MARGIN
    d.labels.append(Label(MARGIN, y, (title or "error over steps")[: (width - 2 * MARGIN) // (2 * CHAR_W)], scale=2))
    y += 2 * LINE_H + 4
    d.labels.append(Label(MARGIN, y, "max abs error of the worst head per step (log scale); red square: failing heads",
                          FAINT))
    y += LINE_H + 4
    top = y
    values = [p.max_abs for s in series for p in s.points if p.max_abs == p.max_abs and p.max_abs > 0]
    steps = sorted({p.step for s in series for p in s.points})
    lo_exp = math.floor(math.log10(min(values))) if values else -8
    hi_exp = math.ceil(math.log10(max(values))) if values else 0
    if hi_exp <= lo_exp:
        hi_exp = lo_exp + 1
    first, last = (steps[0], steps[-1]) if steps else (0, 1)
    span = max(1, last - first)

    def px(step: int) -> float:
        return left + (step - first) / span * plot_w

    def py(value: float) -> float:
        value = max(value, 10.0 ** lo_exp)
        return top + plot_h - (math.log10(value) - lo_exp) / (hi_exp - lo_exp) * plot_h

    d.lines.append(Line(((left, top), (left, top + plot_h), (left + plot_w, top + plot_h)), INK))
    for e in range(lo_exp, hi_exp + 1):
        d.lines.append(Line(((left, py(10.0 ** e)), (left + plot_w, py(10.0 ** e))), (224, 224, 224)))
        d.labels.append(Label(left - 4, py(10.0 ** e) - 5, f"1e{e}", FAINT, anchor="end"))
    every = max(1, math.ceil(len(steps) / 12))
    for s in steps[::every]:
        d.labels.append(Label(px(s), top + plot_h + 3, str(s), FAINT, anchor="middle"))
    d.labels.append(Label(left + plot_w / 2, top + plot_h + 3 + LINE_H, "step", FAINT, anchor="middle"))
    legend_y = top + plot_h + 3 + 2 * LINE_H + 4
    x = MARGIN
    for index, s in enumerate(series):
        color = SERIES_COLORS[index % len(SERIES_COLORS)]
        points = [(px(p.step), py(p.max_abs)) for p in s.points if p.max_abs == p.max_abs]
        if len(points) > 1:
            d.lines.append(Line(tuple(points), color, width=2, dashed=not s.counted))
        for p in s.points:
            if p.max_abs != p.max_abs:
                continue
            mark = 7 if p.failed_heads else 5
            d.rects.append(Rect(px(p.step) - mark / 2, py(p.max_abs) - mark / 2, mark, mark,
                                COLORS[FAILED] if p.failed_heads else color))
        text = s.title + ("" if s.counted else " (what-if)")
        need = 24 + CHAR_W * (len(text) + 2)
        if x + need > width - MARGIN:
            x, legend_y = MARGIN, legend_y + LINE_H
        d.lines.append(Line(((x, legend_y + 5), (x + 18, legend_y + 5)), color, width=2, dashed=not s.counted))
        d.labels.append(Label(x + 22, legend_y, text))
        x += need
    d.height = int(legend_y + LINE_H + MARGIN)
    return d


def error_drawing(pictures: ErrorPictures) -> Drawing:
    """`replay --svg/--png`: the error maps, and below them the error over steps when several were replayed."""
    name = (pictures.snapshot or "").rsplit("/", 1)[-1]
    maps = errormap_drawing(pictures, title=f"error map: {name}" if name else "")
    if not pictures.series:
        return maps
    return stack([maps, steps_drawing(pictures.series, title="error over steps")], title=maps.title)


def _wrap(text: str, chars: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, max(10, chars)) or [""]


__all__ = ["COLORS", "ErrorMapText", "MAX_TEXT_ROWS", "StepsText", "SYMBOL", "cell_key", "error_drawing", "errormap_drawing",
           "legend_text", "map_lines", "steps_drawing", "steps_lines"]
