"""`kvdbg shrink SNAP -o OUT`."""

from __future__ import annotations

import click

from kvdbg.cli.common import (backend_option, console, device_option, emit_json, force_option, guarded, json_option,
                              output_option, print_verdict, progress_printer, simple_verdict)
from kvdbg.errors import OptionError


@click.command()
@click.argument("snapshot", type=click.Path(dir_okay=False))
@output_option("Where to write the reduced snapshot.", required=True)
@backend_option(one="shrink keeps one backend's failure", default_help="the first that fails")
@device_option()
@click.option("--same-heads/--any-heads", default=True, show_default=True,
              help="Keep every failing head of the kept requests (default), or let the head pass drop "
                   "failing heads too for a smaller file.")
@force_option()
@json_option
@guarded
def shrink(snapshot, output, backend, device, same_heads, force, as_json):
    """Reduce a failing snapshot while the same backend keeps failing on the same heads.

    The failure kept is the chosen backend's failing (request, head) pairs
    against the exact reference, and its error findings, at the last step
    where it fails: in the output every kept failing head still fails, the
    same error findings (and no other) appear, and no request that passed
    fails (a failing request's other heads may join it). Steps, requests, KV heads (with their query heads) and
    whole pages before each query block are removed delta-debugging style;
    every candidate is verified by replaying it through the reference and that
    backend. A snapshot that does not fail is refused (exit 2).

    \b
    Examples:
      kvdbg shrink big.safetensors -o small.safetensors
      kvdbg shrink big.safetensors -o small.safetensors --backend flex --json
    """
    import os

    from kvdbg.shrink import shrink as run_shrink
    from kvdbg.snapshot import load_snapshot
    from kvdbg.verdict import EXIT_OK

    if os.path.exists(output) and os.path.exists(snapshot) and os.path.samefile(output, snapshot):
        raise OptionError(f"-o {output} is the input snapshot itself; shrink never overwrites its input "
                          "(--force or not): choose another output path")
    result = run_shrink(load_snapshot(snapshot), backend, device=device, progress=progress_printer(ongoing=False),
                        output_path=output, same_heads=same_heads, overwrite=force)
    kept = len(result.failing_heads_after)
    verdict = simple_verdict("pass", EXIT_OK, f"DONE: {result.backend} still fails on {kept} (request, head) "
                                              f"pair(s) in {result.output_path or 'the output'}")
    if as_json:
        emit_json({**result.to_json(), "verdict": verdict.to_json()})
    else:
        from kvdbg.render.shrink import render_shrink

        out = console()
        out.print(render_shrink(result))
        print_verdict(out, verdict)
