"""Shared CLI plumbing: one console, one error path (exit 2), JSON output, finding exits."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import click

from kvdbg.errors import KvdbgError
from kvdbg.verdict import simple_verdict  # noqa: F401  (re-exported for the commands)
from kvdbg.verdict import EXIT_BAD_INPUT, EXIT_FINDING, EXIT_OK  # noqa: F401  (the one definition)


class BadInput(click.ClickException):
    """A user-facing error printed on one line; exit code 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", err=True)


def guarded(fn: Callable) -> Callable:
    """Turn kvdbg's own errors (and a few OS ones) into one-line exit-2 errors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvdbgError as exc:
            raise BadInput(str(exc)) from None
        except MemoryError:
            raise BadInput("out of memory while reading the input; is the snapshot consistent?") from None

    return wrapper


def console(*, stderr: bool = False):
    from rich.console import Console

    # rich honours NO_COLOR and non-terminal output by itself. Cells hold the user's data
    # (layer names, paths, notes), printed as given: no markup ("[x]" would vanish) and no
    # emoji codes (":x:" would change), which also spares parsing every cell and loading
    # rich's emoji table.
    return Console(stderr=stderr, width=output_width(), highlight=False, markup=False, emoji=False)


# Piped output (`| less`, a file, CI logs) has no terminal to measure: it is laid out for
# the narrowest common screen, so it reads whole wherever it is shown. COLUMNS overrides.
PIPED_WIDTH = 80
MIN_WIDTH = 40


def output_width() -> int | None:
    """COLUMNS when set; else the terminal's own width (None: rich measures it); else 80 for a pipe."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return max(MIN_WIDTH, int(columns))
    return None if sys.stdout.isatty() else PIPED_WIDTH


class FiniteFloat(click.ParamType):
    """A finite, non-negative number (a tolerance): inf, nan and 1e400 are refused, so JSON stays strict."""

    name = "number"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if number != number or number in (float("inf"), float("-inf")):
            self.fail(f"must be a finite number, got {value!r}", param, ctx)
        if number < 0:
            self.fail(f"must be a non-negative number, got {value!r}", param, ctx)
        return number


FINITE_FLOAT = FiniteFloat()


def emit_json(obj: Any) -> None:
    import json  # only --json needs it; `kvdbg window` otherwise never loads it

    # Strict JSON: a non-finite float (an error that is NaN, a tolerance of inf) becomes null.
    click.echo(json.dumps(_finite(obj), indent=2, default=_json_default, allow_nan=False))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "to_json"):
        return _finite(value.to_json())
    return value


def _json_default(value: Any):
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, float):
        return None
    return str(value)


def print_verdict(out, verdict) -> None:
    """The last line of every table command: the verdict and the exit code it gives."""
    from kvdbg.render.util import verdict_line

    out.print(verdict_line(verdict))


def finish(findings: int) -> None:
    """Exit 1 when there are findings, else return normally (exit 0)."""
    if findings:
        sys.exit(EXIT_FINDING)


# What users type for a backend: kvdbg's names, the engine's names the tables print beside them
# (FLEX_ATTENTION, FLASHINFER_TS), and the library's own name. Matched case-insensitively, - or _.
BACKEND_ALIASES = {"flex_attention": "flex", "flashinfer": "flashinfer_ts", "ref": "reference"}


def backend_name(name: str, option: str = "--backend") -> str:
    """The kvdbg backend ``name`` means; an unknown one lists the valid names and suggests the nearest."""
    import difflib

    from kvdbg.backends import backend_names  # the one list of backends (no heavy import)

    names = tuple(backend_names())
    key = name.strip().lower().replace("-", "_")
    if key in names:
        return key
    if key in BACKEND_ALIASES:
        return BACKEND_ALIASES[key]
    known = list(names) + list(BACKEND_ALIASES)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {BACKEND_ALIASES.get(close[0], close[0])}?" if close else ""
    from kvdbg.errors import OptionError

    raise OptionError(f"{option}: unknown backend {name!r}{hint} (choose from: {', '.join(names)}; "
                      "engine names FLEX_ATTENTION and FLASHINFER_TS work too)")


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
