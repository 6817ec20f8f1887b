"""Tables for `kvdbg window` (no torch)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.judge.findings import SEVERITY_STYLES, explain_hint
from kvdbg.ts.window import STRIP_LETTERS, WindowAnalysis
from kvdbg.render.fit import Column, FitTable

# Long query blocks show this many tokens at each end unless --full.
TOKEN_ROWS_EACH_END = 4

STRIP_STYLES = {
    "dropped": "dim",
    "edge": "black on yellow",
    "kept": "black on green",
    "query": "black on cyan",
    "missing": "white on red",
    "gap": "dim",
}
STRIP_MEANING = {
    "dropped": "not visible to the kernel",
    "edge": "partly inside the window (extra tokens)",
    "kept": "inside the window",
    "query": "holds query tokens",
    "missing": "needed, but its column was never copied",
}


def _range(lo: int, hi: int) -> str:
    return f"[{lo}, {hi})" if hi > lo else "∅"


def render_window(a: WindowAnalysis, *, full: bool = False) -> Group:
    return Group(_summary(a), _tokens(a, full=full), _strip(a), _findings(a))


def _summary(a: WindowAnalysis) -> Table:
    r, b, v = a.restriction, a.builder, a.visibility
    mask = "causal" if a.causal else "dense"
    title = (f"FLASHINFER_TS window: seq_len {a.seq_len}, window {a.window if a.window else 'none'}, "
             f"query_len {a.query_len}, page_size {a.page_size}, {mask} mask")
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    if a.applies:
        t.add_row("restriction", "applies: the builder drops whole pages before the window")
    else:
        t.add_row("restriction", Text(f"does not apply — {a.reason}", style="yellow"))
    if a.window is not None:
        t.add_row("window span", f"{r.span} keys (window + query_len - 1), from token {max(0, a.seq_len - r.span)}")
    if b.restricted:
        t.add_row("first kept", f"page {r.start_page}, token {r.first_kept_token}")
        t.add_row("pages", f"{r.pages_dropped} dropped, {r.pages_kept} kept of {r.pages_total}")
        t.add_row("restricted seq_len", f"{r.restricted_seq_len}")
    t.add_row("builder hands the kernel", b.note)
    t.add_row("kernel seq_len", f"{b.seq_len} ({b.pages_needed} pages)")
    t.add_row("table width", f"{b.buffer_width} columns in the buffer, {b.columns_copied} hold this request's entries")
    t.add_row("plan max_kv_len", str(b.max_kv_len))
    t.add_row("mask_type / window_left", f"{b.mask_type} / {b.window_left}")
    t.add_row("worst extra tokens", f"{v.worst_extra} (bound: page_size - 1 + query_len - 1 = "
                                    f"{a.page_size - 1 + a.query_len - 1})")
    t.add_row("shared-start drift", f"{v.drift} tokens")
    missed = Text(str(v.total_missed), style="bold red" if v.total_missed else "green")
    t.add_row("tokens missed", missed)
    return t


def _tokens(a: WindowAnalysis, *, full: bool) -> FitTable:
    t = FitTable([Column("i", whole=True, priority=10), Column("position", whole=True, priority=6),
                  Column("exact keys", whole=True, priority=9), Column("kernel keys", whole=True, priority=9),
                  Column("extra", whole=True, priority=7), Column("missed", whole=True, priority=8)],
                 title="per query token: exact window vs what the kernel sees",
                 caption="kernel keys: the keys it reads through table columns the builder filled")
    rows = a.visibility.tokens
    cut = not full and len(rows) > 2 * TOKEN_ROWS_EACH_END + 1
    shown = rows[:TOKEN_ROWS_EACH_END] + rows[-TOKEN_ROWS_EACH_END:] if cut else rows
    for n, tok in enumerate(shown):
        if cut and n == TOKEN_ROWS_EACH_END:
            t.add_row("…", "", f"{len(rows) - 2 * TOKEN_ROWS_EACH_END} more (--full)", "", "", "")
        missed = Text(str(tok.missed), style="bold red" if tok.missed else "")
        t.add_row(str(tok.index), str(tok.position), _range(tok.exact_lo, tok.exact_hi),
                  _range(tok.kernel_lo, tok.kernel_hi), str(tok.extra), missed)
    return t


class _StripRows:
    """The page strip laid out at the console's width: cells never cut, rows of cells wrap instead."""

    def __init__(self, a: WindowAnalysis):
        self.cells = [(str(c.page) if c.page is not None else _gap_label(c, a.page_size), c.kind) for c in a.strip]

    def __rich_console__(self, console, options):
        width = max(options.max_width, 8)
        labels, letters, used = Text(), Text(), 0
        for label, kind in self.cells:
            cell = max(len(label), 3)
            if used and used + cell + 1 > width:
                yield labels
                yield letters
                labels, letters, used = Text(), Text(), 0
            labels.append(label.center(cell) + " ", style="dim")
            letters.append(f" {STRIP_LETTERS[kind]} ".center(cell), style=STRIP_STYLES[kind])
            letters.append(" ")
            used += cell + 1
        if used:
            yield labels
            yield letters


def _strip(a: WindowAnalysis) -> Group:
    # The title is its own line: as a table title it wrapped to the strip's width (one word a
    # line when the strip is a single page wide).
    title = Text("pages around the window's old edge and the query block", style="italic")
    kinds = [k for k in STRIP_MEANING if any(c.kind == k for c in a.strip)]
    legend = Text("  ".join(f"{STRIP_LETTERS[k]} {_meaning(a, k)}" for k in kinds), style="dim")
    return Group(title, _StripRows(a), legend)


def _meaning(a: WindowAnalysis, kind: str) -> str:
    """The legend for one kind of page; an edge page shows extra keys only when some token really gets them."""
    if kind == "edge":
        if a.visibility.worst_extra:
            return f"partly inside the window (up to {a.visibility.worst_extra} extra keys visible to the kernel)"
        return "partly inside the window (the kernel masks the rest: 0 extra keys)"
    return STRIP_MEANING[kind]


def _gap_label(cell, page_size: int) -> str:
    first = cell.first_token // page_size
    return str(first) if cell.count == 1 else f"{first}-{first + cell.count - 1}"


def _findings(a: WindowAnalysis):
    if not a.findings:
        return Text("no findings: the kernel sees every key of every exact window", style="green")
    t = Table(title=f"{len(a.findings)} finding(s)", title_justify="left", title_style="bold red",
              caption=explain_hint(f.code for f in a.findings), caption_justify="left")
    t.add_column("code")
    t.add_column("message")
    for f in a.findings:
        t.add_row(Text(f.code, style=SEVERITY_STYLES[f.severity]), f.message)
    return t
