"""Tables for `kvdbg map`."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.pagemap import PageMap, PhysicalEntry
from kvdbg.render.util import elide

MAX_REQUEST_ROWS = 32
SEVERITY_STYLES = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _p2l(entry: PhysicalEntry) -> str:
    if entry.logical == -1:
        return f"{entry.physical}→null"
    if len(entry.candidates) > 1:
        return f"{entry.physical}→{'|'.join(map(str, entry.candidates))}"
    return f"{entry.physical}→{entry.logical}"


def render_page_map(m: PageMap, *, full: bool = False) -> Group:
    title = (f"{m.path or 'snapshot'} step {m.step} of {m.num_steps}: {m.num_reqs} request(s), "
             f"page_size {m.page_size}, {m.stored_pages} stored pages")
    tables = Table(title=title, title_justify="left",
                   caption="engine page ids; stale: entries past cdiv(seq_len, page_size), ignored by current vLLM",
                   caption_justify="left")
    for col, justify in (("req", "right"), ("seq_len", "right"), ("q", "right"), ("live/width", "right"),
                         ("logical → physical (live)", "left"), ("stale tail", "left")):
        tables.add_column(col, justify=justify, overflow="fold")
    inverse = Table(title="physical → logical, as FLEX_ATTENTION derives it (page 0 is the null block)",
                    title_justify="left", caption="a|b: one physical page backs several logical pages",
                    caption_justify="left")
    inverse.add_column("req", justify="right")
    inverse.add_column("physical→logical", overflow="fold")
    rows = m.requests if full else m.requests[:MAX_REQUEST_ROWS]
    for r in rows:
        tables.add_row(str(r.request), str(r.seq_len), str(r.query_len), f"{r.live_pages}/{r.table_width}",
                       elide(r.live, full=full), Text(elide(r.stale, full=full), style="dim"))
        inverse.add_row(str(r.request), elide([_p2l(e) for e in r.physical_to_logical], full=full))
    if len(rows) < len(m.requests):
        more = f"{len(m.requests) - len(rows)} more (--full)"
        tables.add_row("…", more, "", "", "", "")
        inverse.add_row("…", more)
    return Group(tables, inverse, _anomalies(m))


def map_verdict(maps: list[PageMap]):
    """FAIL (exit 1) when an anomaly is harmful (an error), else PASS; notes and warnings never fail."""
    from kvdbg.render.util import simple_verdict
    from kvdbg.verdict import EXIT_FINDING, EXIT_OK

    errors = [a for m in maps for a in m.anomalies if a.severity == "error"]
    others = sum(len(m.anomalies) for m in maps) - len(errors)
    where = ", ".join(f"step {m.step}" for m in maps) or "no step"
    if errors:
        codes = ", ".join(sorted({a.code for a in errors}))
        return simple_verdict("fail", EXIT_FINDING,
                              f"FAIL: {len(errors)} harmful paging anomal{'y' if len(errors) == 1 else 'ies'} "
                              f"({codes}) in {where}")
    tail = f"; {others} note(s) or warning(s)" if others else ""
    return simple_verdict("pass", EXIT_OK, f"PASS: no harmful paging anomaly in {where}{tail}")


def _anomalies(m: PageMap):
    if not m.anomalies:
        return Text("no anomalies", style="green")
    t = Table(title=f"{len(m.anomalies)} anomal{'y' if len(m.anomalies) == 1 else 'ies'} "
                    f"({m.errors} harmful)", title_justify="left")
    t.add_column("severity")
    t.add_column("code")
    t.add_column("message", overflow="fold")
    for a in m.anomalies:
        t.add_row(Text(a.severity, style=SEVERITY_STYLES[a.severity]), a.code, a.message)
    return t
