"""Small formatting helpers shared by the renderers."""

from __future__ import annotations


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def elide(values: list, keep_head: int = 6, keep_tail: int = 2, full: bool = False) -> str:
    """Join values with spaces, eliding the middle of long runs: ``3 5 1 … 6``."""
    items = [str(v) for v in values]
    if full or len(items) <= keep_head + keep_tail + 1:
        return " ".join(items)
    return " ".join(items[:keep_head] + ["…"] + items[-keep_tail:])


def verdict_line(verdict):
    """The verdict as the last line of a command's output, with the exit code it gives."""
    from rich.text import Text

    style = {"pass": "bold green", "fail": "bold red"}.get(verdict.status, "bold yellow")
    return Text(f"{verdict.summary} (exit {verdict.exit_code})", style=style)


# C0 controls but newline and tab, DEL, and C1 controls: a terminal acts on them (ESC starts a colour, a window
# title, a cursor move). A snapshot is a file from someone else's bug report: its names and notes, and the file
# names of a directory, are shown as text, never acted on.
_CONTROLS = dict.fromkeys([*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0),
                           # Invisible formatting: bidirectional marks, embeddings, overrides and isolates (which
                           # can reverse how the rest of a line reads), zero-width characters, the line and
                           # paragraph separators, and the byte-order mark. They take no column, so a table
                           # measured with them in would also come out wider than the terminal.
                           0x061C, *range(0x200B, 0x2010), *range(0x2028, 0x202F), *range(0x2060, 0x2065),
                           *range(0x2066, 0x206A), 0xFEFF])


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab written out as ``\\xNN`` (``\\uNNNN`` past
    0xFF: the invisible formatting characters)."""
    if text.translate(_CONTROLS) == text:
        return text
    return "".join((f"\\x{ord(c):02x}" if ord(c) <= 0xFF else f"\\u{ord(c):04x}") if ord(c) in _CONTROLS else c
                   for c in text)


def _printable_cells(renderable):
    """The renderable with the text of its cells, titles and captions made :func:`printable` before layout
    (so that the columns are measured as shown); a renderable of another kind is left to the segment filter."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from kvdbg.render.fit import FitTable

    if isinstance(renderable, str):
        return printable(renderable)
    if isinstance(renderable, Text):
        if renderable.plain.translate(_CONTROLS) == renderable.plain:
            return renderable
        return Text(printable(renderable.plain), style=renderable.style, justify=renderable.justify,
                    overflow=renderable.overflow, no_wrap=renderable.no_wrap, end=renderable.end)
    if isinstance(renderable, Group):
        renderable._renderables = [_printable_cells(r) for r in renderable._renderables]
    elif isinstance(renderable, FitTable):
        renderable.rows = [[_printable_cells(cell) for cell in row] for row in renderable.rows]
        renderable.title = _printable_cells(renderable.title) if renderable.title is not None else None
        renderable.caption = printable(renderable.caption) if renderable.caption is not None else None
    elif isinstance(renderable, Table):
        for column in renderable.columns:
            column._cells = [_printable_cells(cell) for cell in column._cells]
        for name in ("title", "caption"):
            if getattr(renderable, name) is not None:
                setattr(renderable, name, _printable_cells(getattr(renderable, name)))
    elif isinstance(renderable, Panel):
        renderable.renderable = _printable_cells(renderable.renderable)
    return renderable


def show_controls(console) -> None:
    """Make ``console`` write the control characters of whatever it prints as text (:func:`printable`); its
    own styles still reach the terminal. The consoles of every command and of the report's exports use it."""
    from rich.console import RenderHook

    class Printable:
        def __init__(self, inner):
            self.inner = _printable_cells(inner)

        def __rich_console__(self, console, options):
            from rich.segment import Segment

            for segment in console.render(self.inner, options):
                if segment.control or segment.text.translate(_CONTROLS) == segment.text:
                    yield segment
                else:
                    yield Segment(printable(segment.text), segment.style)

    class Hook(RenderHook):
        def process_renderables(self, renderables):
            return [Printable(r) for r in renderables]

    console.push_render_hook(Hook())
