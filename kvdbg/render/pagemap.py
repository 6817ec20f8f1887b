"""Tables for `kvdbg map`."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdbg.judge.findings import SEVERITY_STYLES, explain_hint
from kvdbg.snapshot.pagemap import PageMap, PhysicalEntry
from kvdbg.render.fit import Column, FitTable
from kvdbg.render.util import elide

MAX_REQUEST_ROWS = 32


def _p2l(entry: PhysicalEntry) -> str:
    if entry.logical == -1:
        return f"{entry.physical}→null"
    if len(entry.candidates) > 1:
        return f"{entry.physical}→{'|'.join(map(str, entry.candidates))}"
    return f"{entry.physical}→{entry.logical}"


def render_page_map(m: PageMap, *, full: bool = False) -> Group:
    title = (f"{m.path or 'snapshot'} step {m.step} of {m.num_steps}: {m.num_reqs} request(s), "
             f"page_size {m.page_size}, {m.stored_pages} stored pages")
    tables = FitTable([Column("req", whole=True, priority=10), Column("seq_len", whole=True, priority=9),
                       Column("q", whole=True, priority=7), Column("live/width", whole=True, priority=8),
                       Column("logical → physical (live)", priority=10), Column("stale tail", priority=6)],
                      title=title,
                      caption="engine page ids; stale: entries past cdiv(seq_len, page_size), ignored by current vLLM")
    inverse = FitTable([Column("req", whole=True, priority=10), Column("physical→logical", priority=9)],
                       title="physical → logical, as FLEX_ATTENTION derives it (page 0 is the null block)",
                       caption="a|b: one physical page backs several logical pages")
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


def _anomalies(m: PageMap):
    if not m.anomalies:
        return Text("no anomalies", style="green")
    # The code is what a user searches for: it is kept whole, like a number.
    t = FitTable([Column("severity", priority=10), Column("code", whole=True, justify="left", priority=9),
                  Column("message", priority=10)],
                 title=f"{len(m.anomalies)} anomal{'y' if len(m.anomalies) == 1 else 'ies'} "
                       f"({m.errors} error{'' if m.errors == 1 else 's'})",
                 caption=explain_hint(a.code for a in m.anomalies))
    for a in m.anomalies:
        t.add_row(Text(a.severity, style=SEVERITY_STYLES[a.severity]), a.code, a.message)
    return t
