"""`kvdbg report SNAP`."""

from __future__ import annotations

import os
import sys

import click

from kvdbg.cli.common import (AliasedOption, backend_option, console, device_option, force_option, guarded, output_option,
                              print_verdict, progress_printer)
from kvdbg.errors import OptionError


@click.command()
@click.argument("snapshot", type=click.Path(dir_okay=False))
@output_option("Write the Markdown here instead of to stdout.")
@backend_option()
@device_option()
@click.option("--svg-dir", "--svg", "svg_dir", cls=AliasedOption, hidden_aliases=("--svg",), metavar="DIR",
              default=None, type=click.Path(file_okay=False),
              help="Also write self-contained SVG images into this directory: the info, map and replay tables, "
                   "and the pictures (errors: which heads are wrong, over steps too; attention: where the worst "
                   "token's attention went; window); PNGs of the pictures beside them with the plot extra "
                   "(pip install 'kvdbg[plot]').")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write the whole report as one self-contained HTML file (no network, no web font): the "
                   "verdict, the pictures and the tables.")
@force_option()
@click.option("--vary", "--sweep", "sweep_knobs", cls=AliasedOption, hidden_aliases=("--sweep",), default=None,
              metavar="KNOB[,KNOB]", help="Also sweep these knobs (as `kvdbg sweep --vary`) and include the matrix.")
@guarded
def report(snapshot, output, backend, device, svg_dir, html_path, force, sweep_knobs):
    """Write a Markdown bug report for a snapshot, ready to paste into a GitHub issue.

    Sections: the environment (OS, Python, torch and its CUDA build, GPUs,
    flashinfer and vllm versions, read from package metadata without importing
    them), the snapshot's sha256 and summary, paging anomalies and the
    FLASHINFER_TS window restriction, the replay per backend (what ran,
    pass/fail, worst heads, findings), and the command that reproduces it.

    The Markdown ends on the verdict. With -o it goes to the file, and the
    terminal gets the files written and the verdict line, as every command
    ends.

    Exit 0 when the replay is clean, 1 on a mismatch or an error finding, 2 on bad input.

    \b
    Examples:
      kvdbg report snapshot.safetensors > report.md
      kvdbg report snapshot.safetensors -o report.md --svg-dir figures/
      kvdbg report snapshot.safetensors --vary placement,window > report.md
      kvdbg report snapshot.safetensors -o report.md --html report.html
    """
    from kvdbg.render.report import render_markdown, render_svgs
    from kvdbg.moves.report import build_report, write_text_atomic

    backends = backend
    knobs = None
    if sweep_knobs is not None:
        from kvdbg.moves.sweeper import parse_knobs

        knobs = parse_knobs(sweep_knobs, option="--vary")
    from kvdbg.util.atomic import check_distinct_outputs, check_output

    # Every file the report writes, told apart before any is written (the --svg directory's own files too).
    pictures = [] if svg_dir is None else [
        (f"--svg-dir ({stem}.{ext})", os.path.join(svg_dir, f"{stem}.{ext}"))
        for stem in ("info", "map", "replay", *PICTURES) for ext in ("svg", "png")]
    check_distinct_outputs([("-o", output), ("--html", html_path), *pictures])
    for option, path in (("-o", output), ("--html", html_path)):
        if path is not None:
            check_output(path, overwrite=force, what=option)  # an input of the command is refused, --force or not
    made = []
    if svg_dir is not None:
        if os.path.exists(svg_dir) and not os.path.isdir(svg_dir):
            raise OptionError(f"--svg-dir {svg_dir} is not a directory")
        # Every file --svg-dir may write; refused up front so that no work is lost to a name taken.
        taken = [p for stem in ("info", "map", "replay", *PICTURES) for ext in ("svg", "png")
                 if os.path.exists(p := os.path.join(svg_dir, f"{stem}.{ext}"))]
        if taken and not force:
            raise OptionError(f"{taken[0]} already exists; pass --force to replace it")
        made = _svg_directory(svg_dir)
    progress = progress_printer()
    try:
        result = build_report(snapshot, list(backends) or None, device=device, progress=progress)
    except BaseException:
        _remove_if_empty(made)  # a bad snapshot leaves no directory behind
        raise
    if knobs is not None:
        from kvdbg.backends.base import ReplayOptions
        from kvdbg.snapshot.store import load_snapshot
        from kvdbg.moves.sweeper import sweep, sweep_verdict

        swept = sweep(load_snapshot(snapshot), knobs, list(backends) or None, ReplayOptions(device=device),
                      required=list(backends), progress=progress)
        result.sweep = (swept, sweep_verdict(swept))
    text = render_markdown(result)
    if svg_dir is not None or html_path is not None:
        from kvdbg.moves.report import build_pictures

        result.pictures = build_pictures(result, progress=progress)
    if svg_dir is not None:
        for stem, svg in render_svgs(result).items():
            write_text_atomic(os.path.join(svg_dir, f"{stem}.svg"), svg, overwrite=force)
        _pictures(result, svg_dir, force)
    if html_path is not None:
        from kvdbg.render.html import render_html

        write_text_atomic(html_path, render_html(result), overwrite=force)
    verdict = result.verdict
    if output is None:
        click.echo(text, nl=False)  # the document ends on the verdict
    else:
        write_text_atomic(output, text, overwrite=force)
        out = console()
        written = [output] + ([html_path] if html_path is not None else []) + (
            [svg_dir] if svg_dir is not None else [])
        out.print(f"report written to {', '.join(written)}", style="dim")
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


PICTURES = ("errors", "attention", "window")


def _svg_directory(svg_dir: str) -> list[str]:
    """Create ``svg_dir`` (with its parents) and make sure a file can be written in it, before the replay, so
    that a directory that cannot be made costs no work; the directories this created, deepest first."""
    import tempfile

    made, path = [], os.path.abspath(svg_dir)
    while not os.path.exists(path):
        made.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(svg_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvdbg-probe-", dir=svg_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        _remove_if_empty(made)
        raise OptionError(f"--svg-dir {svg_dir}: cannot write the directory ({exc.strerror or exc})") from None
    return made


def _remove_if_empty(made: list[str]) -> None:
    """Remove the directories _svg_directory made, deepest first, while they are empty."""
    for directory in made:
        try:
            os.rmdir(directory)
        except OSError:
            return


def _pictures(result, svg_dir: str, force: bool) -> None:
    """The pictures as SVG, and as PNG with the plot extra (without it, one line on stderr says which extra)."""
    import importlib.util

    from kvdbg.util.atomic import atomic_write
    from kvdbg.render.attention import attention_drawing
    from kvdbg.render.canvas import PLOT_EXTRA, png_bytes, svg_text
    from kvdbg.render.drawing import layout
    from kvdbg.render.errormap import error_drawing
    from kvdbg.moves.report import write_text_atomic

    pictures = result.pictures
    drawings = {"errors": error_drawing(pictures.errors)}
    if pictures.attention is not None:
        drawings["attention"] = attention_drawing(pictures.attention)
    if pictures.window is not None:
        drawings["window"] = layout(pictures.window)
    raster = importlib.util.find_spec("matplotlib") is not None
    for stem, drawing in drawings.items():
        write_text_atomic(os.path.join(svg_dir, f"{stem}.svg"), svg_text(drawing), overwrite=force)
        if raster:
            data = png_bytes(drawing)
            atomic_write(os.path.join(svg_dir, f"{stem}.png"), lambda fh: fh.write(data), overwrite=force)
    if not raster:
        click.echo(f"report: SVG only; PNGs of the pictures need matplotlib: {PLOT_EXTRA}", err=True)
