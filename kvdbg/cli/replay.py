"""`kvdbg replay [SNAP]`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import FINITE_FLOAT, backend_name, console, emit_json, guarded, json_option
from kvdbg.errors import OptionError

# No engine has this many heads or requests in one step; the bound keeps a typo
# like 0-100000000000 from expanding into a list that exhausts memory.
MAX_RANGE_INDEX = 2**20 - 1


def parse_ranges(value: str | None, option: str) -> list[int] | None:
    """``"0-3,7"`` → ``[0, 1, 2, 3, 7]``; None stays None (everything)."""
    if value is None:
        return None
    out: list[int] = []
    for part in value.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                lo, hi = part.split("-", 1) if not part.startswith("-") else (part, "")
                lo_i, hi_i = int(lo), int(hi)
                if hi_i < lo_i:
                    raise ValueError
                if hi_i > MAX_RANGE_INDEX:
                    raise OptionError(f"{option} {hi_i} is out of range (indices stop at {MAX_RANGE_INDEX})")
                out.extend(range(lo_i, hi_i + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise OptionError(f"{option} must look like 0-3,7 (non-negative indices and ranges), got {value!r}") \
                from None
    if not out or min(out) < 0:
        raise OptionError(f"{option} must list non-negative indices, got {value!r}")
    return sorted(set(out))


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
@click.argument("snapshot", required=False, type=click.Path(dir_okay=False))
@click.option("--backend", "backends", multiple=True,
              help="Backend to replay (repeatable): reference, flex, flashinfer_ts, vllm_flex (the installed vLLM's "
                   "own code); any case, or the engine's name (FLEX_ATTENTION, FLASHINFER_TS). Default: all.")
@click.option("--step", type=int, default=None, help="Replay only this step (earlier steps' cache updates still apply).")
@click.option("--request", "requests", default=None,
              help="Requests to compare, e.g. 0-3,7 (default: all); findings about other requests are left out "
                   "too, and the exit code follows what is shown.")
@click.option("--heads", default=None,
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
@json_option
@guarded
def replay(snapshot, backends, step, requests, heads, device, exact, compile_, atol, rtol, explain, full,
           save_outputs, force, as_json):
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
      kvdbg replay snapshot.safetensors --backend flex --heads 0-3 --json
      kvdbg replay --explain --save-outputs outputs.safetensors
    """
    from kvdbg.attention import ReplayOptions
    from kvdbg.render.replay import render_replay
    from kvdbg.replay import replay as run_replay
    from kvdbg.replay import save_outputs as write_outputs
    from kvdbg.snapshot import load_snapshot

    backends = list(dict.fromkeys(backend_name(b) for b in backends))
    request_ids = parse_ranges(requests, "--request")
    head_ids = parse_ranges(heads, "--heads")
    path = snapshot or default_snapshot()
    snap = load_snapshot(path)
    if head_ids is not None and max(head_ids) >= snap.meta.layer.num_heads:
        raise OptionError(f"--heads {max(head_ids)} is out of range: the layer has {snap.meta.layer.num_heads} heads")
    if request_ids is not None:
        most = max(s.num_reqs for s in snap.steps)
        if max(request_ids) >= most:
            raise OptionError(f"--request {max(request_ids)} is out of range: the snapshot has {most} requests")
    names = list(backends) if backends else None
    if names is not None and "reference" not in names:
        names.insert(0, "reference")  # every comparison needs the exact answer
    progress = None
    if sys.stderr.isatty() and not as_json:
        err = console(stderr=True)

        def progress(message: str) -> None:
            err.print(f"replaying {message}…", style="dim")

    options = ReplayOptions(device=device, exact=exact, compile=compile_)
    result = run_replay(snap, names, options, steps=None if step is None else [step],
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
