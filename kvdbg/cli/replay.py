"""`kvdbg replay [SNAP]`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (backend_option, console, default_snapshot, device_option, emit_json, force_option,
                              full_option, guarded, head_option, json_option, output_option, progress_printer,
                              request_option, step_option, tolerance_options, within)


@click.command()
@click.argument("snapshot", required=False, type=click.Path(dir_okay=False))
@backend_option()
@step_option(extra="Earlier steps' cache updates still apply.")
@request_option(extra="Findings about other requests are left out too; the exit code follows "
                      "what is shown.")
@head_option(extra="Findings concern whole requests, so --head does not drop them.")
@device_option()
@click.option("--exact", is_flag=True, help="Reference in float64 instead of float32.")
@click.option("--compile/--no-compile", "compile_", default=None,
              help="torch.compile flex_attention (default: eager on CPU; on CUDA compiled only for steps too big for eager to be quicker).")
@tolerance_options()
@click.option("--explain", is_flag=True, help="Show each backend's per-request builder decisions.")
@full_option("Show every head, not only failing ones and the worst passing.")
@output_option("Also write every backend's output tensors to this safetensors file.",
               hidden_aliases=("--save-outputs",))
@force_option()
@json_option
@guarded
def replay(snapshot, backend, step, request, head, device, exact, compile_, atol, rtol, explain, full,
           output, force, as_json):
    """Replay a snapshot through the exact reference and the backends, and diff them per head.

    Without SNAPSHOT, replays the bundled dflash fixture. Each backend reports
    what really ran (kernel, device, eager/compiled, dtype, emulated or not);
    findings list what the engine's backend would silently get wrong; the
    per-head table shows failing heads first.

    Exit 0 when everything compared matches and no finding is an error; 1 on
    a mismatch or an error finding (warnings and notes never count); 2 on bad
    input; 3 when nothing could be compared (e.g. only the reference ran and the
    snapshot holds no engine output).

    \b
    Examples:
      kvdbg replay snapshot.safetensors
      kvdbg replay snapshot.safetensors --backend flex --head 0-3 --json
      kvdbg replay --explain -o outputs.safetensors
    """
    from kvdbg.attention import ReplayOptions
    from kvdbg.render.replay import render_replay
    from kvdbg.replay import replay as run_replay
    from kvdbg.replay import save_outputs as write_outputs
    from kvdbg.snapshot import load_snapshot

    backends = list(backend)
    path = snapshot or default_snapshot()
    snap = load_snapshot(path)
    num_heads, num_steps = snap.meta.layer.num_heads, len(snap.steps)
    head_ids = within(head, num_heads, "--head", f"the layer has {num_heads} heads")
    most = max(s.num_reqs for s in snap.steps)
    request_ids = within(request, most, "--request", f"the snapshot has {most} requests")
    step_ids = within(step, num_steps, "--step", f"the snapshot has {num_steps} step(s)")
    names = list(backends) if backends else None
    if names is not None and "reference" not in names:
        names.insert(0, "reference")  # every comparison needs the exact answer
    options = ReplayOptions(device=device, exact=exact, compile=compile_)
    result = run_replay(snap, names, options, steps=step_ids, required=backends,
                        progress=progress_printer("replaying"))
    # --request narrows findings as it narrows the diffs, and the exit code follows what is shown.
    report = result.judge(atol=atol, rtol=rtol, requests=request_ids, heads=head_ids)
    if output:
        write_outputs(result, output, overwrite=force)
    if as_json:
        emit_json(report.to_json(explain=explain))
    else:
        console().print(render_replay(report, explain=explain, full=full, saved=output))
    if report.verdict.exit_code:
        sys.exit(report.verdict.exit_code)
