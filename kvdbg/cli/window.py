"""`kvdbg window` (no snapshot, no torch)."""

from __future__ import annotations

import os
import sys

import click

from kvdbg.cli.common import (console, emit_json, force_option, full_option, guarded, json_option, print_verdict,
                              request_option, simple_verdict, step_option)
from kvdbg.errors import OptionError

# The analysis holds one row per query token (and --full draws each); a decode
# query block, even a drafter's, is a few dozen tokens; a billion would hang.
MAX_QUERY_LEN = 4096


# Options that describe the request by hand; a snapshot gives all of them.
HAND_OPTIONS = ("--seq-len", "--window", "--query-len", "--page-size", "--mask", "--max-model-len",
                "--max-decode-query-len")


@click.command()
@click.argument("snapshot", required=False, type=click.Path(dir_okay=False))
@request_option(one="window analyses one request of SNAPSHOT", default_help="the longest")
@step_option(one="window reads one step of SNAPSHOT", default_help="0")
@click.option("--seq-len", type=int, default=None, help="Request length L, query block included (without SNAPSHOT).")
@click.option("--window", type=int, default=None, help="Sliding window w (omit for a full-attention layer).")
@click.option("--query-len", type=int, default=None, help="Query tokens per request (draft block) [default: 1].")
@click.option("--page-size", type=int, default=None, help="Tokens per KV page [default: 16].")
@click.option("--mask", type=click.Choice(["dense", "causal"]), default=None,
              help="dense: non-causal draft block; causal: ordinary decode [default: dense].")
@click.option("--max-model-len", type=int, default=None, help="Engine max_model_len [default: max(32768, L)].")
@click.option("--max-decode-query-len", type=int, default=None,
              help="Longest query block the backend is built for [default: --query-len].")
@full_option("List every query token, not just both ends.")
@click.option("--picture", is_flag=True,
              help="Also draw the query x key grid of the request: the exact mask, what FLASHINFER_TS's kernel "
                   "attends to, and (with SNAPSHOT) what flex's BlockMask and mask_mod let through.")
@click.option("--svg", "svg_path", default=None, type=click.Path(dir_okay=False),
              help="Write that picture as SVG to this file (atomically).")
@click.option("--png", "png_path", default=None, type=click.Path(dir_okay=False),
              help="Write that picture as PNG to this file (atomically; needs the plot extra: pip install 'kvdbg[plot]').")
@force_option()
@json_option
@guarded
def window(snapshot, request, step, seq_len, window, query_len, page_size, mask, max_model_len,
           max_decode_query_len, full, picture, svg_path, png_path, force, as_json):
    """Show what FLASHINFER_TS's window restriction hands the prims_ts kernel.

    Give either SNAPSHOT (L, window, q, page size, mask, max_model_len and
    max_decode_query_len are read from its header and the step's lengths; no
    KV page is loaded) or --seq-len and the other numbers by hand.

    Compares, for each query token, the exact sliding window with the keys the
    kernel really sees after the builder's page-aligned restriction, draws the
    pages around the window's old edge, and checks every kernel precondition
    the builder's output must meet. Exit 1 when a token misses keys of its
    window or a precondition is broken. With SNAPSHOT, the verdict judges the
    inputs of every request of the step by kvdbg's one rule, as `kvdbg map`
    does (FLASHINFER_TS's findings count for a FLASHINFER_TS snapshot, the
    paging findings for a FLEX_ATTENTION one); the extra keys of the
    page-aligned restriction are FLASHINFER_TS's documented behaviour, never
    a failure by themselves.

    \b
    Examples:
      kvdbg window --seq-len 9000 --window 4096 --query-len 8
      kvdbg window --seq-len 9000 --window 4096 --query-len 8 --mask causal --json
      kvdbg window snapshot.safetensors --request 1 --step 0
      kvdbg window snapshot.safetensors --picture --svg window.svg
    """
    from kvdbg.ts.window import analyze_window

    source = None
    hand = [name for name, value in zip(HAND_OPTIONS, (seq_len, window, query_len, page_size, mask, max_model_len,
                                                       max_decode_query_len)) if value is not None]
    if snapshot is not None:
        if hand:
            raise OptionError(f"{hand[0]} cannot be combined with SNAPSHOT, which gives it (give one or the other)")
        from kvdbg.moves.window_source import window_source

        source = window_source(snapshot, step=step, request=request)
        seq_len, window, query_len, page_size = source.seq_len, source.window, source.query_len, source.page_size
        mask = "causal" if source.causal else "dense"
        max_model_len, max_decode_query_len = source.max_model_len, source.max_decode_query_len
    else:
        for name, value in (("--request", request), ("--step", step)):
            if value is not None:
                raise OptionError(f"{name} needs SNAPSHOT (it picks a request of a snapshot)")
        if seq_len is None:
            raise OptionError("give SNAPSHOT, or --seq-len (with --window, --query-len, ...)")
        query_len = 1 if query_len is None else query_len
        page_size = 16 if page_size is None else page_size
        mask = mask or "dense"
    if query_len > MAX_QUERY_LEN:
        raise OptionError(f"--query-len {query_len} is over {MAX_QUERY_LEN}, longer than any decode query block")
    try:
        analysis = analyze_window(
            seq_len, window, query_len=query_len, page_size=page_size, causal=(mask == "causal"),
            max_model_len=max_model_len, max_decode_query_len=max_decode_query_len,
        )
    except OptionError as exc:
        if source is None:
            raise
        raise OptionError(f"{source_label(source)}: {exc}".replace("--", "")) from None
    if source is not None and source.non_uniform and not source.not_applicable:
        from kvdbg.judge.findings import Finding

        analysis.findings.append(Finding(code="non_uniform_query_blocks", backend="flashinfer_ts",
                                         message=source.non_uniform))
    verdict = window_verdict(analysis, source)
    drawn = None
    if picture or svg_path or png_path:
        drawn = draw_picture(analysis, source, snapshot, svg_path=svg_path, png_path=png_path, force=force)
    if as_json:
        record = analysis.to_json()
        if source is not None:
            record["source"] = source.to_json()
        if drawn is not None:
            record["picture"] = drawn.to_json()
        emit_json({**record, "verdict": verdict.to_json()})
    else:
        from kvdbg.render.window import render_window

        out = console()
        if source is not None:
            out.print(source_label(source))
        out.print(render_window(analysis, full=full))
        if picture:
            from kvdbg.render.picture import PictureText

            out.print(PictureText(drawn))
        for path in (svg_path, png_path):
            if path:
                out.print(f"picture written to {path}", style="dim")
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def draw_picture(analysis, source, snapshot, *, svg_path, png_path, force):
    """The grids of the analysed request (flex's only with a snapshot: it needs the block table); files written."""
    from kvdbg.util.atomic import atomic_write, write_text_atomic
    from kvdbg.moves.picture import picture

    from kvdbg.cli.common import check_picture_paths

    check_picture_paths(svg_path, png_path, force=force)
    tables = None
    if source is not None:
        from kvdbg.moves.window_source import step_tables

        tables = step_tables(snapshot, source.step)
    drawn = picture(analysis, tables, None if source is None else source.request)
    if svg_path:
        from kvdbg.render.drawing import svg_text

        write_text_atomic(svg_path, svg_text(drawn), overwrite=force, what="--svg")
    if png_path:
        from kvdbg.render.drawing import png_bytes

        data = png_bytes(drawn)
        atomic_write(png_path, lambda fh: fh.write(data), overwrite=force, what="--png")
    return drawn


def source_label(source) -> str:
    which = f"request {source.request} of {source.num_reqs}" + (" (the longest)" if source.longest else "")
    return f"{source.path}: step {source.step} of {source.num_steps}, {which}"


def window_verdict(analysis, source=None):
    """kvdbg.judge.verdict's rule over the input findings: with SNAPSHOT, those of every request of the step
    (`map` judges the same ones), counted as a replay counts them; by hand, the analysed request's."""
    from kvdbg.judge.verdict import EXIT_NOTHING_VERIFIED, inputs_verdict

    if source is not None and source.not_applicable:
        # As `kvdbg replay` judges the step: a batch vLLM never runs through FLASHINFER_TS says nothing about it.
        return simple_verdict("unverified", EXIT_NOTHING_VERIFIED,
                              f"NOTHING VERIFIED: FLASHINFER_TS does not run step {source.step}: "
                              f"{source.not_applicable}")
    if source is None:
        findings, counted, checked = analysis.findings, None, "the request"
    else:
        from kvdbg.moves.window_source import input_findings

        findings, counted = input_findings(source.path, steps=[source.step])
        checked = f"the inputs of step {source.step}"
    verdict = inputs_verdict(findings, counted, checked=checked)
    if not verdict.passed:
        return verdict
    extra = analysis.visibility.worst_extra
    aside = verdict.summary[verdict.summary.index("; what-if"):verdict.summary.index(" (outputs not")] \
        if "; what-if" in verdict.summary else ""
    text = ("PASS: the kernel sees every key of every exact window" + (f" (and up to {extra} extra, by design)"
                                                                       if extra else "")
            + "; every precondition holds" + aside)
    if source is not None:
        text += "; outputs not compared (kvdbg replay compares them)"
    return simple_verdict("pass", verdict.exit_code, text)
