"""`kvdbg diff A B`: which inputs differ (compactly: counts and the first few), which outputs differ per head."""

from __future__ import annotations

import json

from rich.console import Group
from rich.text import Text

from kvdbg.render.fit import Column, FitTable
from kvdbg.moves.snapdiff import FIRST_LISTED, KIND_SNAPSHOT, SnapDiff, StepDiff, TensorDiff

PROVENANCE_SHOWN = 6


def _fmt(value: float) -> str:
    if value != value:
        return "nan"
    return "0" if value == 0 else format(value, ".2e")


def _value(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _listed(items: list[str], total: int) -> str:
    text = ", ".join(items[:FIRST_LISTED])
    return text + (f", … {total - FIRST_LISTED} more (--json)" if total > FIRST_LISTED else "")


def _same(text: str = "same") -> Text:
    return Text(text, style="green")


def _differ(text: str) -> Text:
    return Text(text, style="red")


def _lengths(pairs: list[tuple[int, int, int]], total: int) -> Text:
    if not pairs:
        return _same()
    return _differ(f"{len(pairs)} of {total} request(s) differ: "
                   + _listed([f"request {r} {a} → {b}" for r, a, b in pairs], len(pairs)))


def _tables(s: StepDiff) -> Text:
    width = "" if s.table_width[0] == s.table_width[1] else f"width {s.table_width[0]} → {s.table_width[1]}; "
    if s.moved_entries:
        text = (f"{width}{s.moved_entries} of {s.live_entries} live entries at other engine ids (placement: pages "
                "are compared by logical position)")
    else:
        text = f"{width}the {s.live_entries} live entries hold the same engine ids"
    if s.stale_differ:
        text += f"; {s.stale_differ} entries past the live ones differ"
    return Text(text, style="yellow" if width or s.stale_differ or s.moved_entries else "green")


def _pages(s: StepDiff) -> Text:
    head = f"{s.logical_pages} logical page(s) ({s.page_pairs} page pair(s)) compared over their live keys"
    if not s.pages_differ:
        return _same(f"{head}: same")
    shown = [f"request {p.request} page {p.logical_page} (A {p.page_a}, B {p.page_b}) {p.tokens} token(s)"
             + (f", shared by {p.shared_by}" if p.shared_by > 1 else "") for p in s.pages]
    return _differ(f"{head}: {s.pages_differ} differ ({s.slots_differ} slot(s), max abs {_fmt(s.pages_max_abs)}): "
                   + _listed(shown, len(s.pages)))


def _tensor(t: TensorDiff) -> Text:
    if t.missing:
        return Text(f"only in {'B' if t.missing == 'A' else 'A'}: not compared", style="yellow")
    if not t.differ:
        return _same(f"same ({t.tokens} token(s))")
    return _differ(f"{len(t.differ)} of {t.tokens} token(s) differ (max abs {_fmt(t.max_abs)}): tokens "
                   + _listed([str(x) for x in t.differ], len(t.differ)))


def render_inputs(result: SnapDiff) -> FitTable:
    table = FitTable([Column("input", priority=10, min_width=14), Column("A → B", priority=9, min_width=30)],
                     title=Text("inputs", style="bold"))
    for f in result.meta:
        table.add_row(f.name, _differ(f"{_value(f.a)} → {_value(f.b)}"))
    if result.kind != KIND_SNAPSHOT:
        if not result.meta:
            table.add_row("layer", _same())
        return table
    if not result.meta:
        table.add_row("metadata", _same("same layer, backend, layout and scales"))
    for s in result.steps:
        p = f"step {s.step} "
        table.add_row(p + "seq_lens", _lengths(s.seq_lens, s.requests))
        if s.query_lens:
            table.add_row(p + "query lengths", _lengths(s.query_lens, s.requests))
        table.add_row(p + "block table", _tables(s))
        table.add_row(p + "pages", _pages(s))
        for t in s.tensors:
            table.add_row(p + t.name, _tensor(t))
        if any(t.name == "key" for t in s.tensors) and not any(t.name == "slot_mapping" for t in s.tensors):
            table.add_row(p + "slot_mapping", _same("same logical positions") if not s.slots_moved else _differ(
                f"{len(s.slots_moved)} token(s) written to another logical position: tokens "
                + _listed([str(x) for x in s.slots_moved], len(s.slots_moved))))
    return table


def render_diff(result: SnapDiff, *, full: bool = False) -> Group:
    from kvdbg.render.replay import render_comparison

    parts: list = [Text(f"A: {result.path_a}\nB: {result.path_b}", style="dim"), render_inputs(result)]
    if result.provenance:
        shown = [f"{f.name} {_value(f.a)} → {_value(f.b)}" for f in result.provenance[:PROVENANCE_SHOWN]]
        more = len(result.provenance) - len(shown)
        parts.append(Text("provenance (not an input): " + "; ".join(shown) + (f"; … {more} more (--json)" if more
                                                                               else ""), style="dim"))
    for comp in result.outputs:
        if comp.heads and comp.passed and not full:
            parts.append(Text(f"step {comp.step}: {comp.actual} vs {comp.expected} — same within tolerance "
                              f"({len(comp.heads)} heads, max abs {_fmt(comp.max_abs)})", style="green"))
        else:
            parts.append(render_comparison(comp, full=full))
    for note in result.notes:
        parts.append(Text(note, style="yellow"))
    rules = sorted({(c.tolerance.rule, c.tolerance.source) for c in result.outputs})
    if rules:
        parts.append(Text("outputs: A is the expected side; an element passes when " + "; ".join(
            f"{rule} ({source})" for rule, source in rules) + "; NaN or inf on either side always fails",
            style="dim"))
    return Group(*parts)


__all__ = ["render_diff", "render_inputs"]
