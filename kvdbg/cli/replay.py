"""`kvdbg replay [SNAP]`."""

from __future__ import annotations

import shlex
import sys

import click

from kvdbg.cli.common import (AliasedOption, backend_option, check_picture_paths, console, default_snapshot, device_option,
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
@click.option("--builder", "--explain", "explain", cls=AliasedOption, hidden_aliases=("--explain",), is_flag=True,
              help="Also show each backend's per-request builder decisions.")
@full_option("Show every table: what each backend ran and did, the findings in full, every head of every "
             "comparison, the pass rule; with several snapshots, one row per file and every file of each group "
             "of failures.")
@output_option("Also write every backend's output tensors to this safetensors file.",
               hidden_aliases=("--save-outputs",))
@force_option()
@click.option("--what-if", "what_if", is_flag=True,
              help="When the engine's captured output fails against the reference: whether it is exact attention "
                   "of the layer with a feature taken away (ALiBi, soft cap, window, sinks), a non-causal window "
                   "bounded on the left only, or an FP8 query scale applied twice, alone or in pairs; names the "
                   "closest that passes, or, when no one change explains every request (a batch split between two "
                   "kernels), each request's; over --request's requests only (a reference replay per change, on "
                   "the CPU).")
@click.option("--picture", is_flag=True,
              help="Also draw which heads are wrong: a request x head error map per comparison (failing cells "
                   "marked) and, over several steps, each comparison's error step by step.")
@picture_file_options("those pictures")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, metavar="N",
              help="Several snapshots: worker processes, each replaying one file at a time [default: 1]; with "
                   "--device cuda, per GPU, on every visible GPU [default: 2 per GPU, 1 where cores are fewer]; with "
                   "--ray, tasks per GPU.")
@click.option("--recursive", "-r", is_flag=True, help="Several snapshots: search directories below their top level.")
@click.option("--results", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Several snapshots: append one JSON line per snapshot to FILE as each finishes (kept when the "
                   "run stops; kvdbg triage FILE reads it).")
@click.option("--resume", is_flag=True,
              help="With --results: keep the rows FILE has (same path, size and time) and replay the other files.")
@click.option("--ray", "ray", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Several snapshots: run each as a Ray task on the cluster at ADDRESS (default: RAY_ADDRESS, or "
                   "the one started here; local: a private cluster of this machine, for this run), reading the "
                   "files from a path every node shares. Needs kvdbg[ray].")
@json_option
@guarded
def replay(snapshot, backend, step, request, head, device, exact, compile_, atol, rtol, explain, full,
           output, force, what_if, picture, svg_path, png_path, jobs, recursive, results, resume, ray, as_json):
    """Replay a snapshot through the exact reference and the backends, and diff them per head.

    Prints one screen: the verdict, one row per comparison with its failing
    requests and heads, the findings with their meaning, and the commands to
    run next for this snapshot; --full prints every table.

    Without SNAPSHOT, replays the bundled dflash fixture. Given a directory
    (its *.safetensors, sorted; --recursive goes below) or several files,
    replays each as above; failing files are grouped by cause, each group with
    a command that replays one of its files, and a file that is bad input is
    a group saying why while the others still run; --full adds one summary row
    per file (file, layer, step, verdict, worst backend and its error). Over
    several files the exit code is 2 if any is bad input, else 1 if any fails,
    else 3 if none verified anything, else 0. Each backend reports
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
      kvdbg replay snapshot.safetensors --full
      kvdbg replay snapshot.safetensors --backend flex --head 0-3 --json
      kvdbg replay snapshot.safetensors --what-if
      kvdbg replay --builder -o outputs.safetensors
      kvdbg replay captures/ --jobs 4
      kvdbg replay captures/ --device cuda --results r.jsonl --resume
      kvdbg replay /shared/captures --ray --device cuda --results r.jsonl
    """
    import os

    paths = list(snapshot)
    if ray:
        _check_ray_address(ray)
    several = {"--results": results, "--resume": resume, "--ray": ray is not None}
    if len(paths) > 1 or (paths and os.path.isdir(paths[0])) or (paths and any(several.values())):
        return replay_several(paths, backends=backend, steps=step, device=device, exact=exact, compile_=compile_,
                              atol=atol, rtol=rtol, jobs=jobs, recursive=recursive, as_json=as_json,
                              results=results, resume=resume, ray=ray, force=force, full=full,
                              single_only={"--request": request, "--head": head, "--builder": explain,
                                           "--output": output, "--what-if": what_if, "--picture": picture,
                                           "--svg": svg_path, "--png": png_path})
    given = [name for name, value in several.items() if value]
    if given:
        raise OptionError(f"{given[0]} needs snapshots to replay: name a directory or files")
    snapshot = paths[0] if paths else None
    from kvdbg.util.atomic import check_distinct_outputs

    check_distinct_outputs((("-o", output), ("--svg", svg_path or None), ("--png", png_path or None)))
    check_picture_paths(svg_path, png_path, force=force)
    from kvdbg import api
    from kvdbg.render.replay import render_replay
    from kvdbg.replayer.runner import save_outputs as write_outputs

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
    what_if_record = _what_if(snap, report, atol, rtol, request_ids) if what_if else None
    pictures = api.error_pictures(report) if picture or svg_path or png_path else None
    written = []
    if pictures is not None:
        from kvdbg.render.errormap import error_drawing

        written = write_pictures(lambda: error_drawing(pictures), svg_path, png_path, force=force)
    if as_json:
        record = report.to_json(explain=explain)
        if pictures is not None or what_if_record is not None:
            verdict = record.pop("verdict")
            if pictures is not None:
                record["pictures"] = pictures.to_json()
            if what_if_record is not None:
                record["what_if"] = what_if_record
            record["verdict"] = verdict
        emit_json(record)
    else:
        from rich.text import Text

        extra = []  # above the verdict line, which stays the last line
        if picture:
            from kvdbg.render.errormap import ErrorMapText, StepsText

            extra = [ErrorMapText(pictures, full=full)] + ([StepsText(pictures.series)] if pictures.series else [])
        extra += [Text(f"picture written to {path}", style="dim") for path in written]
        if what_if_record is not None:
            extra.append(Text(f"what-if: {what_if_record['said']}", style="bold" if what_if_record["explained"]
                              else ""))
        if full:
            page = render_replay(report, explain=explain, full=True, saved=output, before_verdict=extra)
        else:
            from kvdbg.render.front import render_front

            page = render_front(report, snap.path or snapshot or default_snapshot(), explain=explain, saved=output,
                                before_verdict=extra)
        console().print(page, crop=False)  # a next command whose path is wider than the line is shown whole
    if report.verdict.exit_code:
        sys.exit(report.verdict.exit_code)


def _what_if(snap, report, atol, rtol, requests=None) -> dict:
    """``--what-if``: whether the engine's captured output, failing against the reference, is exact attention of
    the layer with a feature taken away (kvdbg.moves.whatif); a JSON record with the sentence the table shows."""
    from kvdbg.moves.whatif import WHAT_IFS, explain_output

    applicable = [w.what for w in WHAT_IFS if w.applies(snap.meta.layer)]
    captured = [c for c in report.comparisons if c.actual == "captured" and c.expected == "reference" and c.heads]
    record = {"explained": None, "changes": applicable, "said": ""}
    if not captured:
        record["said"] = "nothing to explain: the snapshot holds no engine output compared with the reference"
    elif all(c.passed for c in captured):
        record["said"] = "nothing to explain: the captured output passes against the reference"
    elif not applicable:
        record["said"] = ("no change to try: the layer has none of ALiBi, a soft cap, a window, sinks or an FP8 "
                          "query scale")
    else:
        found = explain_output(snap, atol=atol, rtol=rtol, requests=requests)
        if found is None:
            record["said"] = (f"no change of the layer explains the captured output (tried {len(applicable)} "
                              f"alone and in pairs: {'; '.join(applicable)})")
        else:
            record["explained"] = found.to_json()
            record["said"] = found.sentence().replace("the output is", "the captured output is", 1)
    return record


def replay_several(paths, *, backends, steps, device, exact, compile_, atol, rtol, jobs, recursive, as_json,
                   results, resume, ray, force, full, single_only) -> None:
    """`kvdbg replay DIR|FILES...`: the failing snapshots grouped by cause (kvdbg.fleet.triage), with --full one
    summary row per snapshot above (kvdbg.replayer.batch), one exit code over all; run by kvdbg.fleet.runs on
    workers, GPUs or a Ray cluster."""
    from kvdbg.replayer.batch import BatchOptions, find_snapshots
    from kvdbg.fleet.runs import run_fleet

    given = [name for name, value in single_only.items() if value]
    if given:
        raise OptionError(f"{given[0]} applies to one snapshot; with several (or a directory) replay that file "
                          "on its own")
    if force and not results:
        raise OptionError("--force applies to one snapshot's --output, or to --results FILE with several")
    files = find_snapshots(paths, recursive=recursive)
    names = tuple(dict.fromkeys(backends))
    options = BatchOptions(backends=names, steps=steps, device=device, exact=exact, compile=compile_, atol=atol,
                           rtol=rtol)
    progress = None
    if sys.stderr.isatty():
        from kvdbg.render.progress import FleetBar

        progress = FleetBar(console(stderr=True))
    fleet = run_fleet(files, options, jobs=jobs, ray=ray or None, use_ray=ray is not None, results=results,
                      resume=resume, overwrite=force, progress=progress)
    result = fleet.batch
    if as_json:
        from kvdbg.render.batch import batch_json
        from kvdbg.render.triage import fleet_json

        emit_json(fleet_json(fleet, batch_json(result)))
    else:
        from kvdbg.render.batch import render_batch
        from kvdbg.render.triage import render_fleet, render_triage

        out = console()
        if full:
            out.print(render_batch(result))
        else:
            from kvdbg.render.batch import render_batch_title

            out.print(render_batch_title(result))
        out.print(render_triage(fleet.triage, full=full), crop=False)
        out.print(render_fleet(fleet))
        if not full:
            from kvdbg.render.front import Hint, HintLines

            given = ["kvdbg", "replay", *paths] + (["--recursive"] if recursive else []) + ["--full"]
            out.print(HintLines([Hint(shlex.join(given), "one row per file, every file of each group")]), crop=False)
        print_verdict(out, result.verdict)
    if result.exit_code:
        sys.exit(result.exit_code)


def _check_ray_address(address: str) -> None:
    """``--ray DIR`` takes DIR as the address (click's optional value): say so rather than replay nothing. Ray's
    words (``auto``, ``local``) are addresses even where a file of that name exists."""
    import os

    if address not in ("auto", "local") and os.path.exists(address):
        raise OptionError(f"--ray took {address!r} as the cluster address, but it is a path: put the snapshots "
                          f"first (kvdbg replay {address} --ray) or give the address (--ray auto {address})")
