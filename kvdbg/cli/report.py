"""`kvdbg report SNAP`."""

from __future__ import annotations

import os
import sys

import click

from kvdbg.cli.common import backend_option, device_option, force_option, guarded, output_option, progress_printer
from kvdbg.errors import OptionError


@click.command()
@click.argument("snapshot", type=click.Path(dir_okay=False))
@output_option("Write the Markdown here instead of to stdout.")
@backend_option()
@device_option()
@click.option("--svg", "svg_dir", default=None, type=click.Path(file_okay=False),
              help="Also write the info, map and replay tables as self-contained SVG images into this directory "
                   "(and PNGs beside them where rsvg-convert is installed).")
@force_option()
@click.option("--sweep", "sweep_knobs", default=None, metavar="KNOB[,KNOB]",
              help="Also sweep these knobs (as `kvdbg sweep --vary`) and include the matrix.")
@guarded
def report(snapshot, output, backend, device, svg_dir, force, sweep_knobs):
    """Write a Markdown bug report for a snapshot, ready to paste into a GitHub issue.

    Sections: the environment (OS, Python, torch and its CUDA build, GPUs,
    flashinfer and vllm versions, read from package metadata without importing
    them), the snapshot's sha256 and summary, paging anomalies and the
    FLASHINFER_TS window restriction, the replay per backend (what ran,
    pass/fail, worst heads, findings), and the command that reproduces it.

    Exit 0 when the replay is clean, 1 on a mismatch or an error finding, 2 on bad input.

    \b
    Examples:
      kvdbg report snapshot.safetensors > report.md
      kvdbg report snapshot.safetensors -o report.md --svg figures/ --backend flex
      kvdbg report snapshot.safetensors --sweep placement,window > report.md
    """
    from kvdbg.render.report import render_markdown, render_svgs
    from kvdbg.report import build_report, write_text_atomic

    backends = backend
    knobs = None
    if sweep_knobs is not None:
        from kvdbg.sweeper import parse_knobs

        knobs = parse_knobs(sweep_knobs)
    svg_paths = []
    if svg_dir is not None:
        if os.path.exists(svg_dir) and not os.path.isdir(svg_dir):
            raise OptionError(f"--svg {svg_dir} is not a directory")
        svg_paths = [os.path.join(svg_dir, f"{stem}.svg") for stem in ("info", "map", "replay")]
        taken = [p for p in svg_paths if os.path.exists(p)]
        if taken and not force:
            raise OptionError(f"{taken[0]} already exists; pass --force to replace it")
    if output is not None and os.path.exists(output) and not force:
        raise OptionError(f"{output} already exists; pass --force to replace it")
    progress = progress_printer()
    result = build_report(snapshot, list(backends) or None, device=device, progress=progress)
    if knobs is not None:
        from kvdbg.backend_api import ReplayOptions
        from kvdbg.snapshot import load_snapshot
        from kvdbg.sweeper import sweep, sweep_verdict

        swept = sweep(load_snapshot(snapshot), knobs, list(backends) or None, ReplayOptions(device=device),
                      required=list(backends), progress=progress)
        result.sweep = (swept, sweep_verdict(swept))
    text = render_markdown(result)
    if svg_dir is not None:
        os.makedirs(svg_dir, exist_ok=True)
        for path, (stem, svg) in zip(svg_paths, render_svgs(result).items()):
            write_text_atomic(path, svg, overwrite=force)
        _pngs(svg_paths, force)
    if output is None:
        click.echo(text, nl=False)
    else:
        write_text_atomic(output, text, overwrite=force)
    verdict = result.verdict
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def _pngs(svg_paths: list[str], force: bool) -> None:
    """A PNG beside each SVG where rsvg-convert is installed; without it, the SVGs alone."""
    import shutil
    import subprocess

    converter = shutil.which("rsvg-convert")
    if converter is None:
        return
    for svg in svg_paths:
        png = svg[:-len(".svg")] + ".png"
        if os.path.exists(png) and not force:
            continue
        subprocess.run([converter, "-o", png, svg], check=False, capture_output=True, timeout=60)
