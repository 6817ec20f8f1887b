"""`kvdbg attention`: one token's weights over the keys, the reference against each backend, as text and a drawing.

Two panels, as `window --picture` has: an overview of the whole request (the
mass of each run of keys) and a zoom at one key per column around the focus
(the first key a column weights outside the exact mask or skips inside it;
else the window's edge), with page starts, the exact window's bounds and the
null block marked. Keys a column must not read are drawn apart (red, and a
``+`` under them in text), keys it skips that the reference weights with ``!``.
A NaN/Inf weight (a key whose K holds NaN/Inf, for every column that reads it)
is ``N`` in text and a full-height dark bar crossed out in the drawing: never
an empty cell, never a scale computed with it.
"""

from __future__ import annotations

import math

from rich.text import Text

from kvdbg.moves.attention import AttentionPicture, ColumnWeights
from kvdbg.render.canvas import CHAR_W, FAINT, INK, LINE_H, MARGIN, Drawing, Label, Line, Rect, wrap
from kvdbg.render.fit import Column, FitTable

LEVELS = " ▁▂▃▄▅▆▇█"
NONFINITE_GLYPH = "N"  # as the error map marks a NaN/Inf cell
ZOOM_KEYS_TEXT = 64


def _fmt(value: float | None) -> str:
    """Three significant digits; ``nan``/``inf`` as such (a NaN mass is not "no mass"); ``-`` for no value."""
    if value is None:
        return "-"
    if value != value or value in (math.inf, -math.inf):
        return str(value)
    return "0" if value == 0 else f"{value:.2e}"


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _finite_max(values) -> float | None:
    """The largest finite value (None when none is): the scale of a strip, which a NaN must not set."""
    return max((v for v in values if _finite(v)), default=None)


def _scale_text(top: float | None) -> str:
    return "no finite weight" if top is None else _fmt(top)


def _key_runs(runs: list[tuple[int, int]], most: int = 6) -> str:
    text = ", ".join(str(a) if b - a == 1 else f"{a}..{b - 1}" for a, b in runs[:most])
    return text + (", …" if len(runs) > most else "")


def nonfinite_lines(p: AttentionPicture) -> list[str]:
    """What holds NaN/Inf and which columns read it, one line each (empty when nothing does)."""
    lines = []
    if p.query_nonfinite:
        lines.append("the query token holds NaN/Inf: every logit, and so every weight, is NaN")
    for side, runs, effect in (("K", p.nonfinite_k, "its weights are NaN"),
                               ("V", p.nonfinite_v, "its Σw·v is NaN")):
        if not runs:
            continue
        count = sum(b - a for a, b in runs)
        readers = [c.backend for c in p.columns if c.weights is not None and
                   (c.nonfinite_k_count if side == "K" else c.nonfinite_v_count)]
        who = (f"read by {', '.join(readers)} ({effect})" if readers else "read by no column shown")
        lines.append(f"NaN/Inf in {side} at {'key' if count == 1 else f'{count} keys'} {_key_runs(runs)}: {who}")
    return lines


def _keys(pairs: list[tuple[int, float]], count: int, most: int = 4) -> str:
    if not count:
        return "0"
    shown = ", ".join(str(k) for k, _ in sorted(pairs)[:most])
    return f"{count} ({shown}{', …' if count > most else ''})"


def header_lines(p: AttentionPicture) -> list[Text]:
    mask = ("causal" if p.causal else "dense") + (f", window {p.window}" if p.window else ", no window")
    lines = [Text(f"where the attention went: step {p.step}, request {p.request}, head {p.head} (kv head "
                  f"{p.kv_head}), query token {p.token} of {p.query_len} (position {p.position})", style="bold"),
             Text(f"chosen: {p.chosen}", style="dim"),
             Text(f"exact keys {p.exact[0]}..{p.exact[1] - 1} of L {p.seq_len} ({mask}); page size {p.page_size}")]
    marks = []
    if p.null_block:
        marks.append("null block (engine page 0) at keys " + ", ".join(f"{a}..{b - 1}" for a, b in p.null_block))
    if p.hidden:
        marks.append("entries flex's map does not point back to (a page listed twice) at keys "
                     + ", ".join(f"{a}..{b - 1}" for a, b in p.hidden))
    if p.stale_entries:
        cols = p.stale_entries
        marks.append(f"stale table entries past the live pages (never read): columns {cols[0]}..{cols[-1]}"
                     if cols == list(range(cols[0], cols[-1] + 1)) else
                     "stale table entries past the live pages (never read): columns " + ", ".join(map(str, cols)))
    lines += [Text(m, style="yellow") for m in marks]
    lines += [Text(m, style="bold red") for m in nonfinite_lines(p)]
    return lines


def weights_table(p: AttentionPicture) -> FitTable:
    """Per column: the mass it gives keys the exact mask hides, the reference mass it skips, and the output check."""
    table = FitTable([Column("column", whole=True, priority=10, style="bold", justify="left"), Column("outside mass", whole=True, priority=9),
                      Column("outside keys", priority=5), Column("skipped mass", whole=True, priority=8),
                      Column("skipped keys", priority=4), Column("Σw·v vs output", whole=True, priority=7),
                      Column("its error", whole=True, priority=6), Column("max |Δw|", whole=True, priority=2)],
                     title="weights: outside = keys the exact mask hides (it must not read them); skipped = "
                           "exact keys it leaves out")
    for c in p.columns:
        if c.weights is None:
            table.add_row(c.backend, "", Text(c.note, style="yellow"), "", "", "", "", "")
            continue
        if c.reproduces is None:
            check = Text("not checked", style="dim")
        elif c.output_nonfinite:
            # Σw·v is NaN: say whether the output the backend wrote is NaN there too, not a number.
            check = Text("NaN, as its output" if c.reproduces else "NaN; output is not",
                         style="bold red")
        else:
            check = Text(f"{'ok' if c.reproduces else 'DIFFERS'} {_fmt(c.output_diff)}",
                         style="green" if c.reproduces else "bold red")
        outside = Text(_fmt(c.forbidden_mass), style="bold red" if c.forbidden_mass else "")
        skipped = "-" if c.backend == "reference" else Text(_fmt(c.missed_mass),
                                                            style="bold red" if c.missed_mass else "")
        table.add_row(c.backend, outside, _keys(c.forbidden_keys, c.forbidden_count),
                      skipped, "-" if c.backend == "reference" else _keys(c.missed_keys, c.missed_count),
                      check, _fmt(c.exact_output_diff), _fmt(c.max_weight_diff))
    return table


def _drawn(p: AttentionPicture) -> list[ColumnWeights]:
    return [c for c in p.columns if c.weights is not None]


def _weight(c: ColumnWeights, p: AttentionPicture, key: int) -> float:
    if p.span[0] <= key < p.span[1]:
        return c.weights[key - p.span[0]]
    return 0.0


def _mass(c: ColumnWeights, p: AttentionPicture, lo: int, hi: int) -> float:
    lo, hi = max(lo, p.span[0]), min(hi, p.span[1])
    return sum(c.weights[lo - p.span[0]:hi - p.span[0]]) if hi > lo else 0.0


def _outside(p: AttentionPicture, key: int) -> bool:
    return not p.exact[0] <= key < p.exact[1]


def zoom_range(p: AttentionPicture, keys: int) -> tuple[int, int]:
    """Whole pages around the focus, the focus's page a little left of the middle, inside [0, L)."""
    ps = p.page_size
    pages = max(1, keys // ps)
    first_page = max(0, p.focus // ps - (pages - 1) // 3)
    lo = first_page * ps
    hi = min(p.seq_len, lo + (pages * ps if pages * ps <= keys else keys))
    lo = max(0, min(lo, hi - keys)) if hi == p.seq_len else lo
    return lo, hi


def picture_lines(p: AttentionPicture, width: int) -> list[Text]:
    cols = _drawn(p)
    name_w = max([len(c.backend) for c in cols] + [5]) + 1
    avail = max(16, width - name_w)
    lines: list[Text] = []
    # Overview: the mass of each run of keys, scaled to the largest run.
    per = max(1, math.ceil(p.seq_len / avail))
    n = math.ceil(p.seq_len / per)
    masses = {c.backend: [_mass(c, p, i * per, (i + 1) * per) for i in range(n)] for c in cols}
    top = _finite_max(m for ms in masses.values() for m in ms) or 1.0
    lines.append(Text(f"overview: keys 0..{p.seq_len - 1}, one column = {per} key{'s' if per > 1 else ''} "
                      "(its weight mass, scaled to the largest column)", style="italic"))
    lines.append(Text(" " * name_w + _ruler(0, per, n), style="dim"))
    for c in cols:
        text = Text(c.backend.ljust(name_w))
        for i, m in enumerate(masses[c.backend]):
            lo, hi = i * per, min(p.seq_len, (i + 1) * per)
            bad = not _finite(m) or (m > 0 and (_outside(p, lo) or _outside(p, hi - 1))
                                     and _mass_outside(c, p, lo, hi) > 0)
            text.append(_level(m, top), style="bold red" if bad else "green")
        lines.append(text)
    # Zoom: one key per column.
    lo, hi = zoom_range(p, min(avail, ZOOM_KEYS_TEXT if avail < ZOOM_KEYS_TEXT else avail))
    poisoned = [(a, b) for a, b in p.nonfinite_k + p.nonfinite_v if a < hi and b > lo]
    shows_nan = bool(poisoned) or any(not _finite(w) for c in cols for w in c.weights)
    lines.append(Text(f"zoom: keys {lo}..{hi - 1}, one column = 1 key; | page start, [ ] the exact keys' bounds, "
                      "0 null block; + weight it must not give, ! a key it skips"
                      + (f"; {NONFINITE_GLYPH} a key holding NaN/Inf, a NaN/Inf weight" if shows_nan else ""),
                      style="italic"))
    lines.append(Text(" " * name_w + _ruler(lo, 1, hi - lo, page=p.page_size), style="dim"))
    marks = []
    for k in range(lo, hi):
        if any(a <= k < b for a, b in poisoned):
            marks.append(NONFINITE_GLYPH)
        elif k == p.exact[0]:
            marks.append("[")
        elif k == p.exact[1] - 1:
            marks.append("]")
        elif any(a <= k < b for a, b in p.null_block):
            marks.append("0")
        elif k % p.page_size == 0:
            marks.append("|")
        else:
            marks.append(" ")
    lines.append(Text(" " * name_w + "".join(marks), style="yellow"))
    ref = p.column("reference")
    zoom_top = _finite_max(_weight(c, p, k) for c in cols for k in range(lo, hi))
    ztop = zoom_top or 1.0
    for c in cols:
        text = Text(c.backend.ljust(name_w))
        under = []
        for k in range(lo, hi):
            w = _weight(c, p, k)
            bad = w > 0 and _outside(p, k)
            skipped = (c.backend != "reference" and ref is not None and _weight(ref, p, k) > 0
                       and not _attends(c, k))
            text.append(_level(w, ztop), style="bold red" if bad or not _finite(w) else "green")
            under.append("+" if bad else "!" if skipped else " ")
        lines.append(text)
        if any(ch != " " for ch in under):
            lines.append(Text(" " * name_w + "".join(under), style="bold red"))
    lines.append(Text(f"a column's height: its weight, ▁..█ scaled to the largest ({_scale_text(zoom_top)} in the "
                      "zoom)", style="dim"))
    lines += [Text(n, style="yellow") for n in p.notes]
    lines += [Text(f"{c.backend}: {c.note}", style="yellow") for c in p.columns if c.weights is not None and c.note]
    return lines


def _attends(c: ColumnWeights, key: int) -> bool:
    return any(a <= key < b for a, b in c.attended)


def _mass_outside(c: ColumnWeights, p: AttentionPicture, lo: int, hi: int) -> float:
    return _mass(c, p, lo, min(hi, p.exact[0])) + _mass(c, p, max(lo, p.exact[1]), hi)


def _level(value: float, top: float) -> str:
    if not _finite(value):
        return NONFINITE_GLYPH
    if value <= 0:
        return "·"
    return LEVELS[max(1, min(len(LEVELS) - 1, math.ceil(value / top * (len(LEVELS) - 1))))]


def _ruler(first: int, per: int, columns: int, *, page: int | None = None) -> str:
    out = [" "] * columns
    if page:
        marks = [c for c in range(columns) if (first + c) % (page * max(1, math.ceil(8 / page))) == 0]
    else:
        marks = sorted({0, *[round(i * (columns - 1) / 4) for i in range(1, 5)]})
    used = -1
    for c in marks:
        label = str(first + c * per)
        at = min(c, columns - len(label))
        if at > used:
            out[at:at + len(label)] = list(label)
            used = at + len(label)
    return "".join(out).rstrip()


class AttentionText:
    def __init__(self, picture: AttentionPicture):
        self.picture = picture

    def __rich_console__(self, console, options):
        yield from header_lines(self.picture)
        yield weights_table(self.picture)
        yield from picture_lines(self.picture, options.max_width)


# --------------------------------------------------------------------------- drawing

PLOT_W = 720
STRIP_H = 46
ZOOM_KEYS = 96
REF_COLOR = (33, 113, 181)
SEEN_COLOR = (65, 171, 93)
BAD_COLOR = (215, 25, 28)
SKIPPED_COLOR = (253, 174, 97)
NONFINITE_COLOR = (103, 0, 13)  # the error map's NaN/Inf colour
WINDOW_BAND = (235, 245, 235)
NULL_BAND = (252, 220, 220)
PAGE_LINE = (150, 150, 150)


def attention_drawing(p: AttentionPicture) -> Drawing:
    cols = _drawn(p)
    name_w = CHAR_W * (max([len(c.backend) for c in cols] + [9]) + 1)
    left = MARGIN + name_w
    width = left + PLOT_W + MARGIN
    chars = (width - 2 * MARGIN) // CHAR_W
    d = Drawing(width, 0, title=f"kvdbg attention: step {p.step}, request {p.request}, head {p.head}, token {p.token}")
    y = MARGIN
    d.labels.append(Label(MARGIN, y, f"where the attention went: request {p.request}, head {p.head}, token "
                                     f"{p.token}"[: chars // 2], scale=2))
    y += 2 * LINE_H + 4
    for line in header_lines(p)[1:]:
        for part in wrap(line.plain, chars):
            color = {"yellow": (166, 97, 26), "bold red": NONFINITE_COLOR}.get(str(line.style), INK)
            d.labels.append(Label(MARGIN, y, part, color))
            y += LINE_H
    y += 4
    for c in p.columns:
        if c.weights is None:
            text = f"{c.backend}: {c.note}"
        else:
            text = (f"{c.backend}: mass outside the exact keys {_fmt(c.forbidden_mass)} on "
                    f"{_keys(c.forbidden_keys, c.forbidden_count)} key(s)")
            if c.backend != "reference":
                text += f"; reference mass it skips {_fmt(c.missed_mass)} on {_keys(c.missed_keys, c.missed_count)}"
            if c.reads_nonfinite:
                text += "; reads NaN/Inf at " + ", ".join(
                    f"{side} key(s) {', '.join(map(str, keys[:6]))}{', …' if count > 6 else ''}"
                    for side, keys, count in (("K", c.nonfinite_k_read, c.nonfinite_k_count),
                                              ("V", c.nonfinite_v_read, c.nonfinite_v_count)) if count)
            if c.reproduces is not None:
                text += (f"; Σw·v vs its output {_fmt(c.output_diff)} "
                         f"{'(reproduces it)' if c.reproduces else '(DOES NOT reproduce it)'}")
        for part in wrap(text, chars):
            bad = c.weights is not None and (c.forbidden_mass > 0 or c.missed_mass > 0 or c.reads_nonfinite
                                             or not _finite(c.forbidden_mass) or not _finite(c.missed_mass))
            d.labels.append(Label(MARGIN, y, part, BAD_COLOR if bad else INK))
            y += LINE_H
    y += LINE_H // 2
    # Overview: mass per bin over the whole request.
    bins = min(PLOT_W // 2, p.seq_len)
    per = p.seq_len / bins
    bin_w = PLOT_W / bins
    d.labels.append(Label(MARGIN, y, f"overview: keys 0..{p.seq_len - 1}, each bar the weight mass of "
                                     f"{per:.3g} keys; green band: the exact keys; red band: null block"[:chars]))
    y += LINE_H
    y = _axis(d, left, y, 0, p.seq_len, PLOT_W, lambda k: left + k / p.seq_len * PLOT_W, ticks=5)
    masses = {c.backend: [_mass(c, p, int(i * per), int((i + 1) * per)) for i in range(bins)] for c in cols}
    overview_top = _finite_max(m for ms in masses.values() for m in ms)
    top = overview_top or 1.0
    for c in cols:
        _band(d, p, left, y, lambda k: left + k / p.seq_len * PLOT_W)
        d.labels.append(Label(MARGIN, y + STRIP_H / 2 - 5, c.backend))
        for i, m in enumerate(masses[c.backend]):
            if not _finite(m):
                _nonfinite_bar(d, left + i * bin_w, y, max(1.0, bin_w))
                continue
            if m <= 0:
                continue
            lo, hi = int(i * per), int((i + 1) * per)
            bad = _mass_outside(c, p, lo, max(lo + 1, hi)) > 0
            h = max(1.0, m / top * (STRIP_H - 4))
            d.rects.append(Rect(left + i * bin_w, y + STRIP_H - h, max(1.0, bin_w), h,
                                BAD_COLOR if bad else (REF_COLOR if c.backend == "reference" else SEEN_COLOR)))
        d.lines.append(Line(((left, y + STRIP_H), (left + PLOT_W, y + STRIP_H)), FAINT))
        y += STRIP_H + 4
    y += LINE_H // 2
    # Zoom: one bar per key.
    lo, hi = zoom_range(p, ZOOM_KEYS)
    key_w = PLOT_W / max(1, hi - lo)
    for part in wrap(f"zoom: keys {lo}..{hi - 1}, one bar per key; grey lines: page starts; dashed: the exact "
                     f"keys' bounds; red: weight it must not give; orange outline: a key it skips (the reference's "
                     f"weight there)", chars):
        d.labels.append(Label(MARGIN, y, part))
        y += LINE_H
    y = _axis(d, left, y, lo, hi, PLOT_W, lambda k: left + (k - lo) * key_w, page=p.page_size)
    zoom_top = _finite_max(_weight(c, p, k) for c in cols for k in range(lo, hi))
    ztop = zoom_top or 1.0
    ref = p.column("reference")
    for c in cols:
        _band(d, p, left, y, lambda k: left + (max(lo, min(hi, k)) - lo) * key_w)
        d.labels.append(Label(MARGIN, y + STRIP_H / 2 - 5, c.backend))
        for k in range(lo, hi):
            x = left + (k - lo) * key_w
            w = _weight(c, p, k)
            if not _finite(w):
                _nonfinite_bar(d, x + 0.5, y, max(1.0, key_w - 1))
            elif w > 0:
                bad = _outside(p, k)
                h = max(1.0, w / ztop * (STRIP_H - 4))
                d.rects.append(Rect(x + 0.5, y + STRIP_H - h, max(1.0, key_w - 1), h,
                                    BAD_COLOR if bad else (REF_COLOR if c.backend == "reference" else SEEN_COLOR)))
            elif c.backend != "reference" and ref is not None and _weight(ref, p, k) > 0 and not _attends(c, k):
                h = max(1.0, _weight(ref, p, k) / ztop * (STRIP_H - 4))
                d.rects.append(Rect(x + 0.5, y + STRIP_H - h, max(1.0, key_w - 1), h, (255, 255, 255),
                                    stroke=SKIPPED_COLOR))
        for k in range(lo, hi + 1):
            if k % p.page_size == 0:
                x = left + (k - lo) * key_w
                d.lines.append(Line(((x, y), (x, y + STRIP_H)), PAGE_LINE))
        for bound in (p.exact[0], p.exact[1]):
            if lo <= bound <= hi:
                x = left + (bound - lo) * key_w
                d.lines.append(Line(((x, y - 2), (x, y + STRIP_H + 2)), INK, width=1.5, dashed=True))
        d.lines.append(Line(((left, y + STRIP_H), (left + PLOT_W, y + STRIP_H)), FAINT))
        y += STRIP_H + 4
    for c in cols:
        if c.forbidden_keys:
            listed = ", ".join(f"key {k}: {w:.2e}" for k, w in sorted(c.forbidden_keys)[:6])
            more = f" and {c.forbidden_count - 6} more" if c.forbidden_count > 6 else ""
            for part in wrap(f"{c.backend} weights outside the exact keys: {listed}{more} (mass "
                             f"{_fmt(c.forbidden_mass)})", chars):
                d.labels.append(Label(MARGIN, y, part, BAD_COLOR))
                y += LINE_H
    for line in nonfinite_lines(p):
        for part in wrap(line + "; drawn as full-height dark bars, crossed out", chars):
            d.labels.append(Label(MARGIN, y, part, NONFINITE_COLOR))
            y += LINE_H
    y += 4
    d.labels.append(Label(MARGIN, y, f"bar height: weight, scaled to the largest finite one in the zoom "
                                     f"({_scale_text(zoom_top)}) and in the overview ({_scale_text(overview_top)})"
                                     [:chars], FAINT))
    y += LINE_H
    for note in p.notes:
        for part in wrap(note, chars):
            d.labels.append(Label(MARGIN, y, part, FAINT))
            y += LINE_H
    d.height = int(y + MARGIN)
    return d


def _nonfinite_bar(d: Drawing, x: float, y: float, w: float) -> None:
    """A NaN/Inf weight: the strip's full height in the NaN colour, crossed out, so it reads without colour too."""
    d.rects.append(Rect(x, y, w, STRIP_H, NONFINITE_COLOR))
    d.lines.append(Line(((x, y + STRIP_H), (x + w, y)), (255, 255, 255)))
    d.lines.append(Line(((x, y), (x + w, y + STRIP_H)), (255, 255, 255)))


def _band(d: Drawing, p: AttentionPicture, left: float, y: float, x_of) -> None:
    """The exact keys as a pale green band, the null block's keys as a pale red one, behind a strip."""
    a, b = x_of(p.exact[0]), x_of(p.exact[1])
    if b > a:
        d.rects.append(Rect(a, y, b - a, STRIP_H, WINDOW_BAND))
    for lo, hi in p.null_block + p.hidden:
        a, b = x_of(lo), x_of(hi)
        if b > a:
            d.rects.append(Rect(a, y, b - a, STRIP_H, NULL_BAND))


def _axis(d: Drawing, left: float, y: float, lo: int, hi: int, width: float, x_of, *, ticks: int = 0,
          page: int | None = None) -> float:
    if page:
        every = page * max(1, math.ceil(6 * CHAR_W / (page * width / max(1, hi - lo))))
        marks = [k for k in range(lo, hi) if k % every == 0]
    else:
        marks = sorted({lo, *[lo + round(i * (hi - 1 - lo) / (ticks - 1)) for i in range(1, ticks)]})
    used = -1.0
    for k in marks:
        x = x_of(k)
        text = str(k)
        x = min(x, left + width - CHAR_W * len(text))  # a label at the right edge ends there
        if x > used:
            d.labels.append(Label(x, y, text, FAINT))
            used = x + CHAR_W * (len(text) + 1)
    return y + LINE_H


__all__ = ["AttentionText", "attention_drawing", "header_lines", "nonfinite_lines", "picture_lines", "weights_table",
           "zoom_range"]
