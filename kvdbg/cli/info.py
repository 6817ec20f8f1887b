"""`kvdbg info SNAP`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import console, emit_json, full_option, guarded, json_option, print_verdict, simple_verdict
from kvdbg.errors import OptionError


@click.command()
@click.argument("snapshot", type=click.Path(dir_okay=False))
@full_option("List every request, not the first 32.")
@click.option("--check", is_flag=True,
              help="Also load the tensors, validate every page id, length and offset, and check each step's "
                   "live pages as `kvdbg map` does (NaN/Inf, hidden page 0, ...); exit 1 on an error (loads torch).")
@json_option
@guarded
def info(snapshot: str, full: bool, check: bool, as_json: bool) -> None:
    """Summarise a snapshot from its header alone (instant, even on multi-GB files).

    Shows the layer and backend parameters, tensor shapes and dtypes, the
    per-request lengths, the file size against the bytes of the stored pages,
    and where the snapshot came from. Never loads the KV pages or torch.

    \b
    Example:
      kvdbg info snapshot.safetensors --json
    """
    from kvdbg.snapshot.info import summarize
    from kvdbg.judge.verdict import EXIT_OK

    summary = summarize(snapshot)
    checked = None
    if check:
        import dataclasses

        from kvdbg.judge.verdict import map_verdict

        try:  # torch reads the pages: the header alone needs none, so it may be missing where info still works
            from kvdbg.snapshot.pagemap import page_map
            from kvdbg.snapshot.store import load_snapshot
        except ImportError as exc:
            raise OptionError(f"--check reads the pages with torch, which does not import here ({exc}); "
                              "kvdbg info without --check needs no torch") from None
        snap = load_snapshot(snapshot)
        maps = [page_map(snap, step=s) for s in range(len(snap.steps))]
        checked = [a for m in maps for a in m.anomalies if a.severity == "error"]
        from kvdbg.moves.window_source import input_findings

        others, counted = input_findings(snapshot)
        verdict = map_verdict(maps, [f for f in others if f.backend != "map"], counted)
        verdict = dataclasses.replace(verdict, summary=verdict.summary.replace(
            "PASS:", "PASS: checked every page id, length and offset, and the live pages;", 1))
    else:
        verdict = simple_verdict("pass", EXIT_OK, "PASS: header read; ids, lengths and page contents not checked "
                                                  "(--check validates them)")
    if as_json:
        record = summary.to_json()
        record["checked"] = check
        if checked is not None:
            record["check_errors"] = [{"code": a.code, "request": a.request, "message": a.message} for a in checked]
        record["verdict"] = verdict.to_json()
        emit_json(record)
    else:
        from kvdbg.render.info import render_info  # rich's table machinery only when drawing

        out = console()
        out.print(render_info(summary, full=full))
        if checked:
            from rich.text import Text

            for a in checked:
                out.print(Text(f"error {a.code}: {a.message}", style="bold red"))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)
