"""`kvdbg attention [SNAP]`: where one query token's attention went, the reference against each backend."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (Indices, backend_option, check_picture_paths, console, default_snapshot, device_option, emit_json,
                              force_option, guarded, json_option, picture_file_options, print_verdict,
                              progress_printer, request_option, step_option, write_pictures)


@click.command()
@click.argument("snapshot", required=False, type=click.Path(dir_okay=False))
@step_option(one="attention pictures one step", default_help="the worst head's")
@request_option(one="attention pictures one request", default_help="the worst head's")
@click.option("--head", type=Indices("attention pictures one head"), default=None, metavar="N",
              help="The query head; attention pictures one head [default: the worst head's].")
@click.option("--token", type=click.IntRange(min=0), default=None, metavar="N",
              help="The query token, by its index in the request's query block (0 .. query_len - 1) "
                   "[default: the worst head's worst token].")
@backend_option()
@device_option("Where the replay runs; the weights are computed on the CPU in float64.")
@picture_file_options("the picture")
@force_option()
@json_option
@guarded
def attention(snapshot, step, request, head, token, backend, device, svg_path, png_path, force, as_json):
    """Show where one query token's attention went: the reference's weights over
    the key positions against the weights each backend effectively applied.

    The weights are the softmax of the exact logits (float64) over the keys
    each column attends to: the exact mask for the reference, the keys left
    after FLASHINFER_TS's page-aligned window restriction, the keys flex's
    BlockMask and mask_mod let through its physical-to-logical map (the null
    block gets none). Each column's weights are held against the output the
    backend really produced in the replay (Σw·v vs output). The mass a column
    gives keys the exact mask hides, and the reference's mass on keys a column
    skips, are stated with their keys. Window bounds, page starts, the null
    block and stale table entries are marked.

    Without --step/--request/--head/--token, the snapshot is replayed and the
    worst failing head (else the worst head) and its worst token are shown.

    A key whose K or V holds NaN/Inf is listed, marked N in the picture, and
    named for every column that reads it (its weights, or its Σw·v, are NaN).

    Exit 1 when a column reads a key holding NaN/Inf, gives weight outside the
    exact mask or skips keys the reference weights, or its weights do not
    reproduce its output; else 0.

    \b
    Examples:
      kvdbg attention
      kvdbg attention fixtures/prefix_page0.safetensors --svg attention.svg
      kvdbg attention snap.safetensors --request 3 --head 5 --token 7 --json
    """
    from kvdbg import api
    from kvdbg.render.attention import AttentionText, attention_drawing

    check_picture_paths(svg_path, png_path, force=force)
    path = snapshot or default_snapshot()
    picture = api.attention(path, list(backend) or None, step=step, request=request, head=head, token=token,
                            device=device, progress=progress_printer("attention:"))
    written = write_pictures(lambda: attention_drawing(picture), svg_path, png_path, force=force)
    verdict = attention_verdict(picture)
    if as_json:
        emit_json({**picture.to_json(), "verdict": verdict.to_json()})
    else:
        out = console()
        out.print(AttentionText(picture))
        for path in written:
            out.print(f"picture written to {path}", style="dim")
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def attention_verdict(picture):
    """FAIL when a column reads a key holding NaN/Inf, weights keys outside the exact mask, skips exact keys, or
    does not reproduce its output. A NaN mass is a share of unknown size, never "none": it fails as well."""
    from kvdbg.cli.common import simple_verdict
    from kvdbg.judge.verdict import EXIT_FINDING, EXIT_OK

    def some(mass: float, count: int) -> bool:
        return mass > 0 or (mass != mass and count > 0)

    def share(mass: float) -> str:
        return "a NaN share" if mass != mass else f"{mass:.2e}"

    problems = []
    if picture.query_nonfinite:
        problems.append("the query token holds NaN/Inf: every logit is NaN")
    for c in picture.columns:
        if c.weights is None:
            continue
        if c.nonfinite_k_count:
            problems.append(f"{c.backend} attends {_keys(c.nonfinite_k_read, c.nonfinite_k_count)} whose K holds "
                            "NaN/Inf: its weights are NaN")
        if c.nonfinite_v_count:
            problems.append(f"{c.backend} attends {_keys(c.nonfinite_v_read, c.nonfinite_v_count)} whose V holds "
                            "NaN/Inf: its Σw·v is NaN")
        if some(c.forbidden_mass, c.forbidden_count):
            problems.append(f"{c.backend} gives {share(c.forbidden_mass)} of its weight to {c.forbidden_count} key(s) "
                            "outside the exact mask")
        if some(c.missed_mass, c.missed_count):
            problems.append(f"{c.backend} skips {c.missed_count} key(s) holding {share(c.missed_mass)} of the "
                            "reference's weight")
        if c.reproduces is False:
            diff = "nan" if c.output_diff is None or c.output_diff != c.output_diff else f"{c.output_diff:.2e}"
            problems.append(f"{c.backend}'s weights do not reproduce its output ({diff})")
    where = f"request {picture.request}, head {picture.head}, token {picture.token} of step {picture.step}"
    if problems:
        return simple_verdict("fail", EXIT_FINDING, f"FAIL: {where}: " + "; ".join(problems))
    return simple_verdict("pass", EXIT_OK, f"PASS: {where}: every column weights exactly the keys of the exact mask")


def _keys(first: list[int], count: int) -> str:
    """``key 53`` / ``3 keys (53, 54, 60)`` / ``40 keys (53, 54, 55, 56, …)``."""
    if count == 1 and first:
        return f"key {first[0]}"
    shown = ", ".join(map(str, first[:4]))
    return f"{count} keys ({shown}{', …' if count > 4 else ''})"
