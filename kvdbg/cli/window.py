"""`kvdbg window` (no snapshot, no torch)."""

from __future__ import annotations

import click

from kvdbg.cli.common import console, emit_json, finish, guarded, json_option
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
    if as_json:
        emit_json(analysis.to_json_dict())
    else:
        from kvdbg.render.window import render_window

        console().print(render_window(analysis, full=full))
    finish(len(analysis.findings))
