"""`kvdbg explain`: one finding code in full, or every code in one table (no torch)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdbg.judge.findings import CODES, SEVERITY_STYLES, TOPICS, Code
from kvdbg.render.fit import Column, FitTable


def _severity(code: Code) -> Text:
    text = Text()
    for i, severity in enumerate(code.severities):
        if i:
            text.append("/")
        text.append(severity, style=SEVERITY_STYLES[severity])
    return text


def render_code(code: Code, asked: str | None = None) -> Group:
    """One code: its title, severity rule, who reports it, and what it means, when it fires, what to do.

    ``asked``: the name the user gave, when it is a former name of ``code``.
    """
    parts = [Text(f"{asked} is now reported as {code.name}", style="yellow")] if asked and asked != code.name else []
    parts += [Text.assemble((code.name, "bold"), f": {code.title}"),
             Text.assemble(("severity: ", "dim"), *_rule(code)),
             Text.assemble(("reported by: ", "dim"), code.reported_by)]
    if code.rule:
        parts.append(Text.assemble(("kernel rule: ", "dim"), f"{code.rule} (flashinfer-python, {code.source})"))
    for label, body in (("What it means.", code.means), ("When it fires.", code.fires), ("What to do.", code.action)):
        parts += [Text(""), Text.assemble((label, "bold"), " ", body)]
    return Group(*parts)


def _rule(code: Code) -> list:
    if not code.contexts:
        return [(code.severity, SEVERITY_STYLES[code.severity])]
    out: list = []
    for i, case in enumerate(code.contexts):
        out += (["; "] if i else []) + [(case.severity, SEVERITY_STYLES[case.severity]), f" when {case.when}"]
    return out


def render_codes() -> FitTable:
    """Every code, grouped by topic: name, severity, one line."""
    table = FitTable([Column("code", whole=True, justify="left", priority=10),
                      Column("severity", priority=8, min_width=7), Column("what it is", priority=9)],
                     title=f"{len(CODES)} finding codes",
                     caption="kvdbg explain CODE: what a code means, when it fires and what to do")
    for code in sorted(CODES.values(), key=lambda c: (TOPICS.index(c.topic), c.name)):
        table.add_row(code.name, _severity(code), code.title)
    return table
