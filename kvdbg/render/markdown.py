"""GitHub-flavoured Markdown building blocks: escaped text, code spans and tables (`kvdbg report`, sweep)."""

from __future__ import annotations

import re

from kvdbg.render.util import printable

# Backslash-escaping every ASCII punctuation character that can start inline markup
# keeps cell text literal; pipes would otherwise split table cells.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~#!&])")


def md_escape(text: object) -> str:
    """Text safe inside a Markdown paragraph or table cell: markup characters escaped, one line."""
    s = printable(" ".join(str(text).split()))  # a newline would end the table row; controls are written out
    return _MD_SPECIAL.sub(r"\\\1", s)


def md_code(text: object) -> str:
    """An inline code span; a backtick fence one longer than any run inside it, pipes escaped for tables."""
    s = printable(" ".join(str(text).split()))
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    # GFM splits table rows on pipes before parsing code spans; \| is read back as |.
    return f"{fence}{pad}{s.replace('|', chr(92) + '|')}{pad}{fence}"


def md_table(headers: list[str], rows: list[list[str]], *, align: list[str] | None = None) -> str:
    """Cells must already be escaped (md_escape / md_code)."""
    align = align or ["left"] * len(headers)
    marks = {"left": "---", "right": "---:", "center": ":---:"}
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |",
             "| " + " | ".join(marks[a] for a in align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
