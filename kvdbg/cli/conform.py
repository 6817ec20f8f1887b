"""`kvdbg conform`: hold an installed engine's attention backend to the exact reference, feature by feature."""

from __future__ import annotations

import signal
import sys

import click

MAX_SEED = 2**62

from kvdbg.cli.common import (BadInput, console, device_option, emit_json, force_option, guarded, json_option, print_verdict,
                              tolerance_options)


def _names(ctx, param, values) -> tuple[str, ...] | None:
    names = [part.strip() for value in values or () for part in str(value).split(",") if part.strip()]
    return tuple(dict.fromkeys(names)) or None


def _row_numbers(ctx, param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and len(part) <= 6 for part in parts):
        raise BadInput(f"--rows must be row numbers from 0 separated by commas (as conform's table numbers "
                       f"them), got {value!r}")
    return tuple(sorted({int(part) for part in parts}))


def _seed(ctx, param, value: int) -> int:
    if not 0 <= value <= MAX_SEED:
        raise BadInput(f"--seed must be from 0 to 2**62, got {value}")
    return value


@click.command()
@click.option("--backend", "backend", multiple=True, callback=_names, metavar="NAME",
              help="The engine's backend by its registry name, any case (CPU_ATTN, FLEX_ATTENTION, TRITON_ATTN); "
                   "repeatable or comma-separated [default: every backend the installed engine runs on DEVICE].")
@device_option()
@click.option("--features", default=None, metavar="NAME[,NAME]",
              help="Only these features vary (the others stay at baseline): window, chunk-lookback, sinks, "
                   "soft-cap, alibi, gqa, head-size, page-size, kv-cache, dtype, mask, pages [default: all].")
@click.option("--batch", "batch", default="decode,prefill,mixed", show_default=True, metavar="KIND[,KIND]",
              help="Batch kinds each combination runs in: decode, prefill, mixed.")
@click.option("--rows", "rows", default=None, metavar="N[,N]", callback=_row_numbers,
              help="Run only these rows of the matrix, by the numbers its table gives them (the matrix is made "
                   "as without it, so a number names the same combination): re-run failing rows alone.")
@click.option("--full", is_flag=True, help="Every combination (the whole product, when it is at most 512 rows) "
                                           "instead of a pairwise covering array.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), metavar="DIR",
              help="Write each failing cell's snapshot (and its minimal combination's) here, for `kvdbg report`.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, metavar="N",
              help="Run cells in N worker processes side by side (each compiles its kernels while the others "
                   "run) [default: on a GPU one per two cores, at most 8; on a CPU 1, in this process].")
@force_option()
@click.option("--seed", type=int, default=0, metavar="N", callback=_seed,
              help="Seed of the synthetic steps (each cell draws its own data from it) [default: 0].")
@tolerance_options()
@json_option
@guarded
def conform(backend, device, features, batch, rows, full, out_dir, jobs, force, seed, atol, rtol, as_json):
    """Hold an installed engine's attention backend to the exact reference, feature by feature.

    Every feature the snapshot format models (window, chunked lookback, sinks,
    soft cap, ALiBi, GQA, head size, page size, FP8 cache, dtype, mask, page
    placement) that
    the backend takes alone is combined pairwise (a covering array; --full for
    the whole product), each combination run in decode, prefill and mixed
    batches whose lengths straddle page and window boundaries, through the
    backend's own code (the vllm column) and the exact reference.

    A cell is pass, FAIL (max error, first wrong request and head) or refused
    by the backend's own checks (never a failure). A failing cell is run again
    on the float32 path (rounding, or semantic), shrunk to the smallest
    combination that still fails, and with --out its snapshot is written for
    `kvdbg report`. Exit 1 when a cell fails, 0 when all pass, 3 when no cell
    ran, 2 on bad options. Ctrl-C or SIGTERM stops it with the table (and
    --json) of the cells that ran, and the snapshots of those that failed
    (exit 130).

    \b
    Examples:
      kvdbg conform --backend CPU_ATTN
      kvdbg conform --backend FLEX_ATTENTION --features window,pages,mask --full
      kvdbg conform --out conform-failures --json
      kvdbg conform --backend FLASHINFER --device cuda --rows 1,3
    """
    from kvdbg.moves.conform.run import conform as run_conform, conform_verdict

    kinds = [k.strip() for k in batch.split(",") if k.strip()]
    feature_names = None if features is None else [f for f in features.split(",")]
    if sys.stderr.isatty():
        from kvdbg.render.conform import ConformBar

        bar = ConformBar(console(stderr=True))
    else:
        from kvdbg.render.conform import ConformLines

        bar = ConformLines()
    previous = _sigterm_as_interrupt()
    try:
        result = run_conform(backend, device, features=feature_names, kinds=kinds, full=full, out_dir=out_dir,
                             force=force, seed=seed, atol=atol, rtol=rtol, progress=bar, rows=rows,
                             make_runner=_runner_maker(device, jobs, seed, atol, rtol))
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    verdict = conform_verdict(result)
    if as_json:
        emit_json({**result.to_json(), "verdict": verdict.to_json()})
    else:
        from kvdbg.render.conform import render_conform

        out = console()
        out.print(render_conform(result))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _sigterm_as_interrupt():
    """SIGTERM (`timeout`, a batch system's limit) stops conform as Ctrl-C does: the cells that ran are shown,
    not lost. Returns the handler it replaced (None where signals cannot be set: not the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:
        return None


def _runner_maker(device: str, jobs: int | None, seed: int, atol, rtol):
    """None (one EngineRunner in this process) for one job on a CPU; else each backend's cells on a pool of
    workers (kvdbg.fleet.conform_pool)."""
    import os

    from kvdbg.fleet.conform_pool import PooledRunner, RunnerArgs, default_jobs

    kind = _device_kind(device)
    count = jobs if jobs is not None else default_jobs(kind, os.cpu_count() or 1)
    if count <= 1 and kind == "cpu":
        return None  # on a GPU even one job runs in a worker: the float32 re-runs need workers of their own
    return lambda name: PooledRunner(RunnerArgs(name, device, seed, atol, rtol), count)


def _device_kind(device: str) -> str:
    """"cuda" or "cpu" for the default of --jobs (auto: cuda where torch sees a GPU)."""
    if device != "auto":
        return device
    from kvdbg.fleet.workers import cuda_count

    return "cuda" if cuda_count() else "cpu"
