"""The `kvdbg conform` table: feature combination × batch kind → pass / FAIL / refused, then what each means."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdbg.moves.conform.run import FAIL, PASS, REFUSED, BackendConform, Cell, ConformResult, failure_kind
from kvdbg.render.fit import Column, FitTable

STYLES = {PASS: "green", FAIL: "bold red", REFUSED: "dim"}


def _num(value: float | None) -> str:
    return "nan" if value is None or value != value else ("0" if value == 0 else format(value, ".1e"))


def cell_text(cell: Cell, refusal_note: dict[str, int]) -> str:
    """``pass 2.4e-04`` / ``FAIL 1.2e-01 r1h3`` (the first wrong request and head) / ``refused [2]``."""
    if cell.status == PASS:
        return f"pass {_num(cell.max_abs)}"
    if cell.status == FAIL:
        where = f" r{cell.first['request']}h{cell.first['head']}" if cell.first else ""
        kind = failure_kind(cell.status, cell.max_abs, cell.reason)  # no finite error: what it was instead
        shown = _num(cell.max_abs) if kind is None else kind
        return f"FAIL{' ' + shown if shown else ''}{where}"
    return f"refused [{refusal_note[cell.reason or '']}]"


def render_backend(result: BackendConform) -> Group:
    rows = result.rows_note() or f"{len(result.rows)} rows"
    title = Text(f"conform: {result.backend} ({result.matrix}, {rows} × {len(result.kinds)} batch kinds)",
                 style="bold")
    if result.reason is not None:
        return Group(title, Text(f"not run: {result.reason}", style="yellow"))
    stopped = None
    if result.interrupted:
        ran = sum(not c.probe for c in result.cells)
        stopped = Text(f"interrupted: {ran} of {result.planned} cells ran (blank: not run); failing cells "
                       "found before the stop are listed, unexplained where it came first", style="yellow")
    notes: dict[str, int] = {}
    for cell in result.cells:
        if cell.status == REFUSED:
            notes.setdefault(cell.reason or "", len(notes) + 1)
    table = FitTable([Column("#", whole=True, priority=30), Column("combination", priority=20, min_width=16)]
                     + [Column(kind, whole=True, justify="left", priority=15) for kind in result.kinds])
    by_row: dict[int, dict[str, Cell]] = {}
    for cell in result.cells:
        by_row.setdefault(cell.row_id, {})[cell.kind] = cell
    for row_id, cells in sorted(by_row.items()):
        first = next(iter(cells.values()))
        table.add_row(str(row_id), first.label, *(Text(cell_text(cells[k], notes), style=STYLES[cells[k].status])
                                                  if k in cells else "" for k in result.kinds))
    parts: list = [title, table]  # the title above, not in the table: a narrow table would wrap it
    if stopped is not None:
        parts.insert(1, stopped)
    failing = [c for c in result.cells if c.status == FAIL]
    if failing:
        parts.append(Text("failing cells:", style="bold"))
        for cell in failing:
            parts.extend(Text(line, style=style) for line, style in _failure_lines(cell))
    if notes:
        parts.append(Text("refused by the backend:", style="bold"))
        parts.extend(Text(f"  [{n}] {reason}", style="dim") for reason, n in notes.items())
    counts = result.counts()
    jobs = f" on {result.jobs} workers" if result.jobs > 1 else ""
    builds = (f"; {result.built_runs} of them built kernels (JIT), {result.build_seconds:.0f} s of their "
              f"{result.cell_seconds:.0f} s in replays" if result.built_runs else "")
    parts.append(Text(f"{result.backend}: {counts[PASS]} pass, {counts[FAIL]} FAIL, {counts[REFUSED]} refused; "
                      f"{result.runs} replays in {result.seconds:.0f} s{jobs}{builds}", style="dim"))
    return Group(*parts)


def _failure_lines(cell: Cell) -> list[tuple[str, str]]:
    from kvdbg.moves.conform.matrix import label

    lines = [(f"  #{cell.row_id} {cell.kind}: {cell.label}", "red")]
    if cell.first:
        f = cell.first
        lines.append((f"    first wrong: step {f['step']} request {f['request']} head {f['head']} (token "
                      f"{f['token']}, max abs {_num(f.get('max_abs'))}); max abs {_num(cell.max_abs)}", ""))
    if cell.reason:
        lines.append((f"    {cell.reason}", ""))
    if cell.cause:
        lines.append((f"    {cell.cause}: {cell.cause_detail}", "bold" if cell.cause == "semantic" else ""))
    if cell.minimal is not None:
        lines.append((f"    smallest combination that still fails: {label(cell.minimal)}", ""))
    if cell.snapshot_path:
        lines.append((f"    snapshot: {cell.snapshot_path}"
                      + (f"; minimal: {cell.minimal_path}" if cell.minimal_path else ""), "dim"))
    return lines


def render_conform(result: ConformResult) -> Group:
    parts: list = []
    for backend in result.backends:
        parts.append(render_backend(backend))
    parts.append(Text("cells: pass / FAIL with the max abs error against the exact reference (replay's tolerance "
                      "for the dtype) and the first wrong request r and head h (FAIL raised / non-finite: the "
                      "backend raised, or wrote NaN/inf) / refused by the backend's own checks; rows: a pairwise covering array of the levels each backend took alone "
                      "(docs/conform.md)", style="dim"))
    return Group(*parts)


class ConformBar:
    """Cells done of all, and the ETA, on stderr while conform runs (a terminal only); gone when it ends."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("conform"), BarColumn(bar_width=20), MofNCompleteColumn(), TextColumn("ETA"),
                             TimeRemainingColumn(), TextColumn("{task.fields[what]}", style="dim"), console=console,
                             transient=True)
        self._task = None
        self._backend = None

    def __call__(self, done: int, total: int, what: str) -> None:
        backend = what.split(" ", 1)[0]
        if self._task is None or backend != self._backend:
            if self._task is not None:
                self._bar.remove_task(self._task)
            else:
                self._bar.start()
            self._backend = backend
            self._task = self._bar.add_task("conform", total=total, what="")
        self._bar.update(self._task, completed=done, total=total, what=what[:40])

    def close(self) -> None:
        if self._task is not None:
            self._bar.stop()


class ConformLines:
    """Progress where stderr is not a terminal (a log, CI, a remote run): one plain line per cell or stage,
    ``conform [12/57 0:41 ETA 1:23] TRITON_ATTN window=short (mixed): pass``, flushed at once, so a run cut
    short still shows how far it got and what each cell gave."""

    def __init__(self, stream=None, clock=None):
        import sys
        import time

        self._stream = stream or sys.stderr
        self._clock = clock or time.monotonic
        self._start = self._clock()
        self._phase_start, self._phase = self._start, None

    def __call__(self, done: int, total: int, what: str) -> None:
        if not total:  # "loading the engine": silent, so that a backend that cannot load ends on one line
            return
        now = self._clock()
        phase = (what.split(" ", 1)[0], total)
        if phase != self._phase:
            self._phase, self._phase_start = phase, now
        where = f"{done}/{total} "
        eta = ""
        if 0 < done < total:
            eta = f" ETA {_clock_text((now - self._phase_start) / done * (total - done))}"
        self._stream.write(f"conform [{where}{_clock_text(now - self._start)}{eta}] {what}\n")
        self._stream.flush()

    def close(self) -> None:
        pass


def _clock_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


__all__ = ["ConformBar", "ConformLines", "cell_text", "render_backend", "render_conform"]
