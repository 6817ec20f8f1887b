"""`kvdbg explain [CODE]` (no snapshot, no torch)."""

from __future__ import annotations

import click

from kvdbg.cli.common import console, emit_json, guarded, json_option
from kvdbg.errors import OptionError


@click.command()
@click.argument("code", required=False)
@json_option
@guarded
def explain(code: str | None, as_json: bool) -> None:
    """Say what a finding code means, when it fires and what to do about it.

    Without CODE, list every code with its severity. The codes are the ones
    replay, map, window and report print in their findings tables (and in the
    "code" key of --json); docs/findings.md holds the same text.

    \b
    Examples:
      kvdbg explain live_page_zero
      kvdbg explain --json
    """
    from kvdbg.judge.findings import CODES, UnknownCode, lookup

    if code is None:
        if as_json:
            emit_json({"codes": [c.to_json() for c in CODES.values()]})
            return
        from kvdbg.render.explain import render_codes

        console().print(render_codes())
        return
    try:
        entry = lookup(code.strip(), former=True)
    except UnknownCode as exc:
        raise OptionError(str(exc)) from None
    if as_json:
        emit_json(entry.to_json())
        return
    from kvdbg.render.explain import render_code

    console().print(render_code(entry, asked=code.strip()))
