"""`kvdbg shrink SNAP -o OUT`."""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from kvdbg.cli.common import (backend_option, console, device_option, emit_json, force_option, guarded, json_option,
                              output_option, print_verdict, progress_printer)
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
@click.option("--emit-script", "emit_script", default=None, type=click.Path(dir_okay=False),
              help="Also write a standalone repro script (torch + safetensors only, no kvdbg) that runs the failing "
                   "backend's computation and an exact reference on the shrunk tensors; it exits 1 when the "
                   "mismatch reproduces, 0 when not.")
@click.option("--script-data", type=click.Choice(["auto", "embed", "file"]), default="auto", show_default=True,
              help="With --emit-script: embed the tensors in the script (base64), write them beside it as "
                   "SCRIPT.safetensors, or embed up to 96 KiB (auto).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="With --emit-script: run the script here (isolated interpreter) and report whether it reproduces.")
@json_option
@guarded
def shrink(snapshot, output, backend, device, same_heads, force, emit_script, script_data, verify, as_json):
    """Reduce a failing snapshot while the same backend keeps failing on the same heads.

    The failure kept is the chosen backend's failing (request, head) pairs
    against the exact reference, and its error findings, at the last step
    where it fails: in the output every kept failing head still fails, the
    same error findings (and no other) appear, and no request that passed
    fails (a failing request's other heads may join it). Steps, requests, KV heads (with their query heads) and
    whole pages before each query block are removed delta-debugging style;
    every candidate is verified by replaying it through the reference and that
    backend.

    The verdict is the snapshot's own, by kvdbg's one rule (what `kvdbg
    replay` says), followed by what was shrunk: FAIL (exit 1) with the file
    written; PASS (exit 0, no file) when nothing fails.

    \b
    Examples:
      kvdbg shrink big.safetensors -o small.safetensors
      kvdbg shrink big.safetensors -o small.safetensors --backend flex --json
      kvdbg shrink big.safetensors -o small.safetensors --emit-script repro.py
    """
    import os

    from kvdbg.util.atomic import check_output
    from kvdbg.moves.shrinker import shrink as run_shrink
    from kvdbg.snapshot.store import load_snapshot
    from kvdbg.judge.verdict import EXIT_OK

    check_output(output, overwrite=force, what="-o")  # never the input snapshot, --force or not
    if emit_script is not None:
        from kvdbg.moves.repro_script import SUPPORTED, check_targets

        if backend is not None and backend not in SUPPORTED:
            raise OptionError(f"--emit-script writes out {' and '.join(SUPPORTED)} only, not {backend}")
        check_targets(emit_script, data=script_data, overwrite=force, avoid=(output, snapshot))

    from kvdbg import api
    from kvdbg.moves.shrinker import NothingToShrink

    progress = progress_printer(ongoing=False)
    snap = load_snapshot(snapshot)
    # The closing verdict is the snapshot's (kvdbg.judge.verdict.judge over its replay, what `kvdbg replay`
    # says), followed by what shrink did: FAIL when the failure was kept in a smaller file.
    judged = api.replay(snap, [backend] if backend else None, device=device).verdict
    try:
        result = run_shrink(snap, backend, device=device, progress=progress,
                            output_path=output, same_heads=same_heads, overwrite=force)
    except NothingToShrink as exc:
        if judged.exit_code == EXIT_OK:
            verdict = replace(judged, summary=f"{judged.summary}; nothing to shrink, no file written")
            if as_json:
                emit_json({"input": snapshot, "output": None, "verdict": verdict.to_json()})
            else:
                print_verdict(console(), verdict)
            return
        raise OptionError(f"{exc}; the snapshot's verdict: {judged.summary}") from None
    kept = len(result.failing_heads_after)
    summary = (f"{judged.summary}; shrunk: {result.backend} still fails on {kept} (request, head) pair(s) in "
               f"{result.output_path or 'the output'}")
    if result.output_bytes >= result.input_bytes:
        from kvdbg.render.shrink import size_change

        summary += f" ({size_change(result.input_bytes, result.output_bytes)})"
    script = None
    if emit_script is not None:
        from kvdbg.moves.repro_script import emit_repro_script, run_script

        if progress:
            progress(f"writing {emit_script}")
        script = emit_repro_script(result.snapshot, result.backend, emit_script, data=script_data, overwrite=force,
                                   device=device, source=os.path.basename(snapshot))
        if verify:
            if progress:
                progress(f"running {emit_script} in an isolated interpreter")
            script.verified_exit, script.verified_output = run_script(emit_script)
        summary += f"; {emit_script} " + ("written (not run here)" if script.reproduces is None else
                                          "reproduces it (exits 1)" if script.reproduces else
                                          f"does NOT reproduce it (exits {script.verified_exit})")
    verdict = replace(judged, summary=summary)
    if as_json:
        record = result.to_json()
        if script is not None:
            record["script"] = script.to_json()
        emit_json({**record, "verdict": verdict.to_json()})
    else:
        from kvdbg.render.shrink import render_script, render_shrink

        out = console()
        out.print(render_shrink(result))
        if script is not None:
            out.print(render_script(script))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)
