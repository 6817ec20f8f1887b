"""Small formatting helpers shared by the renderers."""

from __future__ import annotations


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def elide(values: list, keep_head: int = 6, keep_tail: int = 2, full: bool = False) -> str:
    """Join values with spaces, eliding the middle of long runs: ``3 5 1 … 6``."""
    items = [str(v) for v in values]
    if full or len(items) <= keep_head + keep_tail + 1:
        return " ".join(items)
    return " ".join(items[:keep_head] + ["…"] + items[-keep_tail:])


def verdict_line(verdict):
    """The verdict as the last line of a command's output, with the exit code it gives."""
    from rich.text import Text

    style = {"pass": "bold green", "fail": "bold red"}.get(verdict.status, "bold yellow")
    return Text(f"{verdict.summary} (exit {verdict.exit_code})", style=style)
