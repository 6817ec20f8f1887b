"""Sets and lists of non-negative integers written as text: one grammar for CLI options and capture variables.

The grammar, for ``--request``, ``--head``, ``--step``, ``KVDBG_CAPTURE_STEPS``,
``KVDBG_CAPTURE_RANKS`` and the integer lists of ``kvdbg synth``::

    text  := item ("," item)*          whitespace around items and around "-" is ignored
    item  := N                         one number                     3
           | N "-" M                   inclusive range, M >= N        2-5
           | N "-"                     open-ended (only where the     100-
                                       caller allows it)
    N, M  := ASCII digits, at most ``max_value``

So ``3``, ``1,4``, ``2-5``, ``0, 4, 10 - 20, 100-``. Empty text, empty items
(``1,,2``), negative numbers, reversed ranges and numbers over ``max_value``
are refused with one line naming the option or variable.

A set (:class:`IntRanges`) is kept as its ranges, never expanded: ``0-10**18``
costs one pair of numbers. Callers that need the members list only those below
a bound they know (:meth:`IntRanges.below`), after :meth:`IntRanges.out_of` has
named any number past it. A list (:func:`parse_int_list`) keeps order and
repeats and takes single numbers only, so it is as long as the text.

No torch here: ``kvdbg --help`` and the vLLM plugin's configuration import this.
"""

from __future__ import annotations

import bisect
import operator
import re
from dataclasses import dataclass
from typing import Iterable

import click

from kvdbg.errors import OptionError

__all__ = [
    "MAX_VALUE",
    "IntListParam",
    "IntRanges",
    "IntRangesParam",
    "RangeError",
    "parse_int_list",
    "parse_ranges",
    "ranges_text",
]

# The largest number the grammar reads (an int64 index); longer digit strings are refused before
# int() sees them, so a hostile option cannot make the conversion itself slow.
MAX_VALUE = 2**63 - 1

_ITEM = re.compile(r"([0-9]+)(?:\s*(-)\s*([0-9]*))?")
_SHOWN = 40  # characters of a bad item quoted in a message


class RangeError(OptionError):
    """Text that the grammar refuses; ``detail`` is the message without the option's name."""

    def __init__(self, what: str, detail: str):
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.detail = detail


def _shown(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…")


def _number(digits: str, item: str, what: str, max_value: int) -> int:
    if len(digits) > len(str(max_value)) or int(digits) > max_value:
        raise RangeError(what, f"{_shown(item)} is over the largest number allowed here, {max_value}")
    return int(digits)


def _items(text: str, what: str, *, open_ended: bool, max_value: int) -> list[tuple[int, int | None]]:
    """The items of ``text`` in order, as inclusive (lo, hi) pairs; hi None is open-ended."""
    example = "3, 1,4 or 2-5" + (" or 100-" if open_ended else "")
    if not isinstance(text, str):
        raise RangeError(what, f"expected text like {example}, got {type(text).__name__}")
    if not text.strip():
        raise RangeError(what, f"is empty; give numbers or ranges like {example}")
    items: list[tuple[int, int | None]] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise RangeError(what, f"{_shown(text)} has an empty item between commas")
        match = _ITEM.fullmatch(part)
        if match is None:
            if part.startswith("-"):
                raise RangeError(what, f"{_shown(part)} is negative; numbers here start at 0")
            raise RangeError(what, f"{_shown(part)} is not a number or a range like {example}")
        lo = _number(match.group(1), part, what, max_value)
        hi: int | None = lo
        if match.group(2):
            if not match.group(3):
                if not open_ended:
                    raise RangeError(what, f"{_shown(part)} is open-ended; give its end too, e.g. {lo}-{lo + 10}")
                hi = None
            else:
                hi = _number(match.group(3), part, what, max_value)
                if hi < lo:
                    raise RangeError(what, f"range {_shown(part)} ends before it starts")
        items.append((lo, hi))
    return items


@dataclass(frozen=True)
class IntRanges:
    """A set of non-negative integers held as sorted, disjoint, inclusive ranges (``hi`` None: no end).

    Build one with :func:`parse_ranges` (text) or :meth:`of` (Python values);
    ``IntRanges(())`` is the empty set.
    """

    spans: tuple[tuple[int, int | None], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", _merged(self.spans))
        object.__setattr__(self, "_starts", [lo for lo, _ in self.spans])

    @classmethod
    def of(cls, value: "IntRanges | str | int | range | Iterable[int] | None", what: str) -> "IntRanges | None":
        """None (no filter), text in the grammar, an int, a ``range`` of step 1, or an iterable of ints."""
        if value is None or isinstance(value, IntRanges):
            return value
        if isinstance(value, str):
            return parse_ranges(value, what)
        if isinstance(value, bool):
            raise RangeError(what, f"expected numbers, got {value!r}")
        if isinstance(value, int):
            return cls(((_checked(value, what), value),))
        if isinstance(value, range) and value.step == 1:
            return cls(((_checked(value.start, what), value.stop - 1),)) if len(value) else cls(())
        return cls(tuple((_checked(v, what), int(v)) for v in value))

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool):
            return False
        try:
            value = operator.index(value)  # numpy's and torch's integers too
        except TypeError:
            return False
        i = bisect.bisect_right(self._starts, value) - 1  # the last range starting at or before value
        if i < 0:
            return False
        hi = self.spans[i][1]
        return hi is None or value <= hi

    def meets(self, lo: int, hi: int) -> bool:
        """Whether a member lies from ``lo`` to ``hi``, both included (one search, whatever the spans)."""
        i = bisect.bisect_right(self._starts, hi) - 1  # the last range starting at or before hi
        if i < 0 or hi < lo:
            return False
        end = self.spans[i][1]
        return end is None or end >= lo

    @property
    def empty(self) -> bool:
        return not self.spans

    @property
    def first(self) -> int | None:
        """The smallest member (None for the empty set)."""
        return self.spans[0][0] if self.spans else None

    @property
    def last(self) -> int | None:
        """The largest member (None for the empty set or an open-ended one)."""
        return self.spans[-1][1] if self.spans else None

    @property
    def open_ended(self) -> bool:
        return bool(self.spans) and self.spans[-1][1] is None

    def out_of(self, count: int) -> int | None:
        """A number the text named that is not below ``count`` (the largest end, or an open start), else None."""
        if not self.spans:
            return None
        lo, hi = self.spans[-1]
        beyond = lo if hi is None else hi
        return beyond if beyond >= count else None

    def below(self, stop: int) -> list[int]:
        """The members smaller than ``stop``, in order: as long as ``stop`` at most, whatever the ranges say."""
        out: list[int] = []
        for lo, hi in self.spans:
            if lo >= stop:
                break
            out.extend(range(lo, stop if hi is None else min(hi + 1, stop)))
        return out

    def __str__(self) -> str:
        return ",".join(str(lo) if lo == hi else f"{lo}-{'' if hi is None else hi}" for lo, hi in self.spans)


def _checked(value, what: str) -> int:
    number = int(value)
    if number < 0:
        raise RangeError(what, f"{number} is negative; numbers here start at 0")
    return number


def _merged(spans) -> tuple[tuple[int, int | None], ...]:
    out: list[list] = []
    for lo, hi in sorted(spans, key=lambda s: s[0]):
        if out and (out[-1][1] is None or lo <= out[-1][1] + 1):
            if out[-1][1] is not None and (hi is None or hi > out[-1][1]):
                out[-1][1] = hi
            continue
        out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def ranges_text(numbers) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``0-3, 7`` (sorted, each number once)."""
    numbers = sorted(set(numbers))
    parts: list[str] = []
    start = prev = None
    for n in numbers + [None]:
        if start is not None and (n is None or n != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if n is not None and start is None:
            start = n
        prev = n
    return ", ".join(parts)


def parse_ranges(text: str, what: str, *, open_ended: bool = True, max_value: int = MAX_VALUE) -> IntRanges:
    """The set ``text`` names, e.g. ``"0-3, 7, 100-"``; RangeError (an OptionError) naming ``what`` otherwise."""
    return IntRanges(tuple(_items(text, what, open_ended=open_ended, max_value=max_value)))


def parse_int_list(text: str, what: str, *, max_value: int = MAX_VALUE) -> tuple[int, ...]:
    """The numbers of ``text`` in order, repeats kept, e.g. ``"9, 77, 200"``; ranges are refused here."""
    items = _items(text, what, open_ended=False, max_value=max_value)
    for lo, hi in items:
        if hi != lo:
            raise RangeError(what, f"'{lo}-{hi}' is a range; list single numbers here, e.g. 9,77,200")
    return tuple(lo for lo, _ in items)


class IntRangesParam(click.ParamType):
    """A click option holding an :class:`IntRanges` in the grammar above (``--request 0-3,7``)."""

    name = "ranges"

    def __init__(self, *, open_ended: bool = True, max_value: int = MAX_VALUE):
        self.open_ended = open_ended
        self.max_value = max_value

    def convert(self, value, param, ctx):
        if isinstance(value, IntRanges):
            return value
        what = param.get_error_hint(ctx) if param is not None else "value"
        try:
            return parse_ranges(value, what, open_ended=self.open_ended, max_value=self.max_value)
        except RangeError as exc:
            self.fail(exc.detail, param, ctx)


class IntListParam(click.ParamType):
    """A click option holding a tuple of numbers in order (``--seq-len 9,77,200``); no ranges."""

    name = "list"

    def __init__(self, *, max_value: int = MAX_VALUE):
        self.max_value = max_value

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        what = param.get_error_hint(ctx) if param is not None else "value"
        try:
            return parse_int_list(value, what, max_value=self.max_value)
        except RangeError as exc:
            self.fail(exc.detail, param, ctx)
