"""`kvdbg sweep SNAP --vary KNOB[,KNOB]`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (FINITE_FLOAT, backend_name, console, emit_json, guarded, json_option,
                              print_verdict)


@click.command()
@click.argument("snapshot", required=False, type=click.Path(dir_okay=False))
@click.option("--vary", "vary", multiple=True, metavar="KNOB[,KNOB]",
              help="Knobs to vary, one at a time (repeatable, comma-separated): placement, kv-dtype, scales, "
                   "window, query-len, flex-block, compile, device, or all. Default: all.")
@click.option("--backend", "backends", multiple=True,
              help="Backend column (repeatable), as for replay; the reference is always replayed. Default: all.")
@click.option("--step", type=int, default=None, help="Only this step (earlier steps' cache updates still apply).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
              help="The baseline's device (the device knob tries the other one).")
@click.option("--atol", type=FINITE_FLOAT, default=None, help="Absolute tolerance (default by dtype, as replay).")
@click.option("--rtol", type=FINITE_FLOAT, default=None, help="Relative tolerance (default by dtype, as replay).")
@json_option
@guarded
def sweep(snapshot, vary, backends, step, device, atol, rtol, as_json):
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

    Exit 0 when the baseline passes and every variant agrees with it; 1 when
    a counted cell fails (the baseline's or a variant's); 2 on bad input; 3
    when no counted backend or captured output was compared.

    \b
    Examples:
      kvdbg sweep fixtures/prefix_page0.safetensors --vary placement
      kvdbg sweep snapshot.safetensors --vary kv-dtype,window --backend flashinfer_ts --json
    """
    from kvdbg.attention import ReplayOptions
    from kvdbg.cli.replay import default_snapshot
    from kvdbg.snapshot import load_snapshot
    from kvdbg.sweep import parse_knobs, sweep as run_sweep, sweep_verdict

    knobs = parse_knobs(list(vary) if vary else None)
    backends = list(dict.fromkeys(backend_name(b) for b in backends))
    snap = load_snapshot(snapshot or default_snapshot())
    progress = None
    if sys.stderr.isatty() and not as_json:
        err = console(stderr=True)

        def progress(message: str) -> None:
            err.print(f"sweeping {message}…", style="dim")

    result = run_sweep(snap, knobs, backends or None, ReplayOptions(device=device),
                       steps=None if step is None else [step], required=backends, atol=atol, rtol=rtol,
                       progress=progress)
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
