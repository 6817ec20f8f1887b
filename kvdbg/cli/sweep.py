"""`kvdbg sweep SNAP --vary KNOB[,KNOB]`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (backend_option, console, default_snapshot, device_option, emit_json, guarded,
                              json_option, print_verdict, progress_printer, step_option, tolerance_options, within)


@click.command()
@click.argument("snapshot", required=False, type=click.Path(dir_okay=False))
@click.option("--vary", "vary", multiple=True, metavar="KNOB[,KNOB]",
              help="Knobs to vary, one at a time (repeatable, comma-separated): placement, kv-dtype, scales, "
                   "window, query-len, flex-block, compile, device, or all. Default: all.")
@backend_option()
@step_option(extra="Earlier steps' cache updates still apply.")
@device_option("The baseline's device; the device knob tries the other one.")
@tolerance_options()
@json_option
@guarded
def sweep(snapshot, vary, backend, step, device, atol, rtol, as_json):
    """Replay a snapshot with one knob changed at a time: which knob flips which backend's verdict.

    Rows are variants (the snapshot as captured first), columns the backends
    (as replay names them) plus the engine's captured output; a cell is
    pass/FAIL with the max abs error. A cell marked ▶ flips the baseline's
    verdict. Knobs that keep the exact answer (placement, flex-block,
    compile, device, query-len) are also held against the engine's output and
    the baseline's reference; knobs that change it (kv-dtype, scales, window)
    compare the backends with the variant's own reference only, and the
    reference column shows by how much the exact answer moved (Δ).

    Placement renames stored pages (reversed, rotated; page 0, vLLM's null
    block, kept) and, as a third row, moves page 0 itself to a free id.

    The verdict and exit code are the snapshot's own (the baseline, by
    kvdbg's one rule: what `kvdbg replay` says); the variants are what-ifs,
    named after it (which knob flips which cell) and never counted. Exit 0
    pass; 1 fail; 2 bad input; 3 nothing verified.

    \b
    Examples:
      kvdbg sweep fixtures/prefix_page0.safetensors --vary placement
      kvdbg sweep snapshot.safetensors --vary kv-dtype,window \\
        --backend flashinfer_ts --json
    """
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.snapshot.store import load_snapshot
    from kvdbg.moves.sweeper import parse_knobs, sweep as run_sweep, sweep_verdict

    knobs = parse_knobs(list(vary) if vary else None)
    backends = list(backend)
    snap = load_snapshot(snapshot or default_snapshot())
    steps = within(step, len(snap.steps), "--step", f"the snapshot has {len(snap.steps)} step(s)")
    result = run_sweep(snap, knobs, backends or None, ReplayOptions(device=device), steps=steps, required=backends,
                       atol=atol, rtol=rtol, progress=progress_printer("sweeping"))
    verdict = sweep_verdict(result)
    if as_json:
        emit_json({**result.to_json(), "verdict": verdict.to_json()})
    else:
        from kvdbg.render.sweep import render_sweep

        out = console()
        out.print(render_sweep(result))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)
