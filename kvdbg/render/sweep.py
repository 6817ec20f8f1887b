"""The `kvdbg sweep` matrix: variants × backends, pass/fail and max error, the cells that flip marked."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdbg.render.fit import Column, FitTable
from kvdbg.moves.sweeper import KNOB_MEANING, Cell, SweepResult, SweepRow

FLIP_MARK = "▶"
CELL_STYLES = {"pass": "green", "fail": "bold red", "n/a": "dim", "moves": "cyan", "baseline": "dim"}


def _fmt(value: float | None) -> str:
    if value is None or value != value:
        return "nan"
    return "0" if value == 0 else format(value, ".1e")


def cell_text(cell: Cell) -> str:
    """``pass 6.7e-04`` / ``FAIL 2.4e-01`` / ``Δ 6.9e-02`` (the exact answer's shift) / ``n/a``."""
    if cell.status in ("pass", "fail"):
        word = "pass" if cell.status == "pass" else "FAIL"
        text = word if cell.max_abs is None else f"{word} {_fmt(cell.max_abs)}"
    elif cell.status == "moves":
        text = f"Δ {_fmt(cell.max_abs)}"
    else:
        text = cell.status
    return (FLIP_MARK + text) if cell.flipped else text


def column_header(name: str, counted: bool) -> str:
    return name if counted else f"{name} (what-if)"


def render_sweep(result: SweepResult) -> Group:
    columns = result.columns
    table = FitTable([Column("variant", priority=20, min_width=14)]
                     + [Column(column_header(c.name, c.counted), whole=True, justify="left",
                               priority=15 if c.counted else 5) for c in columns],
                     title=Text(f"sweep: {', '.join(result.knobs)}", style="bold"))
    for row in result.rows:
        label = Text(row.variant.name, style="bold" if row.flipped else "")
        cells = []
        for c in columns:
            cell = row.cells[c.name]
            style = "bold reverse" if cell.flipped else CELL_STYLES.get(cell.status, "")
            cells.append(Text(cell_text(cell), style=style))
        table.add_row(label, *cells)
    parts: list = [table]
    parts.extend(_notes(result))
    return Group(*parts)


def _notes(result: SweepResult) -> list:
    out: list = []
    lines = []
    for row in result.rows:
        lines.extend(_row_notes(row, result.baseline))
    if lines:
        out.append(Text("notes:", style="bold"))
        out.extend(Text(f"  {line}", style=style) for line, style in lines)
    if result.unavailable:
        out.append(Text("no column (cannot run this snapshot): " + "; ".join(
            f"{name}: {why}" for name, why in result.unavailable), style="yellow"))
    out.append(Text("cells: pass/FAIL and the max abs error against the variant's own reference (captured: the "
                    "engine's output against it); reference: against the baseline's reference, Δ where the knob "
                    "changes the exact answer (its size, not a verdict); n/a: not compared (notes say why); "
                    f"{FLIP_MARK}: the verdict flips relative to the baseline row", style="dim"))
    out.append(Text("knobs: " + "; ".join(f"{k}: {KNOB_MEANING[k]}" for k in result.knobs), style="dim"))
    return out


def _row_notes(row: SweepRow, baseline: SweepRow) -> list[tuple[str, str]]:
    """Why cells failed or were not compared; a failure the baseline row already explains is not repeated."""
    name = row.variant.name
    if row.error:
        return [(f"{name}: could not replay: {row.error}", "red")]
    if row.variant.skipped is not None:
        return [(f"{name}: not run: {row.variant.skipped}", "yellow" if row.variant.unavailable_here else "dim")]
    out = []
    for cell in row.cells.values():
        same = row is not baseline and baseline.cells.get(cell.column) is not None and \
            baseline.cells[cell.column].reason == cell.reason and baseline.cells[cell.column].status == cell.status
        if same:
            continue
        if cell.status == "fail" and cell.reason:
            out.append((f"{name}: {cell.column} {cell.reason}", "red"))
        elif cell.status == "n/a" and cell.reason and cell.column != "captured":
            out.append((f"{name}: {cell.column} not compared: {cell.reason}", "dim"))
    if row.input_errors:
        out.append((f"{name}: error finding(s) about the inputs: {', '.join(row.input_errors)}", "red"))
    return out


def sweep_markdown(result: SweepResult, verdict) -> str:
    """The matrix as a Markdown section body (for `kvdbg report --sweep`)."""
    from kvdbg.render.markdown import md_escape, md_table

    headers = ["variant"] + [column_header(c.name, c.counted) for c in result.columns]
    rows = []
    for row in result.rows:
        cells = [cell_text(row.cells[c.name]) for c in result.columns]
        rows.append([md_escape(row.variant.name)] + [f"**{md_escape(t)}**" if row.cells[c.name].flipped
                                                     else md_escape(t) for t, c in zip(cells, result.columns)])
    parts = [md_table(headers, rows)]
    notes = [line for row in result.rows for line, _ in _row_notes(row, result.baseline)]
    if notes:
        parts.append("\n".join(f"- {md_escape(n)}" for n in notes))
    parts.append(md_escape("Cells: pass/FAIL and the max abs error against the variant's own reference (captured: "
                           "the engine's output against it); reference: against the baseline's reference, Δ where "
                           f"the knob changes the exact answer; {FLIP_MARK} (bold): the verdict flips relative to "
                           "the baseline row."))
    parts.append(f"**Sweep verdict:** {md_escape(verdict.summary)} (`kvdbg sweep` exits {verdict.exit_code}).")
    return "\n\n".join(parts)


__all__ = ["cell_text", "render_sweep", "sweep_markdown"]
