"""`kvdbg replay [SNAP]`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (backend_option, check_picture_paths, console, default_snapshot, device_option,
                              emit_json, force_option, full_option, guarded, head_option, json_option, output_option,
                              picture_file_options, print_verdict, progress_printer, request_option, step_option,
                              tolerance_options, within, write_pictures)
from kvdbg.errors import OptionError


@click.command()
@click.argument("snapshot", nargs=-1, type=click.Path())
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
@click.option("--picture", is_flag=True,
              help="Also draw which heads are wrong: a request x head error map per comparison (failing cells "
                   "marked) and, over several steps, each comparison's error step by step.")
@picture_file_options("those pictures")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Several snapshots: replay this many at once, each in its own process.")
@click.option("--recursive", "-r", is_flag=True, help="Several snapshots: search directories below their top level.")
@json_option
@guarded
def replay(snapshot, backend, step, request, head, device, exact, compile_, atol, rtol, explain, full,
           output, force, picture, svg_path, png_path, jobs, recursive, as_json):
    """Replay a snapshot through the exact reference and the backends, and diff them per head.

    Without SNAPSHOT, replays the bundled dflash fixture. Given a directory
    (its *.safetensors, sorted; --recursive goes below) or several files,
    replays each as above and prints one summary row per file (file, layer,
    step, verdict, worst backend and its error); a file that is bad input gets
    a row saying why and the others still run. Over several files the exit code
    is 2 if any is bad input, else 1 if any fails, else 3 if none verified
    anything, else 0. Each backend reports
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
      kvdbg replay captures/ --jobs 4
    """
    import os

    paths = list(snapshot)
    if len(paths) > 1 or (paths and os.path.isdir(paths[0])):
        return replay_several(paths, backends=backend, steps=step, device=device, exact=exact, compile_=compile_,
                              atol=atol, rtol=rtol, jobs=jobs, recursive=recursive, as_json=as_json,
                              single_only={"--request": request, "--head": head, "--explain": explain,
                                           "--full": full, "--output": output, "--force": force,
                                           "--picture": picture, "--svg": svg_path, "--png": png_path})
    snapshot = paths[0] if paths else None
    check_picture_paths(svg_path, png_path, force=force)
    from kvdbg import api
    from kvdbg.render.replay import render_replay
    from kvdbg.runner import save_outputs as write_outputs

    snap = api.load(snapshot or default_snapshot())
    num_heads, num_steps = snap.meta.layer.num_heads, len(snap.steps)
    head_ids = within(head, num_heads, "--head", f"the layer has {num_heads} heads")
    most = max(s.num_reqs for s in snap.steps)
    request_ids = within(request, most, "--request", f"the snapshot has {most} requests")
    step_ids = within(step, num_steps, "--step", f"the snapshot has {num_steps} step(s)")
    # --request narrows findings as it narrows the diffs, and the exit code follows what is shown.
    report = api.replay(snap, list(backend) or None, device=device, steps=step_ids, requests=request_ids,
                        heads=head_ids, atol=atol, rtol=rtol, exact=exact, compile=compile_,
                        progress=progress_printer("replaying"))
    result = report.result
    if output:
        write_outputs(result, output, overwrite=force)
    pictures = api.error_pictures(report) if picture or svg_path or png_path else None
    written = []
    if pictures is not None:
        from kvdbg.render.errormap import error_drawing

        written = write_pictures(lambda: error_drawing(pictures), svg_path, png_path, force=force)
    if as_json:
        record = report.to_json(explain=explain)
        if pictures is not None:
            verdict = record.pop("verdict")
            record.update(pictures=pictures.to_json(), verdict=verdict)
        emit_json(record)
    else:
        from rich.text import Text

        extra = []  # above the verdict line, which stays the last line
        if picture:
            from kvdbg.render.errormap import ErrorMapText, StepsText

            extra = [ErrorMapText(pictures, full=full)] + ([StepsText(pictures.series)] if pictures.series else [])
        extra += [Text(f"picture written to {path}", style="dim") for path in written]
        console().print(render_replay(report, explain=explain, full=full, saved=output, before_verdict=extra))
    if report.verdict.exit_code:
        sys.exit(report.verdict.exit_code)


def replay_several(paths, *, backends, steps, device, exact, compile_, atol, rtol, jobs, recursive, as_json,
                   single_only) -> None:
    """`kvdbg replay DIR|FILES...`: one summary row per snapshot (kvdbg.batch), one exit code over all."""
    from kvdbg.batch import BatchOptions, find_snapshots, replay_many

    given = [name for name, value in single_only.items() if value]
    if given:
        raise OptionError(f"{given[0]} applies to one snapshot; with several (or a directory) replay that file "
                          "on its own")
    files = find_snapshots(paths, recursive=recursive)
    names = tuple(dict.fromkeys(backends))
    options = BatchOptions(backends=names, steps=steps, device=device, exact=exact, compile=compile_, atol=atol,
                           rtol=rtol)
    printer = progress_printer()
    progress = None if printer is None else \
        (lambda done, total, result: printer(f"[{done}/{total}] {result.path}: {result.status}"))

    result = replay_many(files, options, jobs=jobs, progress=progress)
    if as_json:
        from kvdbg.render.batch import batch_json

        emit_json(batch_json(result))
    else:
        from kvdbg.render.batch import render_batch

        out = console()
        out.print(render_batch(result))
        print_verdict(out, result.verdict)
    if result.exit_code:
        sys.exit(result.exit_code)
