"""Tables that fit the terminal: numbers are never cut; text wraps first, then whole columns drop.

rich squeezes every column of a table that is too wide, numbers included
(``0.00…``). A ``FitTable`` is drawn at the width it is given: whole columns (numbers, codes)
keep their full width, text columns wrap, and when even that does not fit, the least
important columns are left out and the caption says which.

A text column narrows no further than its longest word (up to ``NAME_MIN_WIDTH``), so a
backend name, a kernel name or a dtype stays whole; a word longer than its column
(a long path, a long identifier) is broken where it has a boundary -- after ``_``, ``/``
or ``-``, before ``.`` -- rather than wherever rich's fold would cut it
(``flashinfer_t``/``s``); a number is never broken.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table
from rich.text import Text

# Below this, a text column would wrap one short word per line; it drops instead.
TEXT_MIN_WIDTH = 12
# A text column keeps its longest word whole up to this width; a longer word breaks at its boundaries.
NAME_MIN_WIDTH = 16
# Where a word may break: after _ / - and before . (a file's extension stays together).
_SEGMENT = re.compile(r"\.?[^_/.\-]*[_/\-]*")
_NUMBER = re.compile(r"^[-+]?[0-9][0-9.,]*(?:e[-+]?[0-9]+)?%?[)\],;]*$")


@dataclass
class Column:
    header: str
    whole: bool = False  # numbers (and codes): never wrapped nor cut; right-aligned unless told
    priority: int = 0  # higher stays longer; the lowest drops first when the table does not fit
    style: str | None = None
    min_width: int = TEXT_MIN_WIDTH  # text columns only
    justify: str | None = None


@dataclass
class FitTable:
    """A rich renderable: the table is laid out when the console's width is known."""

    columns: list[Column]
    rows: list[list[Any]] = field(default_factory=list)
    title: Any = None
    caption: str | None = None
    show_header: bool = True

    def add_row(self, *cells: Any) -> None:
        self.rows.append(list(cells))

    def fit(self, width: int) -> tuple[list[int], list[str]]:
        """Indices of the columns shown at ``width`` and the headers left out."""
        keep = list(range(len(self.columns)))
        while _needed(self, keep) > width and len(keep) > 1:
            drop = min(keep, key=lambda i: (self.columns[i].priority, -i))  # the rightmost of the least important
            keep.remove(drop)
        dropped = [self.columns[i].header for i in range(len(self.columns)) if i not in keep]
        return keep, dropped

    def table(self, width: int) -> Table:
        keep, dropped = self.fit(width)
        caption = self.caption
        if dropped:
            note = f"hidden at {width} columns: {', '.join(dropped)} (wider terminal or --json)"
            caption = f"{caption}\n{note}" if caption else note
        table = Table(title=self.title, title_justify="left", caption=caption, caption_justify="left",
                      show_header=self.show_header)
        widths = _text_widths(self, keep, width)
        broken = {i: w for i, w in widths.items() if _longest_word(self, i, cap=None) > w}
        for i in keep:
            col = self.columns[i]
            if col.whole:
                # A fixed width as wide as the widest cell: rich never squeezes it, and the header wraps.
                table.add_column(col.header, justify=col.justify or "right", width=_cell_width(self, i),
                                 overflow="fold", style=col.style)
            else:
                # Its width is decided here, not by rich: rich's own squeeze can leave a table a column or two
                # wider than the terminal, which it then crops (the right border and the last column's end).
                table.add_column(col.header, justify=col.justify or "left", overflow="fold", style=col.style,
                                 min_width=_text_min(self, i), width=widths.get(i))
        for row in self.rows:
            cells = [row[i] if i < len(row) else "" for i in keep]
            table.add_row(*(break_words(cell, broken[i]) if i in broken else cell for i, cell in zip(keep, cells)))
        return table

    def __rich_console__(self, console, options):
        yield self.table(options.max_width)


def _plain(cell: Any) -> str:
    if isinstance(cell, Text):
        return cell.plain
    return "" if cell is None else str(cell)


def _cell_width(t: FitTable, i: int) -> int:
    longest_word = _header_word(t, i)
    cells = max((max((len(line) for line in _plain(r[i]).split("\n")), default=0) for r in t.rows if i < len(r)),
                default=0)
    return max(cells, longest_word, 1)


def _header_word(t: FitTable, i: int) -> int:
    return max((len(w) for w in t.columns[i].header.split()), default=0) if t.show_header else 0


def _longest_word(t: FitTable, i: int, cap: int | None = NAME_MIN_WIDTH) -> int:
    """The longest word of a column's cells (at most ``cap``)."""
    longest = max((len(word) for r in t.rows if i < len(r) for word in _plain(r[i]).split()), default=0)
    return longest if cap is None else min(longest, cap)


def _text_min(t: FitTable, i: int) -> int:
    """A text column wraps down to this: its longest header word, its longest word up to NAME_MIN_WIDTH, or
    less when its cells are all shorter."""
    return max(_header_word(t, i), _longest_word(t, i), min(_cell_width(t, i), t.columns[i].min_width))


def word_pieces(word: str, width: int) -> list[str]:
    """``word`` in pieces of at most ``width``, broken at its boundaries (after ``_ / -``, before ``.``) and
    only where a piece between boundaries is itself too long, inside it; a number is one piece."""
    if len(word) <= width or _NUMBER.match(word):
        return [word]
    segments = [seg for seg in _SEGMENT.findall(word) if seg]
    pieces: list[str] = []
    current = ""
    for seg in segments:
        while len(seg) > width:  # no boundary close enough: cut it (the only place a word is cut)
            if current:
                pieces.append(current)
                current = ""
            pieces.append(seg[:width])
            seg = seg[width:]
        if len(current) + len(seg) > width:
            pieces.append(current)
            current = seg
        else:
            current += seg
    if current:
        pieces.append(current)
    return pieces


def break_words(cell: Any, width: int) -> Any:
    """A cell whose words longer than ``width`` are broken into lines at their boundaries (word_pieces); its
    styles kept. Rich then wraps the pieces as words, instead of folding a word at the column's edge."""
    plain = _plain(cell)
    cuts: list[int] = []
    for match in re.finditer(r"\S+", plain):
        if len(match.group()) > width:
            offset = match.start()
            for piece in word_pieces(match.group(), width)[:-1]:
                offset += len(piece)
                cuts.append(offset)
    if not cuts:
        return cell
    text = cell if isinstance(cell, Text) else Text(plain)
    return Text("\n").join(text.divide(cuts))


def _text_widths(t: FitTable, keep: list[int], width: int) -> dict[int, int]:
    """Widths for the text columns when the table at its natural width would not fit ``width`` (none when it
    fits): the widest text column narrows first, one character at a time, none below its minimum."""
    text = [i for i in keep if not t.columns[i].whole]
    natural = {i: max(_cell_width(t, i), len(t.columns[i].header) if t.show_header else 0) for i in text}
    fixed = sum(_cell_width(t, i) for i in keep if t.columns[i].whole)
    excess = fixed + sum(natural.values()) + 1 + 3 * len(keep) - width
    if excess <= 0:
        return {}
    widths = dict(natural)
    floor = {i: _text_min(t, i) for i in text}
    while excess > 0:
        widest = max((i for i in text if widths[i] > floor[i]), key=lambda i: (widths[i], -i), default=None)
        if widest is None:  # fit() already dropped what it could; rich folds the rest
            break
        widths[widest] -= 1
        excess -= 1
    return widths


def _needed(t: FitTable, keep: list[int]) -> int:
    """The narrowest the table can be drawn with these columns without cutting a number."""
    total = 0
    for i in keep:
        col = t.columns[i]
        total += _cell_width(t, i) if col.whole else _text_min(t, i)
    # rich's default box: one border left, then padding 1 + cell + padding 1 + border per column.
    return total + 1 + 3 * len(keep)


__all__ = ["Column", "FitTable", "NAME_MIN_WIDTH", "TEXT_MIN_WIDTH", "break_words", "word_pieces"]
