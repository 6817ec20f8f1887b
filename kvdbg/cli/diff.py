"""`kvdbg diff A B`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (console, emit_json, full_option, guarded, json_option, print_verdict, progress_printer,
                              tolerance_options)


@click.command()
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@tolerance_options(" for outputs")
@full_option("Show every head of every output, not only failing ones.")
@json_option
@guarded
def diff(a, b, atol, rtol, full, as_json):
    """Compare two snapshots of the same step (good vs bad build), or two `replay -o` files.

    Inputs: metadata (layer, backend, scales, layout), lengths, the block
    table, the KV pages, the query and the step's new K/V. Pages are compared
    by logical position (request r's page j in A against its page j in B,
    over the keys both hold), so the same page at another physical id is not
    a difference; differently placed entries are counted apart. Outputs (the
    engine's, or each saved backend's) are compared per request × head with
    replay's rule, A as the expected side. Large files are read from their
    memory mapping a chunk of pages at a time.

    Exit 0 when the outputs agree within tolerance; 1 when they differ; 2 on
    bad input or files that are not comparable (another layer, head count,
    page size, step count, request or token count: the field is named); 3
    when no output is held by both.

    \b
    Examples:
      kvdbg diff good.safetensors bad.safetensors
      kvdbg replay snap.safetensors -o a.safetensors   # on one machine / build
      kvdbg diff a.safetensors b.safetensors --json
    """
    from kvdbg.moves.snapdiff import diff_files, diff_verdict

    result = diff_files(a, b, atol=atol, rtol=rtol, progress=progress_printer("comparing"))
    verdict = diff_verdict(result)
    if as_json:
        emit_json({**result.to_json(), "verdict": verdict.to_json()})
    else:
        from kvdbg.render.snapdiff import render_diff

        out = console()
        out.print(render_diff(result, full=full))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)
