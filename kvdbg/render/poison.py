"""Tables for `kvdbg poison`: per backend, each poisoned region and the outputs it turned NaN."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdbg.moves.poisoner import REGION_MEANING, BackendPoison, PoisonResult, RegionResult
from kvdbg.render.fit import Column, FitTable

STATUS_STYLES = {"reads poisoned": "bold red", "reads by design": "cyan", "loads masked": "yellow", "clean": "green", "empty": "dim",
                 "not run": "yellow"}
# Culprit lines listed under a table; the rest are counted (--json lists them all).
CULPRITS_SHOWN = 8


def _counts(outputs) -> str:
    if not outputs:
        return "-"
    requests = len({r for r, _, _ in outputs})
    heads = len({(r, h) for r, h, _ in outputs})
    tokens = len({(r, t) for r, _, t in outputs})
    return f"{requests}/{heads}/{tokens}"


def render_poison(result: PoisonResult) -> Group:
    parts: list = []
    several = len(result.steps) > 1
    for step in result.steps:
        for record in step.backends:
            parts.append(_backend(record, several))
    parts.append(Text("regions: " + "; ".join(f"{name}: {text}" for name, text in REGION_MEANING.items()),
                      style="dim"))
    parts.append(Text("outputs: requests/heads/tokens turned NaN. NaN keys → outputs: the backend weights a "
                      "slot it must not read (a finding). NaN values → outputs, beyond those: it loads the slot "
                      "under a zero weight, 0 x NaN (\"loads masked\", not a finding)", style="dim"))
    return Group(*parts)


def _backend(record: BackendPoison, several: bool):
    title = f"{record.backend}" + (f", step {record.step}" if several else "")
    if not record.ran:
        return Text(f"{title}: not run — {record.reason}", style="yellow")
    table = FitTable([Column("region", priority=10), Column("slots", whole=True, priority=9),
                      Column("NaN keys→ outputs", whole=True, priority=8),
                      Column("NaN values→ outputs", whole=True, priority=6),
                      Column("verdict", priority=10, min_width=8)],
                     title=Text(f"{title}: {_summary(record)}", style="bold"))
    for r in record.regions:
        table.add_row(r.region, str(r.slots), _counts(r.outputs) if r.slots else "",
                      _counts(r.masked_outputs) if r.slots else "", Text(r.status, style=STATUS_STYLES[r.status]))
    lines: list = [table]
    if record.baseline_nonfinite:
        lines.append(Text(f"  {record.baseline_nonfinite} (token, head) output(s) were already non-finite or "
                          "unwritten without poison: they cannot show a read and are left out", style="yellow"))
    for r in record.regions:
        lines.extend(_culprits(r))
    return Group(*lines)


def _summary(record: BackendPoison) -> str:
    if record.reads_poisoned:
        return "reads poisoned slots"
    if record.reads_by_design:
        return "reads only keys its documented window restriction shows"
    if not any(r.slots for r in record.regions):
        return "nothing to poison"
    return "reads nothing poisoned" + (" (loads some under a zero weight)" if record.loads_masked else "")


def _culprits(r: RegionResult) -> list:
    if not r.culprits:
        return []
    out = [Text(f"  {r.region}: {r.tokens} query token(s) weight these slots:", style="red")]
    for c in r.culprits[:CULPRITS_SHOWN]:
        out.append(Text(f"    {c.label}", style="red"))
    if len(r.culprits) > CULPRITS_SHOWN:
        out.append(Text(f"    … {len(r.culprits) - CULPRITS_SHOWN} more (--json)", style="red"))
    if r.note:
        out.append(Text(f"    {r.note}", style="yellow"))
    return out
