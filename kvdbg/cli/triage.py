"""`kvdbg triage RESULTS`: a results file's failing rows grouped by cause, without replaying anything."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import console, emit_json, full_option, guarded, json_option, print_verdict


@click.command()
@click.argument("results", type=click.Path(dir_okay=False), metavar="RESULTS")
@full_option("Name every file of each group.")
@json_option
@guarded
def triage(results, full, as_json):
    """Group the failing rows of a results file by cause, as `kvdbg replay DIR` does under its table.

    RESULTS is the file `kvdbg replay DIR --results RESULTS` writes (one JSON
    line per snapshot, kept across runs; the latest row of each file counts).
    Rows fail in the same way when the same backend fails against the same
    expectation on the same query heads in the same way (outside tolerance,
    NaN/Inf, unwritten tokens) with the same error findings; bad input, kvdbg's
    own errors and dead workers group by their reason. Each group names its
    files and the command that replays its smallest file with the run's
    options. A run that was stopped says how many files it did not reach
    (`kvdbg replay DIR --results RESULTS --resume` finishes it).

    Exit code over the rows held, as `kvdbg replay DIR`: 2 if any file is bad
    input, else 1 if any fails, else 3 if none verified anything, else 0.

    \b
    Examples:
      kvdbg triage results.jsonl
      kvdbg triage results.jsonl --json | jq '.groups[0].example'
    """
    from kvdbg.replayer.batch import BatchResult, batch_verdict
    from kvdbg.fleet.results import read_results
    from kvdbg.fleet.triage import triage as group_rows

    found = read_results(results)
    rows = sorted(found.rows, key=lambda r: r.path)  # as a directory's files are replayed: by name
    files = [r.result for r in rows]
    code, summary = batch_verdict(files)
    batch = BatchResult(files, code, summary)
    grouped = group_rows(rows, found.options)
    status = _status(found)
    if as_json:
        emit_json({"results": results, "runs": len(found.runs), "rows": len(rows),
                   "planned": found.runs[-1].get("planned"), "finished": found.finished,
                   "superseded_rows": found.superseded, "torn_tail_bytes": found.torn_tail,
                   "status": status, "counts": batch.counts, **grouped.to_json(),
                   "verdict": batch.verdict.to_json()})
    else:
        from rich.text import Text

        from kvdbg.render.triage import render_triage

        out = console()
        out.print(Text(f"{results}: {status}"))
        out.print(render_triage(grouped, full=full), crop=False)
        print_verdict(out, batch.verdict)
    if code:
        sys.exit(code)


def _status(found) -> str:
    """How complete the file is: rows, runs, and whether the last run ended."""
    last = found.runs[-1]
    planned = last.get("planned")
    text = f"{len(found.rows)} row(s) from {len(found.runs)} run(s)"
    if found.finished:
        text += "; the last run finished"
    else:
        missing = max(0, planned - len(found.rows)) if isinstance(planned, int) else None
        reached = f" ({missing} of its {planned} file(s) have no row)" if missing else ""
        text += (f"; the last run did not finish{reached}: `kvdbg replay DIR --results FILE --resume` "
                 "replays the rest")
    if found.torn_tail:
        text += f"; a last line cut short ({found.torn_tail} bytes) is ignored"
    if found.superseded:
        text += f"; {found.superseded} older row(s) of files replayed again are left out"
    return text
