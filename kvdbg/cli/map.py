"""`kvdbg map SNAP`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (console, emit_json, full_option, guarded, json_option, print_verdict, request_option,
                              step_option, within)
from kvdbg.errors import OptionError


@click.command(name="map")
@click.argument("snapshot", type=click.Path(dir_okay=False))
@step_option(one="map shows one step", default_help="0")
@request_option(extra="Anomalies are those the shown requests are part of.")
@full_option("Do not elide long rows or long request lists.")
@json_option
@guarded
def map_(snapshot: str, step: int | None, request, full: bool, as_json: bool) -> None:
    """Show block tables, the physical→logical page map and paging anomalies.

    For each request: the live block-table entries (engine page ids) and the
    stale tail past cdiv(seq_len, page_size); the physical→logical map as
    vLLM's FLEX_ATTENTION derives it (stale entries ignored, page 0 = null
    block); and anomalies: a live page 0 or a page mapped twice is an error
    (exit 1) when it hides a key some query token's mask shows, and a note
    when it lies before the sliding window (vLLM puts its null block there and
    reuses freed blocks by design); pages shared across requests, stale
    non-zero tails, stored pages nothing references.

    The verdict judges the step's inputs by kvdbg's one rule (an error
    finding of the snapshot's own backend fails): the paging findings above
    for a FLEX_ATTENTION snapshot, FLASHINFER_TS's kernel preconditions
    (as `kvdbg window` checks them) for a FLASHINFER_TS one. Outputs are not
    compared (`kvdbg replay` compares them).

    \b
    Examples:
      kvdbg map snapshot.safetensors
      kvdbg map snapshot.safetensors --step 1 --request 0-3 --full --json
    """
    from kvdbg.snapshot.pagemap import page_map
    from kvdbg.snapshot.store import load_snapshot

    from kvdbg.judge.verdict import map_verdict

    snap = load_snapshot(snapshot)
    step = step or 0
    if not 0 <= step < len(snap.steps):
        raise OptionError(f"--step {step} is out of range: the snapshot has {len(snap.steps)} step(s)")
    num_reqs = snap.steps[step].num_reqs
    result = page_map(snap, step=step, request=within(request, num_reqs, "--request",
                                                      f"step {step} has {num_reqs} request(s)"))
    from kvdbg.moves.window_source import input_findings

    # The same input findings `window SNAP` judges (FLASHINFER_TS's preconditions and window restriction): one
    # rule, one verdict for the step whatever command reads it (kvdbg.judge.verdict).
    others, counted = input_findings(snapshot, steps=[step])
    shown = {r.request for r in result.requests}  # --request narrows the findings as it narrows the anomalies
    verdict = map_verdict([result], [f for f in others if f.backend != "map" and (f.request is None
                                                                                 or f.request in shown)], counted)
    if as_json:
        emit_json({**result.to_json(), "verdict": verdict.to_json()})
    else:
        from kvdbg.render.pagemap import render_page_map

        out = console()
        out.print(render_page_map(result, full=full))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)
