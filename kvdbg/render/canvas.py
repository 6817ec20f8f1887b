"""A picture as rectangles, lines and labels in pixels, written as SVG text or rasterised to PNG by matplotlib.

Every picture kvdbg draws (the window grids, the error map, the attention
weights, the error over steps) is laid out once as a :class:`Drawing`; the SVG
is plain text written here (no dependency, no web font, nothing fetched when
opened), the PNG is the same drawing rasterised by matplotlib (the ``plot``
extra), so both files show the same thing. Text is monospace, about
``CHAR_W`` pixels per character at 10 px, in SVG and PNG alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from kvdbg.errors import OptionError

Color = tuple[int, int, int]

INK: Color = (33, 33, 33)
FAINT: Color = (117, 117, 117)
BACKGROUND: Color = (255, 255, 255)
CHAR_W = 6  # px per character of 10 px monospace text (DejaVu Sans Mono advances 0.602 em)
LINE_H = 12
MARGIN = 12

PLOT_EXTRA = "pip install 'kvdbg[plot]'"


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    color: Color
    stroke: Color | None = None  # an outline (1 px) instead of nothing


@dataclass(frozen=True)
class Line:
    points: tuple[tuple[float, float], ...]
    color: Color
    width: float = 1.0
    dashed: bool = False


@dataclass(frozen=True)
class Label:
    x: float
    y: float  # top of the text
    text: str
    color: Color = INK
    scale: int = 1  # 2: a title
    anchor: str = "start"  # "start", "middle" or "end" of the text at x


@dataclass
class Drawing:
    width: int
    height: int
    rects: list[Rect] = field(default_factory=list)
    labels: list[Label] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    title: str = ""  # the SVG's <title>: what a screen reader or a browser tab says


def stack(drawings: list[Drawing], *, title: str = "") -> Drawing:
    """Drawings one below the other, left-aligned, in one drawing."""
    out = Drawing(max((d.width for d in drawings), default=2 * MARGIN), 0, title=title or (
        drawings[0].title if drawings else ""))
    y = 0.0
    for d in drawings:
        out.rects += [Rect(r.x, r.y + y, r.w, r.h, r.color, r.stroke) for r in d.rects]
        out.labels += [Label(a.x, a.y + y, a.text, a.color, a.scale, a.anchor) for a in d.labels]
        out.lines += [Line(tuple((x, py + y) for x, py in line.points), line.color, line.width, line.dashed)
                      for line in d.lines]
        y += d.height
    out.height = int(y)
    return out


def hex_color(color: Color) -> str:
    return "#%02x%02x%02x" % color


def svg_text(d: Drawing) -> str:
    """The drawing as one self-contained SVG document."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{d.width}" height="{d.height}" '
           f'viewBox="0 0 {d.width} {d.height}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" '
           f'font-size="10">']
    if d.title:
        out.append(f"<title>{escape(d.title)}</title>")
    out.append(f'<rect x="0" y="0" width="{d.width}" height="{d.height}" fill="{hex_color(BACKGROUND)}"/>')
    for r in d.rects:
        stroke = f' stroke="{hex_color(r.stroke)}" stroke-width="1"' if r.stroke else ""
        out.append(f'<rect x="{_n(r.x)}" y="{_n(r.y)}" width="{_n(r.w)}" height="{_n(r.h)}" '
                   f'fill="{hex_color(r.color)}"{stroke}/>')
    for line in d.lines:
        points = " ".join(f"{_n(x)},{_n(y)}" for x, y in line.points)
        dash = ' stroke-dasharray="4 3"' if line.dashed else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{hex_color(line.color)}" '
                   f'stroke-width="{_n(line.width)}"{dash}/>')
    for label in d.labels:
        size = ' font-size="20" font-weight="bold"' if label.scale > 1 else ""
        anchor = f' text-anchor="{label.anchor}"' if label.anchor != "start" else ""
        # y is the text's top; SVG places the baseline, about 8 px below at 10 px.
        out.append(f'<text x="{_n(label.x)}" y="{_n(label.y + 8 * label.scale)}" fill="{hex_color(label.color)}"'
                   f'{size}{anchor}>{escape(label.text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _n(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


def require_raster(what: str = "PNG output") -> None:
    """An OptionError naming the extra when matplotlib is not installed (checked before any work is done)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise OptionError(f"{what} needs matplotlib: {PLOT_EXTRA} (SVG needs nothing)")


def png_bytes(d: Drawing, *, what: str = "PNG output") -> bytes:
    """The drawing rasterised by matplotlib (Agg), one pixel per drawing unit.

    Without matplotlib, an OptionError names the extra that gives PNG.
    """
    import io

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        raise OptionError(f"{what} needs matplotlib: {PLOT_EXTRA} (SVG needs nothing)") from None
    dpi = 100
    fig = Figure(figsize=(d.width / dpi, d.height / dpi), dpi=dpi, facecolor=_rgb(BACKGROUND))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, d.width)
    ax.set_ylim(d.height, 0)  # y down, as in SVG
    ax.set_axis_off()
    # Crisp edges: a 1-px page boundary should stay one pixel, not two half-grey ones.
    for r in d.rects:
        ax.add_patch(Rectangle((r.x, r.y), r.w, r.h, facecolor=_rgb(r.color), linewidth=0.75 if r.stroke else 0,
                               edgecolor=_rgb(r.stroke) if r.stroke else "none", antialiased=False))
    for line in d.lines:
        xs, ys = zip(*line.points) if line.points else ((), ())
        ax.plot(xs, ys, color=_rgb(line.color), linewidth=line.width * 72 / dpi,
                linestyle=(0, (4, 3)) if line.dashed else "-", solid_joinstyle="round")
    points_per_px = 72 / dpi
    for label in d.labels:
        size = 10 * label.scale
        ax.text(label.x, label.y + 8 * label.scale, label.text, color=_rgb(label.color), fontsize=size * points_per_px,
                family="DejaVu Sans Mono", weight="bold" if label.scale > 1 else "normal",
                ha={"start": "left", "middle": "center", "end": "right"}[label.anchor], va="baseline")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor=fig.get_facecolor(),
                metadata={"Software": None})  # no matplotlib version in the file: same bytes everywhere it can
    return buffer.getvalue()


def _rgb(color: Color) -> tuple[float, float, float]:
    return (color[0] / 255, color[1] / 255, color[2] / 255)


def wrap(text: str, chars: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, max(10, chars)) or [""]


__all__ = ["BACKGROUND", "CHAR_W", "Color", "Drawing", "FAINT", "INK", "LINE_H", "Label", "Line", "MARGIN",
           "PLOT_EXTRA", "Rect", "hex_color", "png_bytes", "require_raster", "stack", "svg_text", "wrap"]
