"""The progress bar of a run over many snapshots, on stderr: done/total, rate, ETA, failures so far.

Drawn only when stderr is a terminal (as every kvdbg progress line); a log or a
pipe gets the summary alone. Notes (a worker that died) print above the bar.
"""

from __future__ import annotations

from kvdbg.replayer.batch import STATUS_PASS


class FleetBar:
    """A kvdbg.fleet.runs.Progress drawn with rich on stderr; the bar leaves no trace once the run ends."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console
        self._bar = Progress(TextColumn("replaying"), BarColumn(bar_width=None), MofNCompleteColumn(),
                             TextColumn("{task.fields[rate]}"), TextColumn("ETA"), TimeRemainingColumn(),
                             TextColumn("{task.fields[failing]}", style="red"), console=console, transient=True)
        self._task = None
        self._failing = 0

    def begin(self, total: int, skipped: int, how: str) -> None:
        kept = f"; {skipped} kept from the results file" if skipped else ""
        self.console.print(f"{total} snapshot(s) to replay{kept}: {how}", style="dim", highlight=False)
        self._bar.start()
        self._task = self._bar.add_task("replay", total=total, rate="", failing="")

    def row(self, row, done: int, total: int) -> None:
        if row.result.status != STATUS_PASS:
            self._failing += 1
        task = self._bar.tasks[0]
        speed = task.speed
        self._bar.update(self._task, completed=done, rate=f"{speed:.1f}/s" if speed else "",
                         failing=f"{self._failing} not passing" if self._failing else "")

    def note(self, text: str) -> None:
        self._bar.console.print(text, style="yellow", highlight=False, markup=False)

    def end(self) -> None:
        self._bar.stop()


__all__ = ["FleetBar"]
