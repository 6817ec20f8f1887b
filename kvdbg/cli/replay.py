"""`kvdbg replay [SNAP]`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import FINITE_FLOAT, backend_name, console, emit_json, guarded, json_option, print_verdict
from kvdbg.errors import OptionError
from kvdbg.ranges import IntRanges, IntRangesParam

def within(ranges: IntRanges | None, count: int, option: str, has: str) -> list[int] | None:
    """The members of an option's ranges below ``count`` (None: all); an OptionError naming one past it."""
    if ranges is None:
        return None
    beyond = ranges.out_of(count)
    if beyond is not None:
        raise OptionError(f"{option} {beyond} is out of range: {has}")
    return ranges.below(count)


def default_snapshot() -> str:
    try:
        from kvdbg.fixtures_path import default_fixture
    except ImportError:
        import os
        from importlib import resources

        path = os.fspath(resources.files("kvdbg.fixtures") / "dflash.safetensors")
        if not os.path.isfile(path):
            raise OptionError("no SNAPSHOT given and the bundled fixture dflash.safetensors is missing") from None
        return path
    return default_fixture()


@click.command()
@click.argument("snapshot", nargs=-1, type=click.Path())
@click.option("--backend", "backends", multiple=True,
              help="Backend to replay (repeatable): reference, flex, flashinfer_ts, vllm_flex (the installed vLLM's "
                   "own code); any case, or the engine's name (FLEX_ATTENTION, FLASHINFER_TS). Default: all.")
@click.option("--step", "steps", type=IntRangesParam(), default=None,
              help="Steps to replay, e.g. 1, 0-2 or 1- (default: all); earlier steps' cache updates still apply.")
@click.option("--request", "requests", type=IntRangesParam(), default=None,
              help="Requests to compare, e.g. 0-3,7 or 2- (default: all); findings about other requests are left "
                   "out too, and the exit code follows what is shown.")
@click.option("--heads", type=IntRangesParam(), default=None,
              help="Query heads to compare, e.g. 0-3,7 (default: all). Findings concern whole requests (every "
                   "head of one), so --heads does not drop them.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--exact", is_flag=True, help="Reference in float64 instead of float32.")
@click.option("--compile/--no-compile", "compile_", default=None,
              help="torch.compile flex_attention (default: eager on CPU; on CUDA compiled only for steps too big for eager to be quicker).")
@click.option("--atol", type=FINITE_FLOAT, default=None,
              help="Absolute tolerance, finite and >= 0 (default by dtype, see the footer).")
@click.option("--rtol", type=FINITE_FLOAT, default=None, help="Relative tolerance, finite and >= 0 (default by dtype).")
@click.option("--explain", is_flag=True, help="Show each backend's per-request builder decisions.")
@click.option("--full", is_flag=True, help="Show every head, not only failing ones and the worst passing.")
@click.option("--save-outputs", type=click.Path(dir_okay=False), default=None,
              help="Write every backend's output tensors to this safetensors file.")
@click.option("--force", is_flag=True, help="Let --save-outputs replace an existing file.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Several snapshots: replay this many at once, each in its own process.")
@click.option("--recursive", "-r", is_flag=True, help="Several snapshots: search directories below their top level.")
@json_option
@guarded
def replay(snapshot, backends, steps, requests, heads, device, exact, compile_, atol, rtol, explain, full,
           save_outputs, force, jobs, recursive, as_json):
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
      kvdbg replay snapshot.safetensors --backend flex --heads 0-3 --json
      kvdbg replay --explain --save-outputs outputs.safetensors
      kvdbg replay captures/ --jobs 4
    """
    import os

    paths = list(snapshot)
    if len(paths) > 1 or (paths and os.path.isdir(paths[0])):
        return replay_several(paths, backends=backends, steps=steps, device=device, exact=exact, compile_=compile_,
                              atol=atol, rtol=rtol, jobs=jobs, recursive=recursive, as_json=as_json,
                              single_only={"--request": requests, "--heads": heads, "--explain": explain,
                                           "--full": full, "--save-outputs": save_outputs, "--force": force})
    snapshot = paths[0] if paths else None
    from kvdbg.attention import ReplayOptions
    from kvdbg.render.replay import render_replay
    from kvdbg.replay import replay as run_replay
    from kvdbg.replay import save_outputs as write_outputs
    from kvdbg.snapshot import load_snapshot

    backends = list(dict.fromkeys(backend_name(b) for b in backends))
    path = snapshot or default_snapshot()
    snap = load_snapshot(path)
    num_heads, num_steps = snap.meta.layer.num_heads, len(snap.steps)
    head_ids = within(heads, num_heads, "--heads", f"the layer has {num_heads} heads")
    most = max(s.num_reqs for s in snap.steps)
    request_ids = within(requests, most, "--request", f"the snapshot has {most} requests")
    step_ids = within(steps, num_steps, "--step", f"the snapshot has {num_steps} step(s)")
    names = list(backends) if backends else None
    if names is not None and "reference" not in names:
        names.insert(0, "reference")  # every comparison needs the exact answer
    progress = None
    if sys.stderr.isatty() and not as_json:
        err = console(stderr=True)

        def progress(message: str) -> None:
            err.print(f"replaying {message}…", style="dim")

    options = ReplayOptions(device=device, exact=exact, compile=compile_)
    result = run_replay(snap, names, options, steps=step_ids,
                        required=list(backends), progress=progress)
    # --request narrows findings as it narrows the diffs, and the exit code follows what is shown.
    report = result.judge(atol=atol, rtol=rtol, requests=request_ids, heads=head_ids)
    if save_outputs:
        write_outputs(result, save_outputs, overwrite=force)
    if as_json:
        emit_json(report.to_json(explain=explain))
    else:
        console().print(render_replay(report, explain=explain, full=full, saved=save_outputs))
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
    names = tuple(dict.fromkeys(backend_name(b) for b in backends))
    options = BatchOptions(backends=names, steps=steps, device=device, exact=exact, compile=compile_, atol=atol,
                           rtol=rtol)
    progress = None
    if sys.stderr.isatty() and not as_json:
        err = console(stderr=True)

        def progress(done: int, total: int, result) -> None:
            err.print(f"[{done}/{total}] {result.path}: {result.status}", style="dim")

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
