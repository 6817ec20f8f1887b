"""`kvdbg attention [SNAP]`: where one query token's attention went, the reference against each backend."""

from __future__ import annotations

import sys
from dataclasses import replace

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

    The verdict is the snapshot's, by kvdbg's one rule (the replay's
    comparisons and error findings), with what the weights show added as
    findings: exit 1 when the replay fails, or a counted column reads a key
    holding NaN/Inf, gives weight outside the exact mask beyond its backend's
    documented behaviour, skips keys the reference weights, or its weights do
    not reproduce its output. The extra keys of FLASHINFER_TS's page-aligned
    window restriction are documented behaviour: stated with their share of
    the weight, never a failure by themselves.

    \b
    Examples:
      kvdbg attention
      kvdbg attention fixtures/prefix_page0.safetensors --svg attention.svg
      kvdbg attention snap.safetensors --request 3 --head 5 --token 7 --json
    """
    from kvdbg import api
    from kvdbg.render.attention import AttentionText, attention_drawing

    check_picture_paths(svg_path, png_path, force=force)
    path = api.load(snapshot or default_snapshot())
    progress = progress_printer("attention:")
    named = list(backend) or None
    # The replay the picture is chosen from and held against is also the one the verdict judges: the
    # snapshot's verdict (kvdbg.judge.verdict.judge) with what the weights show added as findings.
    steps = None if step is None or None in (request, head, token) else [step]
    report = api.replay(path, named, device=device, steps=steps, progress=progress)
    picture = api.attention(path, named, step=step, request=request, head=head, token=token,
                            device=device, report=report, progress=progress)
    written = write_pictures(lambda: attention_drawing(picture), svg_path, png_path, force=force)
    verdict = attention_verdict(picture, report)
    if as_json:
        emit_json({**picture.to_json(), "findings": [f.to_json() for f in attention_findings(picture)],
                   "verdict": verdict.to_json()})
    else:
        out = console()
        out.print(AttentionText(picture))
        for path in written:
            out.print(f"picture written to {path}", style="dim")
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def attention_findings(picture) -> list:
    """What the weights of the pictured token show, as registered findings: reading NaN/Inf, weighting keys
    outside the exact mask beyond the backend's documented behaviour, skipping exact keys, weights that do not
    reproduce the output (errors), and the documented extra keys of FLASHINFER_TS's restriction with their
    share of the weight (a warning). A NaN mass is a share of unknown size, never "none"."""
    from kvdbg.judge.findings import Finding

    def some(mass: float, count: int) -> bool:
        return mass > 0 or (mass != mass and count > 0)

    def share(mass: float) -> str:
        return "a NaN share" if mass != mass else f"{mass:.2e}"

    where = f"request {picture.request}, head {picture.head}, token {picture.token}"
    found = []

    def at(backend: str, text: str, **details) -> dict:
        return {"backend": backend, "step": picture.step, "request": picture.request,
                "message": f"{where}: {text}", "details": details}

    if picture.query_nonfinite:
        found.append(Finding(code="reads_nonfinite", **at("replay", "the query token holds NaN/Inf: every logit "
                                                                    "is NaN")))
    for c in picture.columns:
        if c.weights is None:
            continue
        if c.nonfinite_k_count:
            found.append(Finding(code="reads_nonfinite", **at(c.backend, f"{c.backend} attends "
                                 f"{_keys(c.nonfinite_k_read, c.nonfinite_k_count)} whose K holds NaN/Inf: its "
                                 "weights are NaN")))
        if c.nonfinite_v_count:
            found.append(Finding(code="reads_nonfinite", **at(c.backend, f"{c.backend} attends "
                                 f"{_keys(c.nonfinite_v_read, c.nonfinite_v_count)} whose V holds NaN/Inf: its "
                                 "Σw·v is NaN")))
        undocumented = c.forbidden_count - c.documented_count
        if undocumented > 0 and some(c.forbidden_mass - c.documented_mass, undocumented):
            mass = c.forbidden_mass - c.documented_mass
            found.append(Finding(code="weights_outside_mask", **at(
                c.backend, f"{c.backend} gives {share(mass)} of its weight to {undocumented} key(s) outside the "
                "exact mask", mass=mass, keys=undocumented)))
        if c.documented_count:
            found.append(Finding(code="window_restriction_extra_keys", **at(
                c.backend, f"{c.backend} gives {share(c.documented_mass)} of its weight to {c.documented_count} "
                "key(s) outside the exact mask that FLASHINFER_TS's page-aligned window restriction shows by design",
                mass=c.documented_mass, keys=c.documented_count)))
        if some(c.missed_mass, c.missed_count):
            found.append(Finding(code="skips_mask_keys", **at(
                c.backend, f"{c.backend} skips {c.missed_count} key(s) holding {share(c.missed_mass)} of the "
                "reference's weight", mass=c.missed_mass, keys=c.missed_count)))
        if c.reproduces is False:
            diff = "nan" if c.output_diff is None or c.output_diff != c.output_diff else f"{c.output_diff:.2e}"
            found.append(Finding(code="weights_miss_output", **at(
                c.backend, f"{c.backend}'s weights do not reproduce its output ({diff})")))
    return found


def attention_verdict(picture, report=None):
    """kvdbg.judge.verdict.judge over the replay's comparisons and findings (``report``) and what the pictured
    token's weights show (:func:`attention_findings`): the same verdict as `kvdbg replay` gives the snapshot,
    unless the weights show an error the replay did not."""
    from kvdbg.judge.verdict import judge

    found = attention_findings(picture)
    comparisons = report.comparisons if report is not None else []
    findings = (report.findings if report is not None else []) + found
    counted = report.result.counted if report is not None else None
    verdict = judge(comparisons, findings, counted)
    where = f"request {picture.request}, head {picture.head}, token {picture.token} of step {picture.step}"
    mine = [f for f in found if f.severity == "error" and (counted is None or f.backend in counted)]
    if mine:
        told = "; ".join(f.message.split(": ", 1)[1] for f in mine)
        return replace(verdict, summary=f"{verdict.summary}; at {where}: {told}")
    by_design = [f for f in found if f.code == "window_restriction_extra_keys"]
    note = (f"; at {where}: " + "; ".join(f.message.split(": ", 1)[1] for f in by_design)
            + " (documented, not a failure)") if by_design else ""
    if not found:
        note = f"; at {where}: every column weights exactly the keys of the exact mask"
    return replace(verdict, summary=f"{verdict.summary}{note}")


def _keys(first: list[int], count: int) -> str:
    """``key 53`` / ``3 keys (53, 54, 60)`` / ``40 keys (53, 54, 55, 56, …)``."""
    if count == 1 and first:
        return f"key {first[0]}"
    shown = ", ".join(map(str, first[:4]))
    return f"{count} keys ({shown}{', …' if count > 4 else ''})"
