"""Block tables of a snapshot step, the physical->logical map FLEX_ATTENTION derives, and paging findings.

The physical->logical map follows current vLLM (v0.33): block-table entries
at or beyond ``cdiv(seq_len, page_size)`` are ignored, physical page 0 is
reset to -1 because it is the null block, and a page listed twice keeps one
logical block (the last). vLLM produces both on purpose for sliding-window
layers: blocks that left the window are freed (their entries become the null
block) and freed blocks are handed out again, even to the same request. So a
live page 0 or a page mapped twice is an error only when it hides a key some
query token's mask shows (:func:`paging_hazards`); otherwise it is a note.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable

from kvdbg.errors import OptionError
from kvdbg.judge.findings import Finding, by_severity
from kvdbg.ts.window import cdiv, first_visible_key

if TYPE_CHECKING:
    import torch

    from kvdbg.snapshot.store import Snapshot

__all__ = ["PhysicalEntry", "RequestMap", "PageMap", "LivePageValues", "PagingHazard", "find_anomalies",
           "hazard_finding", "live_page_values", "value_anomalies", "page_map", "paging_hazards",
           "physical_to_logical"]

NULL_PAGE = 0
# Float32 bytes of K+V one chunk of pages may expand to while being scanned.
SCAN_BUDGET_BYTES = 32 * 1024 * 1024


@dataclass
class PhysicalEntry:
    physical: int  # engine page id
    logical: int  # what FLEX_ATTENTION's map holds: -1 for the null page
    candidates: list[int]  # every live logical page that maps here (more than one: aliasing)


@dataclass
class RequestMap:
    request: int
    seq_len: int
    query_len: int
    live_pages: int  # cdiv(seq_len, page_size)
    table_width: int
    live: list[int]  # block-table entries the request's length reaches (engine ids)
    stale: list[int]  # entries past them, as captured
    physical_to_logical: list[PhysicalEntry]  # sorted by physical id


@dataclass
class PageMap:
    path: str | None
    step: int
    num_steps: int
    page_size: int
    stored_pages: int
    num_reqs: int
    requests: list[RequestMap]
    anomalies: list[Finding]  # paging findings of the step, errors first

    @property
    def errors(self) -> int:
        return sum(a.severity == "error" for a in self.anomalies)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "anomalies"}
        out["anomalies"] = [a.to_json() for a in self.anomalies]
        out["errors"] = self.errors
        return out


def _rows(snapshot: "Snapshot", step: int) -> tuple[list[list[int]], list[int], list[int]]:
    if not 0 <= step < len(snapshot.steps):
        raise OptionError(f"--step {step} is out of range: the snapshot has {len(snapshot.steps)} step(s)")
    s = snapshot.steps[step]
    return s.block_table.tolist(), [int(x) for x in s.seq_lens.tolist()], s.query_lens


def physical_to_logical(block_table: "torch.Tensor", seq_lens: "torch.Tensor", page_size: int, num_pages: int,
                        null_page: int | None) -> "torch.Tensor":
    """FLEX_ATTENTION's physical->logical page map: ``[num_reqs, num_pages]`` int64, the logical block of each
    stored page in each request's table, -1 where the request does not map it.

    ``block_table`` holds stored-page indices (-1: not stored); ``null_page`` is
    the stored index of engine page 0, if stored. As vLLM (v0.33) derives it::

        block_table[r] = [ 7  3  0  3 | 9 ]     seq_len reaches 4 pages; column 4 is a stale tail
        null_page = 0

        map[r, 7] = 0                           the block that lists it
        map[r, 3] = 3                           listed twice: the last block wins, block 1 is lost
        map[r, 0] = -1                          the null block is masked wherever it is listed
        map[r, 9] = -1                          stale entries are ignored

    Both ``kvdbg map`` (through ``.tolist()``) and the flex backend use this one computation.
    """
    import torch

    from kvdbg.snapshot.store import live_mask

    table = block_table.to(torch.int64)
    num_reqs, width = table.shape
    live = live_mask(table, seq_lens, page_size) & (table >= 0)
    # Non-live entries go to a scratch column that is dropped; amax keeps a page's last logical block.
    cols = torch.arange(width, device=table.device).expand(num_reqs, width)
    p2l = torch.full((num_reqs, num_pages + 1), -1, dtype=torch.int64, device=table.device)
    p2l.scatter_reduce_(1, torch.where(live, table, num_pages), torch.where(live, cols, -1), reduce="amax")
    p2l = p2l[:, :num_pages].contiguous()
    if null_page is not None:
        p2l[:, null_page] = -1
    return p2l


def _physical_entries(live: list[int], stored: list[int], mapped: list[int]) -> list[PhysicalEntry]:
    """One request's map by engine page: ``live`` engine ids, their ``stored`` indices, the request's map row."""
    seen: dict[int, list[int]] = defaultdict(list)
    index: dict[int, int] = {}
    for logical, (physical, position) in enumerate(zip(live, stored)):
        seen[physical].append(logical)
        index[physical] = position
    return [PhysicalEntry(physical, mapped[index[physical]] if index[physical] >= 0 else -1, seen[physical])
            for physical in sorted(seen)]


@dataclass(frozen=True)
class PagingHazard:
    """A live null block, or a page at several logical blocks, in one request's table, judged by what it hides.

    FLEX_ATTENTION masks every block of page 0 and keeps only the last block of
    a page listed twice (``dropped``: the blocks it masks). ``hidden_keys``
    counts the keys of those blocks that some query token's mask shows: the
    keys the backend really loses. Zero means vLLM's own sliding-window rules
    produced the entry and nothing is lost.
    """

    kind: str  # "null_block" | "aliased"
    page: int  # engine page id
    blocks: tuple[int, ...]  # logical blocks holding the page
    dropped: tuple[int, ...]  # blocks FLEX_ATTENTION's map masks
    kept: int | None  # the block the map keeps (aliased pages)
    hidden_keys: int  # keys of the dropped blocks some query token must see
    first_visible: int  # earliest key any query token of the request sees

    @property
    def code(self) -> str:
        return "live_page_zero" if self.kind == "null_block" else "page_mapped_twice"

    @property
    def context(self) -> str:
        """The case of the code's severity rule: error when it hides keys, a note before the window."""
        return "hides_keys" if self.hidden_keys else "before_window"


def paging_hazards(live: list[int], seq_len: int, query_len: int, page_size: int,
                   window: int | None) -> list[PagingHazard]:
    """The null-block and aliased-page entries of one request's live table, each with the keys it hides."""
    first = first_visible_key(seq_len, query_len, window)

    def visible(block: int) -> int:
        return max(0, min(seq_len, (block + 1) * page_size) - max(first, block * page_size))

    positions: dict[int, list[int]] = defaultdict(list)
    for logical, physical in enumerate(live):
        positions[physical].append(logical)
    out = []
    for physical, blocks in sorted(positions.items()):
        if physical == NULL_PAGE:
            dropped, kept, kind = blocks, None, "null_block"
        elif len(blocks) > 1:
            dropped, kept, kind = blocks[:-1], blocks[-1], "aliased"
        else:
            continue
        out.append(PagingHazard(kind, physical, tuple(blocks), tuple(dropped), kept,
                                sum(visible(b) for b in dropped), first))
    return out


def _blocks(blocks) -> str:
    return _short([str(b) for b in blocks])


def hazard_message(r: int, h: PagingHazard, page_size: int, seq_len: int) -> str:
    """One line for a paging hazard: what FLEX_ATTENTION does with it, and whether that loses keys."""
    if h.kind == "null_block":
        what = (f"request {r}: logical block(s) {_blocks(h.blocks)} hold engine page 0, vLLM's null block, which "
                "FLEX_ATTENTION masks")
        if h.hidden_keys:
            return (f"{what}: {h.hidden_keys} key(s) the mask must show are hidden (keys from {h.first_visible} to "
                    f"{seq_len - 1} are visible); a real page was replaced by the null block")
        return (f"{what}; all lie before key {h.first_visible}, the first any query token sees: vLLM's "
                "sliding-window manager puts the null block in entries that left the window "
                "(SlidingWindowManager.remove_skipped_blocks), nothing is hidden")
    what = (f"request {r}: engine page {h.page} sits at logical blocks {_blocks(h.blocks)}; FLEX_ATTENTION's "
            f"physical->logical map keeps block {h.kept} and masks {_blocks(h.dropped)}")
    if h.hidden_keys:
        return f"{what}, hiding {h.hidden_keys} key(s) the mask must show"
    return (f"{what}, which lie before key {h.first_visible}, the first any query token sees: the page left the "
            "window, was freed and handed out again (vLLM's block pool reuses freed blocks); nothing is hidden")


def hazard_finding(r: int, h: PagingHazard, page_size: int, seq_len: int, *, backend: str,
                   step: int | None) -> Finding:
    """The finding for one paging hazard, as `kvdbg map` and the flex backend both report it."""
    return Finding(code=h.code, context=h.context, message=hazard_message(r, h, page_size, seq_len),
                   backend=backend, step=step, request=r, pages=[h.page],
                   details={"page": h.page, "logical_blocks": list(h.blocks), "masked_blocks": list(h.dropped),
                            "kept": h.kept, "hidden_keys": h.hidden_keys, "first_visible_key": h.first_visible})


MAP = "map"  # the findings' source


def find_anomalies(snapshot: "Snapshot", step: int = 0) -> list[Finding]:
    """Every paging finding of one step, errors first."""
    table, seq_lens, query_lens = _rows(snapshot, step)
    ps = snapshot.page_size
    window = snapshot.meta.layer.sliding_window
    out: list[Finding] = []
    users: dict[int, list[int]] = defaultdict(list)  # physical -> requests reading it
    for r, (row, length) in enumerate(zip(table, seq_lens)):
        live_count = cdiv(length, ps)
        live, stale = row[:live_count], row[live_count:]
        for h in paging_hazards(live, length, query_lens[r], ps, window):
            out.append(hazard_finding(r, h, ps, length, backend=MAP, step=step))
        positions = set(live)
        for physical in positions:
            users[physical].append(r)
        stale_nonzero = [p for p in stale if p != NULL_PAGE]
        if stale_nonzero:
            aliasing = sorted({p for p in stale_nonzero if p in positions})
            if aliasing:
                # A map that scatters every column of the row (not only the live ones) lets a
                # stale copy of a live page overwrite that page's logical index.
                out.append(Finding(
                    code="stale_tail_aliases_live", backend=MAP, step=step, request=r,
                    message=f"request {r}: {len(stale_nonzero)} stale non-zero entries past its {live_count} live "
                            f"pages, repeating live page(s) {', '.join(map(str, aliasing))}; a consumer that reads "
                            "the whole row, not only its live pages, remaps them",
                    pages=aliasing))
            else:
                out.append(Finding(
                    code="stale_tail", backend=MAP, step=step, request=r,
                    message=f"request {r}: {len(stale_nonzero)} stale non-zero entries past its {live_count} live "
                            "pages (ignored by current vLLM)",
                    pages=sorted(set(stale_nonzero))))

    by_group: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for physical, reqs in users.items():
        if len(reqs) > 1 and physical != NULL_PAGE:  # the null block is in many tables by design
            by_group[tuple(reqs)].append(physical)
    for reqs, pages in sorted(by_group.items()):
        pages.sort()
        out.append(Finding(
            code="shared_pages", backend=MAP, step=step,
            message=f"{len(pages)} page(s) ({_short(pages)}) shared by requests {', '.join(map(str, reqs))} "
                    "(prefix sharing)",
            pages=pages, requests=list(reqs)))

    out.extend(value_anomalies(live_page_values(snapshot, step, _cache_at(snapshot, step)), backend=MAP, step=step))

    referenced = set(users)
    unreferenced = sorted(int(p) for p in snapshot.page_ids.tolist() if int(p) not in referenced)
    if unreferenced:
        out.append(Finding(
            code="unreferenced_pages", backend=MAP, step=step,
            message=f"{len(unreferenced)} stored page(s) ({_short(unreferenced)}) are not live in step {step}",
            pages=unreferenced))
    return by_severity(out)


@dataclass
class LivePageValues:
    """Per request, the live pages (engine ids) whose K/V values a kernel should never see."""

    nonfinite: dict[int, list[int]]  # request -> pages holding NaN or Inf anywhere in K or V
    zero: dict[int, list[int]]  # request -> pages whose live tokens are all zero in both K and V


def live_page_values(snapshot: "Snapshot", step: int, cache: "torch.Tensor | None" = None) -> LivePageValues:
    """Scan only the pages a step reads, a bounded chunk at a time.

    ``cache`` is the working cache as the step sees it (default: the stored
    pages). A page counts when some query token's mask reaches into it: pages
    wholly before a sliding window are left out, since vLLM frees them (the null
    block often stands there) and no correct kernel reads them. NaN/Inf count
    anywhere in a counted page: kernels read whole pages and 0 x NaN is NaN, so
    even a masked slot poisons the output. Zeros count only over the tokens the
    request's length reaches, since slots past it are legitimately unwritten.
    """
    import torch

    from kvdbg.snapshot.store import live_mask

    s = snapshot.steps[step]
    ps = snapshot.page_size
    table = snapshot.stored_block_table(step)
    live = live_mask(table, s.seq_lens, ps) & (table >= 0)
    window = snapshot.meta.layer.sliding_window
    if window is not None:
        first_block = [first_visible_key(int(length), q, window) // ps
                       for length, q in zip(s.seq_lens.tolist(), s.query_lens)]
        cols = torch.arange(table.shape[1]).unsqueeze(0)
        live &= cols >= torch.tensor(first_block, dtype=torch.int64).view(-1, 1)
    out = LivePageValues({}, {})
    if not bool(live.any()):
        return out
    cols = torch.arange(table.shape[1]).unsqueeze(0).expand_as(table)
    live_tokens = (s.seq_lens.to(torch.int64).unsqueeze(1) - cols * ps).clamp(0, ps)
    pages, used = table[live], live_tokens[live]
    unique, inverse = torch.unique(pages, return_inverse=True)
    tokens = torch.zeros(len(unique), dtype=torch.int64).scatter_reduce(0, inverse, used, "amax")
    k_view, v_view = snapshot.kv_views(cache)  # an FP8 cache's bytes come viewed as e4m3
    per_page = 2 * 4 * k_view[0].numel() if len(k_view) else 1  # fp32 bytes: the float8 path widens
    chunk = max(1, SCAN_BUDGET_BYTES // max(1, per_page))
    bad_pages, zero_pages = [], []
    for start in range(0, len(unique), chunk):
        idx = unique[start:start + chunk]
        # The working cache may live on the GPU; the bookkeeping stays on the CPU.
        on_device = idx.to(k_view.device)
        k, v = k_view[on_device], v_view[on_device]  # [n, Hkv, ps, D]
        if k.dtype == torch.float8_e4m3fn:  # few ops take float8 directly
            k, v = k.float(), v.float()
        # A page's fp32 sum is finite unless it holds NaN/inf (real values are far below fp32's range);
        # only pages whose sum is not get the element-wise check.
        finite = torch.isfinite(k.sum(dim=(1, 2, 3), dtype=torch.float32)) & \
            torch.isfinite(v.sum(dim=(1, 2, 3), dtype=torch.float32))
        if not bool(finite.all()):
            suspect = ~finite
            finite[suspect] = torch.isfinite(k[suspect]).flatten(1).all(1) & torch.isfinite(v[suspect]).flatten(1).all(1)
        finite = finite.cpu()
        nonzero_token = ((k != 0).any(3).any(1) | (v != 0).any(3).any(1)).cpu()  # [n, ps]
        in_length = torch.arange(ps).unsqueeze(0) < tokens[start:start + chunk].unsqueeze(1)
        zero = ~(nonzero_token & in_length).any(1)
        bad_pages.append(idx[~finite])
        zero_pages.append(idx[zero & finite])
    engine = snapshot.page_ids.to(torch.int64)
    for flagged, into in ((torch.cat(bad_pages), out.nonfinite), (torch.cat(zero_pages), out.zero)):
        if not len(flagged):
            continue
        hit = live & torch.isin(table, flagged)
        for r, c in hit.nonzero().tolist():
            page = int(engine[table[r, c]])
            into.setdefault(r, [])
            if page not in into[r]:
                into[r].append(page)
    return out


def value_anomalies(values: LivePageValues, *, backend: str, step: int | None) -> list[Finding]:
    """NaN/Inf and all-zero live pages as findings (``backend``: who looked, "map" or "replay")."""
    out = []
    for r, pages in sorted(values.nonfinite.items()):
        out.append(Finding(
            code="nonfinite_kv", backend=backend, step=step, request=r, pages=pages, details={"pages": pages},
            message=f"request {r}: live page(s) {_short(pages)} hold NaN or Inf in K or V; attention over them "
                    "yields NaN"))
    for r, pages in sorted(values.zero.items()):
        out.append(Finding(
            code="zero_page", backend=backend, step=step, request=r, pages=pages, details={"pages": pages},
            message=f"request {r}: live page(s) {_short(pages)} are all zeros over the request's tokens "
                    "(never written, or wiped)"))
    return out


def _cache_at(snapshot: "Snapshot", step: int) -> "torch.Tensor | None":
    """The pages as step ``step`` reads them: earlier and own cache updates applied (None: no update)."""
    if not any(s.has_update for s in snapshot.steps[:step + 1]):
        return None
    from kvdbg.snapshot.cache import apply_step_update, working_cache

    cache = working_cache(snapshot)
    for s in range(step + 1):
        apply_step_update(snapshot, cache, s)
    return cache


def _short(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", … {len(values) - limit} more" if len(values) > limit else "")


def page_map(snapshot: "Snapshot", step: int = 0, request: int | Iterable[int] | None = None) -> PageMap:
    """Block tables, physical->logical maps and paging findings of one step (optionally some requests only)."""
    table, seq_lens, query_lens = _rows(snapshot, step)
    chosen = range(len(table)) if request is None else sorted({request} if isinstance(request, int) else set(request))
    for r in chosen:
        if not 0 <= r < len(table):
            raise OptionError(f"--request {r} is out of range: step {step} has {len(table)} request(s)")
    ps = snapshot.page_size
    stored = snapshot.stored_block_table(step)
    mapped = physical_to_logical(stored, snapshot.steps[step].seq_lens, ps, snapshot.num_pages,
                                 snapshot.null_page_index()).tolist()
    stored = stored.tolist()
    requests = []
    for r in chosen:
        live_count = cdiv(seq_lens[r], ps)
        live = table[r][:live_count]
        requests.append(RequestMap(
            request=r, seq_len=seq_lens[r], query_len=query_lens[r], live_pages=live_count,
            table_width=len(table[r]), live=live, stale=table[r][live_count:],
            physical_to_logical=_physical_entries(live, stored[r][:live_count], mapped[r])))
    anomalies = find_anomalies(snapshot, step)
    if request is not None:
        anomalies = [a for a in anomalies if set(chosen) & set(a.requests)]
    return PageMap(path=snapshot.path, step=step, num_steps=len(snapshot.steps), page_size=ps,
                   stored_pages=snapshot.num_pages, num_reqs=len(table), requests=requests, anomalies=anomalies)
