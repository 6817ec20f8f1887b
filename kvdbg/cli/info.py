"""`kvdbg info SNAP`."""

from __future__ import annotations

import click

from kvdbg.cli.common import console, emit_json, guarded, json_option


@click.command()
@click.argument("snapshot", type=click.Path(dir_okay=False))
@click.option("--full", is_flag=True, help="List every request, not the first 32.")
@click.option("--check", is_flag=True,
              help="Also map the tensors and validate every page id, length and offset (loads torch).")
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
    from kvdbg.summary import summarize

    summary = summarize(snapshot)
    if check:
        from kvdbg.snapshot import load_snapshot

        load_snapshot(snapshot)
    if as_json:
        emit_json(summary.to_json_dict())
    else:
        from kvdbg.render.info import render_info  # rich's table machinery only when drawing

        console().print(render_info(summary, full=full))
