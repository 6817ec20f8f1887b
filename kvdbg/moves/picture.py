"""What each backend sees of one request, query token x key: the exact mask, FLASHINFER_TS, flex (no torch).

Every grid covers one request's query tokens (rows) and keys ``0 .. L-1``
(columns, absolute positions). A cell is one of:

- ``seen``: the backend attends to the key and the exact mask shows it;
- ``extra``: the backend attends to a key the exact mask hides;
- ``missed``: the exact mask shows the key and the backend does not attend to it;
- ``loaded``: the backend reads the key's page (a table column handed to the
  kernel, a tile of flex's BlockMask) and masks the key, rightly;
- ``none``: not read, not needed.

FLASHINFER_TS comes from :func:`kvdbg.ts.window.analyze_window` (the builder's
page-aligned restriction of dense windowed layers, the columns it copies). flex
comes from the step's block table, by the arithmetic of kvdbg's flex backend
(vLLM's direct BlockMask build): query blocks of ``FLEX_Q_BLOCK`` batch tokens
x one page, the physical-to-logical map with the null block masked and a page
listed twice kept at its last block; inside a listed tile, flex's mask_mod is
the exact logical mask. Rows are stored as runs, so a 1M-key request costs a
few runs per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvdbg.ts.window import WindowAnalysis, cdiv, exact_visible_range

# kvdbg's flex backend (backends/flex.py Q_BLOCK_SIZE): vLLM's direct build uses 16-token query blocks.
FLEX_Q_BLOCK = 16

SEEN, EXTRA, MISSED, LOADED, NONE = "seen", "extra", "missed", "loaded", "none"
KINDS = (SEEN, EXTRA, MISSED, LOADED, NONE)
MEANING = {
    SEEN: "attended, and in the exact window",
    EXTRA: "attended, but outside the exact window",
    MISSED: "in the exact window, but not attended",
    LOADED: "page read, key masked (rightly)",
    NONE: "not read, not needed",
}

Run = tuple[int, int, str]  # [lo, hi) keys of one kind


@dataclass(frozen=True)
class Grid:
    """One backend's view of the request: a run list per query token covering keys [0, seq_len)."""

    backend: str  # "reference", "flashinfer_ts", "flex"
    title: str
    rows: list[list[Run]]
    note: str = ""

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for row in self.rows:
            for lo, hi, kind in row:
                out[kind] += hi - lo
        return out

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "title": self.title, "note": self.note, "counts": self.counts(),
                "rows": [[list(run) for run in row] for row in self.rows]}


@dataclass(frozen=True)
class Picture:
    request: int | None
    seq_len: int
    query_len: int
    page_size: int
    window: int | None
    causal: bool
    grids: list[Grid]
    focus: int | None  # a key worth a close look: the first difference from the exact mask, else the window edge
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "grids"}
        out["grids"] = [g.to_json() for g in self.grids]
        out["legend"] = dict(MEANING)
        return out


@dataclass(frozen=True)
class StepTables:
    """One step's block table (engine page ids), lengths and stored pages, read without torch."""

    block_table: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]
    page_ids: list[int]  # engine ids of the stored pages


# --------------------------------------------------------------------------- runs


def _classify(seq_len: int, exact: tuple[int, int], seen: list[tuple[int, int]],
              loaded: list[tuple[int, int]]) -> list[Run]:
    """Runs over [0, seq_len) from the exact interval and the backend's seen / loaded interval lists."""
    cuts = {0, seq_len, *exact}
    for lo, hi in seen + loaded:
        cuts.update((max(0, min(lo, seq_len)), max(0, min(hi, seq_len))))
    points = sorted(cuts)
    runs: list[Run] = []
    for lo, hi in zip(points, points[1:]):
        if lo >= hi:
            continue
        in_exact = exact[0] <= lo < exact[1]
        in_seen = any(a <= lo < b for a, b in seen)
        in_loaded = in_seen or any(a <= lo < b for a, b in loaded)
        kind = (SEEN if in_seen else MISSED) if in_exact else (EXTRA if in_seen else LOADED if in_loaded else NONE)
        if runs and runs[-1][2] == kind and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi, kind)
        else:
            runs.append((lo, hi, kind))
    return runs


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out


def _intersect(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


# --------------------------------------------------------------------------- the grids


def reference_grid(a: WindowAnalysis) -> Grid:
    rows = []
    for i in range(a.query_len):
        exact = exact_visible_range(a.seq_len, a.query_len, i, a.window, a.causal)
        rows.append(_classify(a.seq_len, exact, [exact], []))
    mask = "causal" if a.causal else "dense"
    rule = ("k <= p" if a.causal else "k < L") + (f", |p - k| < {a.window}" if a.window else "")
    return Grid("reference", f"reference: the exact {mask} mask ({rule}, p = L - q + i)", rows)


def flashinfer_ts_grid(a: WindowAnalysis) -> Grid:
    """FLASHINFER_TS after its builder: the keys the prims_ts kernel attends to, and the pages it is handed."""
    b = a.builder
    covered = min(a.seq_len, b.first_kept_token + b.columns_copied * a.page_size)
    loaded = [] if b.noop else [(b.first_kept_token, covered)]
    rows = []
    for tok in a.visibility.tokens:
        exact = (tok.exact_lo, tok.exact_hi)
        seen = [(tok.kernel_lo, tok.kernel_hi)] if tok.kernel_hi > tok.kernel_lo else []
        rows.append(_classify(a.seq_len, exact, seen, loaded))
    if b.noop:
        note = "no-op batch: the builder plans nothing, no token is computed"
    elif b.restricted:
        note = (f"page-aligned window restriction: pages from {a.restriction.start_page} on (key "
                f"{b.first_kept_token}), one shared start for the block")
    else:
        note = b.note
    return Grid("flashinfer_ts", "FLASHINFER_TS: what the prims_ts kernel attends to after the builder", rows, note)


def flex_grid(a: WindowAnalysis, tables: StepTables, request: int) -> Grid:
    """flex over the physical cache, in the request's logical keys (see the module doc)."""
    ps, window = a.page_size, a.window
    table, lens, starts = tables.block_table, tables.seq_lens, tables.query_start_loc
    stored = set(tables.page_ids)
    length = lens[request]
    row = table[request]
    live = cdiv(length, ps)
    # physical -> logical for this request: live stored entries; a page listed twice keeps its last block;
    # engine page 0, vLLM's null block, maps to nothing.
    p2l: dict[int, int] = {}
    for col, page in enumerate(row[:live]):
        if page in stored:
            p2l[page] = col
    p2l.pop(0, None)
    hidden = [col for col, page in enumerate(row[:live]) if p2l.get(page) != col]
    span = min(len(row), cdiv(max(lens, default=0), ps))
    num_reqs = len(lens)
    token_request = [r for r in range(num_reqs) for _ in range(starts[r + 1] - starts[r])]

    def listed_blocks(block: int) -> list[tuple[int, int]]:
        """Logical key intervals of ``request`` whose page query block ``block`` lists."""
        first_col: dict[int, int] = {}
        for t in range(block * FLEX_Q_BLOCK, min(len(token_request), (block + 1) * FLEX_Q_BLOCK)):
            r = token_request[t]
            position = t - starts[r] + lens[r] - (starts[r + 1] - starts[r])
            col = max(0, position - (window - 1)) // ps if window is not None else 0
            first_col[r] = min(col, first_col.get(r, col))
        pages = set()
        for r, col in first_col.items():
            pages.update(p for p in table[r][col:span] if p in stored and p != 0)
        return _merge([(p2l[p] * ps, min(length, (p2l[p] + 1) * ps)) for p in pages if p in p2l])

    rows, cache = [], {}
    for i in range(a.query_len):
        block = (starts[request] + i) // FLEX_Q_BLOCK
        if block not in cache:
            cache[block] = listed_blocks(block)
        loaded = cache[block]
        exact = exact_visible_range(length, a.query_len, i, window, a.causal)
        rows.append(_classify(length, exact, _intersect(loaded, *exact), loaded))
    note = f"BlockMask tiles of {FLEX_Q_BLOCK} batch query tokens x one page ({ps} keys)"
    if hidden:
        shown = ", ".join(map(str, hidden[:8])) + (" …" if len(hidden) > 8 else "")
        note += f"; logical block(s) {shown} masked by the physical->logical map (null block or a page listed twice)"
    return Grid("flex", "FLEX_ATTENTION: what flex attends to (BlockMask tiles, then mask_mod)", rows, note)


def picture(a: WindowAnalysis, tables: StepTables | None = None, request: int | None = None) -> Picture:
    """The grids of one request: reference, FLASHINFER_TS, and flex when the step's tables are given."""
    grids = [reference_grid(a), flashinfer_ts_grid(a)]
    notes = []
    if tables is not None and request is not None:
        grids.append(flex_grid(a, tables, request))
    else:
        notes.append("flex needs the step's block table: give a snapshot to see it")
    return Picture(request, a.seq_len, a.query_len, a.page_size, a.window, a.causal, grids, _focus(a, grids), notes)


def _focus(a: WindowAnalysis, grids: list[Grid]) -> int | None:
    differences = [lo for g in grids for row in g.rows for lo, _, kind in row if kind in (EXTRA, MISSED)]
    if differences:
        return min(differences)
    if a.window is not None:
        return exact_visible_range(a.seq_len, a.query_len, 0, a.window, a.causal)[0]
    return None


# --------------------------------------------------------------------------- sampling for display

PRIORITY = (MISSED, EXTRA)


def cell_kind(row: list[Run], lo: int, hi: int) -> str:
    """The symbol kind of keys [lo, hi) of one row: a difference wins, else seen (all or part), loaded, none.

    Returns one of KINDS, or "partial" when part of the keys is seen and none differs.
    """
    present: dict[str, int] = {}
    for a, b, kind in row:
        overlap = min(b, hi) - max(a, lo)
        if overlap > 0:
            present[kind] = present.get(kind, 0) + overlap
    for kind in PRIORITY:
        if kind in present:
            return kind
    if SEEN in present:
        return SEEN if present[SEEN] == hi - lo else "partial"
    return LOADED if LOADED in present else NONE


def merged_rows(rows: list[list[Run]], first: int, last: int) -> list[Run]:
    """Rows ``first .. last-1`` as one: every run of each (a compressed row shows any token's difference)."""
    out: list[Run] = []
    for row in rows[first:last]:
        out.extend(row)
    return out


def row_groups(count: int, most: int) -> list[tuple[int, int]]:
    """[first, last) token ranges so that ``count`` rows fit in ``most`` display rows."""
    if count <= most:
        return [(i, i + 1) for i in range(count)]
    size = cdiv(count, most)
    return [(i, min(count, i + size)) for i in range(0, count, size)]


__all__ = ["EXTRA", "FLEX_Q_BLOCK", "Grid", "KINDS", "LOADED", "MEANING", "MISSED", "NONE", "Picture", "SEEN",
           "StepTables", "cell_kind", "flashinfer_ts_grid", "flex_grid", "merged_rows", "picture", "reference_grid",
           "row_groups"]
