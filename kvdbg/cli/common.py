"""Shared CLI plumbing: one console, one error path (exit 2), JSON output, finding exits."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import click

from kvdbg.errors import KvdbgError
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
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "120"))
    return Console(stderr=stderr, width=width, highlight=False, markup=False, emoji=False)


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
    if hasattr(value, "to_json_dict"):
        return _finite(value.to_json_dict())
    return value


def _json_default(value: Any):
    if hasattr(value, "to_json_dict"):
        return value.to_json_dict()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, float):
        return None
    return str(value)


def finish(findings: int) -> None:
    """Exit 1 when there are findings, else return normally (exit 0)."""
    if findings:
        sys.exit(EXIT_FINDING)


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
