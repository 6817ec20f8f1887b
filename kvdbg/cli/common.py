"""Shared CLI plumbing: one console, one error path (exit 2), JSON output, finding exits, and the
option vocabulary every subcommand draws from (README.md, "Options", is its table)."""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Any, Callable

import click

from kvdbg.errors import KvdbgError, OptionError
from kvdbg.util.ranges import IntRanges, IntRangesParam
from kvdbg.judge.verdict import simple_verdict  # noqa: F401  (re-exported for the commands)
from kvdbg.judge.verdict import EXIT_BAD_INPUT, EXIT_FINDING, EXIT_OK  # noqa: F401  (the one definition)


class BadInput(click.ClickException):
    """A user-facing error printed on one line; exit code 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file=None) -> None:
        from kvdbg.render.util import printable

        click.echo(f"Error: {printable(self.format_message())}", err=True)


def guarded(fn: Callable) -> Callable:
    """Turn kvdbg's own errors (and a few OS ones) into one-line exit-2 errors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from kvdbg.util.atomic import inputs_protected

        try:
            with inputs_protected(_input_paths()):
                return fn(*args, **kwargs)
        except KvdbgError as exc:
            raise BadInput(str(exc)) from None
        except MemoryError:
            raise BadInput("out of memory while reading the input; is the snapshot consistent?") from None

    return wrapper


def _input_paths() -> list[str]:
    """The running command's positional arguments that are paths: its inputs (every output is an option, but
    a positional one kept for old scripts, marked :class:`HiddenOutputArgument`)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return []
    paths = []
    for param in ctx.command.params:
        if isinstance(param, click.Argument) and not getattr(param, "output", False):
            value = ctx.params.get(param.name)
            values = value if isinstance(value, (tuple, list)) else (value,)
            paths.extend(v for v in values if isinstance(v, (str, os.PathLike)))
    return paths


def console(*, stderr: bool = False):
    from rich.console import Console

    # rich honours NO_COLOR and non-terminal output by itself. Cells hold the user's data
    # (layer names, paths, notes), printed as given: no markup ("[x]" would vanish) and no
    # emoji codes (":x:" would change), which also spares parsing every cell and loading
    # rich's emoji table.
    from kvdbg.render.util import show_controls

    out = Console(stderr=stderr, width=output_width(), highlight=False, markup=False, emoji=False)
    show_controls(out)  # a snapshot's names are shown, never acted on by the terminal
    return out


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
    """The last line of every table command: the verdict and the exit code it gives.

    Wrapped here at the console's width so that "(exit N)" always ends the last line whole, with the word before
    it: a script (or a reader) finds the exit code at the end, however long the verdict.
    """
    import textwrap

    from rich.text import Text

    from kvdbg.render.util import verdict_line

    line = verdict_line(verdict)
    tail = f" (exit {verdict.exit_code})"
    plain = line.plain
    if plain.endswith(tail):
        plain = plain[:-len(tail)] + tail.replace(" ", "\u00a0")  # no break inside the tail, nor before it
    lines = textwrap.wrap(plain, width=max(20, out.width), break_on_hyphens=False) or [""]
    out.print(Text("\n".join(lines).replace("\u00a0", " "), style=line.style), soft_wrap=True)


def finish(findings: int) -> None:
    """Exit 1 when there are findings, else return normally (exit 0)."""
    if findings:
        sys.exit(EXIT_FINDING)


def backend_name(name: str, option: str = "--backend") -> str:
    """The kvdbg backend ``name`` means (kvdbg.backends.resolve_backend: names, engine names, aliases)."""
    from kvdbg.backends import resolve_backend  # the one list of backends (no heavy import)

    return resolve_backend(name, option)




# ============================================================================ the option vocabulary
#
# One factory per option that more than one command takes, so that an option means the same
# thing wherever it appears; README.md's "Options" table lists them with their commands. Rules:
#
# - Selectors are singular and take index ranges in kvdbg.util.ranges' grammar: --step, --request,
#   --head ("0-3,7", "2-"); `within` turns them into the indices below a count.
#   A command that acts on one value only (map --step, window --request) says so in its help and
#   refuses a range with a one-line error (exit 2).
# - --backend is repeatable (or comma-separated) everywhere; shrink keeps one backend's failure,
#   so it takes one.
# - The file a command writes is -o/--output; --force lets it replace an existing file.
# - --device is cpu, cuda, cuda:N or auto everywhere.
# - Old spellings users may have in scripts keep working, hidden from --help (AliasedOption).
#
# A new command takes these factories instead of declaring its own @click.option for them.


class AliasedOption(click.Option):
    """An option with spellings kept for old scripts: they parse, but --help and errors show the others."""

    def __init__(self, *args, hidden_aliases: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden_aliases = frozenset(hidden_aliases)

    def _shown(self) -> list[str]:
        return [o for o in self.opts if o not in self.hidden_aliases]

    def get_help_record(self, ctx):
        opts = self.opts
        self.opts = self._shown()
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = opts

    def get_error_hint(self, ctx) -> str:
        return " / ".join(f"'{o}'" for o in self._shown())


class HiddenArgument(click.Argument):
    """A positional argument kept for old scripts and left out of the usage line."""

    def get_usage_pieces(self, ctx) -> list[str]:
        return []


class HiddenOutputArgument(HiddenArgument):
    """A hidden positional argument that names an output (``kvdbg synth OUT``): not one of the command's inputs."""

    output = True


# ----------------------------------------------------------------------------- index ranges

class Indices(IntRangesParam):
    """Indices in kvdbg.util.ranges' grammar (``0-3,7``, ``2-``) → an IntRanges; with ``one``, one index → an int.

    ``one`` names what the command takes one of, for the error when given more
    (``"map shows one step"``). The parsing itself is kvdbg.util.ranges', the one range grammar.
    """

    def __init__(self, one: str | None = None):
        super().__init__(open_ended=one is None)
        self.one = one

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        ranges = super().convert(value, param, ctx)
        if self.one is None:
            return ranges
        if ranges.first is None or ranges.first != ranges.last:
            raise BadInput(f"{param.opts[0] if param else 'value'} {value}: {self.one} "
                           "(give one index, not a range)")
        return ranges.first


def within(ranges: IntRanges | None, count: int, option: str, has: str) -> list[int] | None:
    """The members of an option's ranges below ``count`` (None: all); an OptionError naming one past it."""
    if ranges is None:
        return None
    beyond = ranges.out_of(count)
    if beyond is not None:
        raise OptionError(f"{option} {beyond} is out of range: {has}")
    return ranges.below(count)


def _selector_help(noun: str, example: str, one: str | None, default_help: str, extra: str) -> str:
    if one is None:
        text = f"{noun.capitalize()}s, e.g. {example} [default: {default_help}]."
    else:
        text = f"The {noun}; {one} [default: {default_help}]."
    return f"{text} {extra}".strip()


def step_option(*, one: str | None = None, default_help: str = "all", extra: str = ""):
    """--step: decode steps of the snapshot, by index.

    ``one`` (what the command takes one of, e.g. ``"map shows one step"``) makes it a single
    index; a range is then refused.
    """
    return click.option("--step", "step", type=Indices(one), default=None, metavar="N" if one else "RANGES",
                        help=_selector_help("step", "0 or 1-3", one, default_help, extra))


def request_option(*, one: str | None = None, default_help: str = "all", extra: str = ""):
    """--request: requests of a step, by their index in the batch (``one`` as for --step)."""
    return click.option("--request", "request", type=Indices(one), default=None, metavar="N" if one else "RANGES",
                        help=_selector_help("request", "0-3,7", one, default_help, extra))


def head_option(*, extra: str = ""):
    """--head: query heads, by index (the hidden --heads is the old spelling)."""
    return click.option("--head", "--heads", "head", cls=AliasedOption, hidden_aliases=("--heads",),
                        type=Indices(), default=None, metavar="RANGES",
                        help=f"Query heads, e.g. 0-3,7 [default: all]. {extra}".strip())


# ----------------------------------------------------------------------------- backends, device

BACKEND_HELP = ("reference, flex, flashinfer_ts, vllm (the installed vLLM's own code for the snapshot's backend), "
                "vllm_flex (vLLM's FLEX_ATTENTION); any case, or the engine's name (FLEX_ATTENTION, FLASHINFER_TS)")


def _backend_list(ctx, param, values) -> tuple[str, ...]:
    names: list[str] = []
    for value in values or ():
        for part in str(value).split(","):
            if part.strip():
                try:
                    names.append(backend_name(part, "--backend"))
                except KvdbgError as exc:
                    raise BadInput(str(exc)) from None
    return tuple(dict.fromkeys(names))


def backend_option(*, one: str | None = None, default_help: str = "all"):
    """--backend: backends by kvdbg's or the engine's name; repeatable, or comma-separated.

    With ``one`` (what the command keeps one of), the value is one name or None, and a
    second backend is refused.
    """
    if one is None:
        def callback(ctx, param, values):
            return _backend_list(ctx, param, values)

        text = f"Backends (repeatable, or comma-separated): {BACKEND_HELP} [default: {default_help}]."
    else:
        def callback(ctx, param, values):
            names = _backend_list(ctx, param, values)
            if len(names) > 1:
                raise BadInput(f"--backend {','.join(names)}: {one} (give one backend)")
            return names[0] if names else None

        text = f"The backend ({one}): {BACKEND_HELP} [default: {default_help}]."
    return click.option("--backend", "backend", multiple=True, callback=callback, metavar="NAME", help=text)


_DEVICE = re.compile(r"cpu|cuda|cuda:\d+|auto")


class Device(click.ParamType):
    """cpu, cuda, cuda:N or auto (cuda when one is visible, else cpu); checked against torch at replay."""

    name = "device"

    def convert(self, value, param, ctx):
        text = str(value).strip().lower()
        if not _DEVICE.fullmatch(text):
            raise BadInput(f"--device must be cpu, cuda, cuda:N or auto, got {value!r}")
        return text


def device_option(extra: str = ""):
    """--device: where to replay."""
    return click.option("--device", type=Device(), default="cpu", metavar="DEVICE",
                        help=f"cpu, cuda, cuda:N, or auto (cuda when one is visible) [default: cpu]. {extra}".strip())


def tolerance_options(of: str = ""):
    """--atol and --rtol: replay's pass rule |a - e| <= atol + rtol·|e|; finite and >= 0, default by dtype."""
    def decorate(fn):
        fn = click.option("--rtol", type=FINITE_FLOAT, default=None,
                          help=f"Relative tolerance{of}, finite and >= 0 [default: by dtype].")(fn)
        return click.option("--atol", type=FINITE_FLOAT, default=None,
                            help=f"Absolute tolerance{of}, finite and >= 0 [default: by dtype].")(fn)

    return decorate


# ----------------------------------------------------------------------------- files and output

def output_option(help: str, *, required: bool = False, hidden_aliases: tuple[str, ...] = ()):
    """-o/--output: the file the command writes (written atomically; see --force).

    No ``default`` is passed: click (8.3 on) counts an explicit ``default=None`` as a value given, so
    ``required`` would never fire and the command would run with no output path. Left out, the value is
    None when the option is absent, and a required one is click's one-line usage error (exit 2).
    """
    return click.option("-o", "--output", *hidden_aliases, "output", cls=AliasedOption,
                        hidden_aliases=hidden_aliases, required=required,
                        type=click.Path(dir_okay=False), metavar="FILE", help=help)


def force_option():
    """--force: let the command replace files it writes that already exist."""
    return click.option("--force", is_flag=True, help="Replace output files that already exist.")


def full_option(help: str = "Show everything: no elided rows or lists."):
    return click.option("--full", is_flag=True, help=help)


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")


def default_snapshot() -> str:
    """The bundled dflash fixture, the snapshot of `replay` and `poison` when none is given."""
    try:
        from kvdbg.util.fixtures_path import default_fixture
    except ImportError:
        from importlib import resources

        path = os.fspath(resources.files("kvdbg.fixtures") / "dflash.safetensors")
        if not os.path.isfile(path):
            raise OptionError("no SNAPSHOT given and the bundled fixture dflash.safetensors is missing") from None
        return path
    return default_fixture()


def progress_printer(verb: str = "", *, ongoing: bool = True) -> Callable[[str], None] | None:
    """What long commands report while they work: dim lines on stderr, only when stderr is a terminal.

    Each message is prefixed with ``verb``; ``ongoing`` messages (work starting) end in "…",
    the others (work done, as shrink reports) do not. None when there is no terminal to show them.
    """
    if not sys.stderr.isatty():
        return None
    err = console(stderr=True)
    prefix = f"{verb} " if verb else ""
    suffix = "…" if ongoing else ""

    def progress(message: str) -> None:
        err.print(f"{prefix}{message}{suffix}", style="dim")

    return progress


# ----------------------------------------------------------------------------- picture files

def picture_file_options(what: str):
    """--svg FILE and --png FILE: a picture written atomically (PNG through matplotlib, the plot extra)."""
    def decorate(fn):
        fn = click.option("--png", "png_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
                          help=f"Write {what} as PNG to this file (atomically; needs the plot extra: "
                               "pip install 'kvdbg[plot]').")(fn)
        return click.option("--svg", "svg_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
                            help=f"Write {what} as SVG to this file (atomically; self-contained).")(fn)

    return decorate


def check_picture_paths(svg_path: str | None, png_path: str | None, *, force: bool) -> None:
    """Refuse, before any work, a picture file that exists (without --force), or PNG without matplotlib."""
    from kvdbg.util.atomic import check_distinct_outputs, check_output

    check_distinct_outputs((("--svg", svg_path or None), ("--png", png_path or None)))
    for option, path in (("--svg", svg_path), ("--png", png_path)):
        if path:
            check_output(path, overwrite=force, what=option)
    if png_path:
        from kvdbg.render.canvas import require_raster

        require_raster("--png")


def write_pictures(make_drawing: Callable[[], Any], svg_path: str | None, png_path: str | None, *,
                   force: bool) -> list[str]:
    """Write the drawing ``make_drawing()`` returns as SVG and/or PNG, atomically; the paths written."""
    if not svg_path and not png_path:
        return []
    check_picture_paths(svg_path, png_path, force=force)
    from kvdbg.util.atomic import atomic_write, write_text_atomic
    from kvdbg.render.canvas import png_bytes, svg_text

    drawing = make_drawing()
    data = png_bytes(drawing, what="--png") if png_path else None  # before any file: a missing extra writes none
    written = []
    if svg_path:
        write_text_atomic(svg_path, svg_text(drawing), overwrite=force, what="--svg")
        written.append(svg_path)
    if png_path:
        atomic_write(png_path, lambda fh: fh.write(data), overwrite=force, what="--png")
        written.append(png_path)
    return written
