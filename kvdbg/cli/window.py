"""`kvdbg window` (no snapshot, no torch)."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import console, emit_json, guarded, json_option, print_verdict, simple_verdict
from kvdbg.errors import OptionError

# The analysis holds one row per query token (and --full draws each); a decode
# query block, even a drafter's, is a few dozen tokens; a billion would hang.
MAX_QUERY_LEN = 4096


@click.command()
@click.option("--seq-len", type=int, required=True, help="Request length L, query block included.")
@click.option("--window", type=int, default=None, help="Sliding window w (omit for a full-attention layer).")
@click.option("--query-len", type=int, default=1, show_default=True, help="Query tokens per request (draft block).")
@click.option("--page-size", type=int, default=16, show_default=True, help="Tokens per KV page.")
@click.option("--mask", type=click.Choice(["dense", "causal"]), default="dense", show_default=True,
              help="dense: non-causal draft block; causal: ordinary decode.")
@click.option("--max-model-len", type=int, default=None, help="Engine max_model_len [default: max(32768, L)].")
@click.option("--max-decode-query-len", type=int, default=None,
              help="Longest query block the backend is built for [default: --query-len].")
@click.option("--full", is_flag=True, help="List every query token, not just both ends.")
@json_option
@guarded
def window(seq_len, window, query_len, page_size, mask, max_model_len, max_decode_query_len, full, as_json):
    """Show what FLASHINFER_TS's window restriction hands the prims_ts kernel.

    Compares, for each query token, the exact sliding window with the keys the
    kernel really sees after the builder's page-aligned restriction, draws the
    pages around the window's old edge, and checks every kernel precondition
    the builder's output must meet. Exit 1 when a token misses keys of its
    window or a precondition is broken.

    \b
    Examples:
      kvdbg window --seq-len 9000 --window 4096 --query-len 8
      kvdbg window --seq-len 9000 --window 4096 --query-len 8 --mask causal --json
    """
    from kvdbg.paging import analyze_window

    if query_len > MAX_QUERY_LEN:
        raise OptionError(f"--query-len {query_len} is over {MAX_QUERY_LEN}, longer than any decode query block")
    analysis = analyze_window(
        seq_len, window, query_len=query_len, page_size=page_size, causal=(mask == "causal"),
        max_model_len=max_model_len, max_decode_query_len=max_decode_query_len,
    )
    verdict = window_verdict(analysis)
    if as_json:
        emit_json({**analysis.to_json_dict(), "verdict": verdict.to_json_dict()})
    else:
        from kvdbg.render.window import render_window

        out = console()
        out.print(render_window(analysis, full=full))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def window_verdict(analysis):
    from kvdbg.verdict import EXIT_FINDING, EXIT_OK

    if analysis.findings:
        codes = ", ".join(sorted({f.code for f in analysis.findings}))
        return simple_verdict("fail", EXIT_FINDING, f"FAIL: {len(analysis.findings)} finding(s) ({codes})")
    extra = analysis.visibility.worst_extra
    return simple_verdict("pass", EXIT_OK, "PASS: the kernel sees every key of every exact window"
                          + (f" (and up to {extra} extra)" if extra else "") + "; every precondition holds")
