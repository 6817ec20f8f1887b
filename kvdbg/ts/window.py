"""Paging math of FLASHINFER_TS and the exact attention windows it approximates (pure Python, no torch).

Positions are absolute token indices of one request: ``L`` is its seq_len
(query block included), ``q`` its query length, and query token ``i`` sits at
``p = L - q + i``. Ranges are half-open ``(lo, hi)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvdbg.errors import OptionError
from kvdbg.judge.findings import Finding
from kvdbg.ts.contract import BACKEND as TS_BACKEND, check_plan, check_request


def ts_batch_not_run(query_lens: list[int], max_decode_query_len: int) -> str | None:
    """Why FLASHINFER_TS never runs a batch of these query lengths (None: it runs it), one line.

    It runs uniform draft blocks only: the builder plans ``sum // num_reqs`` tokens per request and makes a
    no-op of a batch past ``max_decode_query_len`` (or of one that rounds down to none); vLLM builds such
    prefill-shaped and mixed batches' metadata and never runs them. One rule for `kvdbg replay` (the
    flashinfer_ts column) and `kvdbg window SNAP` (which reads the lengths without torch).
    """
    n, tokens = len(query_lens), sum(query_lens)
    q = tokens // n if n else 0
    noop = None
    if q > max_decode_query_len:
        noop = (f"query_len {q} ({tokens} tokens over {n} requests) exceeds max_decode_query_len "
                f"{max_decode_query_len}: the builder treats it as a batch it never runs")
    elif q == 0 and tokens > 0:
        noop = f"{tokens} tokens over {n} requests round down to 0 tokens per request"
    if noop is not None:
        return (f"not a draft-block batch ({noop}); vLLM builds FLASHINFER_TS metadata for such prefill-shaped "
                "batches and never runs it")
    lo, hi = (min(query_lens), max(query_lens)) if query_lens else (0, 0)
    if lo != hi or tokens != n * q:
        return (f"query lengths {lo}..{hi} are not one uniform block: FLASHINFER_TS runs only batches where "
                f"every request brings the same number of query tokens (at most {max_decode_query_len})")
    return None

__all__ = [
    "cdiv",
    "ts_batch_not_run",
    "WindowRestriction",
    "restrict_to_window",
    "ts_table_width",
    "ts_max_kv_len",
    "ts_mask_type",
    "ts_window_left",
    "exact_visible_range",
    "first_visible_key",
    "kernel_visible_range",
    "TokenVisibility",
    "VisibilityTable",
    "visibility_table",
    "BuilderOutput",
    "StripCell",
    "WindowAnalysis",
    "analyze_window",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for integers (``b > 0``)."""
    return -(-a // b)


def _require(name: str, value: int | None, minimum: int) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise OptionError(f"{name} must be >= {minimum}, got {value}")


# The engine holds lengths, positions and page ids as int32 (seq_lens, block_table).
INT32_MAX = 2**31 - 1


def _require_int32(name: str, value: int) -> None:
    if value > INT32_MAX:
        raise OptionError(f"{name} {value} is beyond int32 ({INT32_MAX}), the dtype the engine holds lengths in")


# --------------------------------------------------------------------------- the builder's rule


@dataclass(frozen=True)
class WindowRestriction:
    """What FLASHINFER_TS's builder does to one request of a dense (non-causal) windowed batch."""

    seq_len: int
    window: int | None
    query_len: int
    page_size: int
    span: int  # keys the union of the block's windows reaches: window + query_len - 1
    start_page: int  # first block-table column handed to the kernel
    first_kept_token: int  # start_page * page_size: absolute position of the kernel's key 0
    restricted_seq_len: int  # seq_len the kernel is given
    pages_total: int  # cdiv(seq_len, page_size)
    pages_dropped: int
    pages_kept: int  # cdiv(restricted_seq_len, page_size)
    table_width: int  # columns of the restricted table for this query_len
    applies: bool  # True when pages are really dropped
    reason: str  # why nothing is dropped, when applies is False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def restrict_to_window(seq_len: int, window: int | None, query_len: int, page_size: int) -> WindowRestriction:
    """FLASHINFER_TS's page-aligned restriction of a dense windowed request.

    The kernel cannot carry a window on a dense mask, and the query block ends
    the sequence, so the builder keeps the suffix from the page holding
    ``L - span`` on. ``window=None`` returns the identity (nothing restricted)
    so callers can treat both layer kinds alike.
    """
    _require("seq_len", seq_len, 0)
    _require("query_len", query_len, 0)
    _require("page_size", page_size, 1)
    if window is not None:
        _require("window", window, 1)
    if query_len > seq_len:
        raise OptionError(f"query_len {query_len} is longer than seq_len {seq_len}")
    pages_total = cdiv(seq_len, page_size)
    if window is None:
        return WindowRestriction(
            seq_len, None, query_len, page_size, span=seq_len, start_page=0, first_kept_token=0,
            restricted_seq_len=seq_len, pages_total=pages_total, pages_dropped=0, pages_kept=pages_total,
            table_width=pages_total, applies=False,
            reason="no sliding window: the builder hands the kernel the whole table",
        )
    span = window + query_len - 1
    # Python's // floors like torch's rounding_mode="floor", also for negatives.
    start_page = max(0, (seq_len - span) // page_size)
    first_kept = start_page * page_size
    restricted = seq_len - first_kept
    applies = start_page > 0
    if applies:
        reason = ""
    else:
        reason = (
            f"seq_len {seq_len} is below window span {span} + page_size {page_size}: "
            "no whole page lies before the window, nothing is dropped"
        )
    return WindowRestriction(
        seq_len, window, query_len, page_size, span=span, start_page=start_page, first_kept_token=first_kept,
        restricted_seq_len=restricted, pages_total=pages_total, pages_dropped=start_page,
        pages_kept=cdiv(restricted, page_size), table_width=cdiv(span, page_size) + 1,
        applies=applies, reason=reason,
    )


def ts_table_width(window: int | None, query_len: int, page_size: int, max_model_len: int) -> int:
    """Columns of the builder's persistent block-table buffer (sized for ``query_len``)."""
    if window is None:
        return cdiv(max_model_len, page_size)
    return cdiv(window + query_len - 1, page_size) + 1


def ts_max_kv_len(window: int | None, max_decode_query_len: int, page_size: int, max_model_len: int) -> int:
    """The constant ``max_kv_len`` every FLASHINFER_TS plan is compiled for."""
    if window is None:
        return max_model_len
    # One partial page in front of the window plus the query block is the most
    # a restricted dense request can keep -- causal batches are not restricted.
    return window + max_decode_query_len + page_size


def ts_mask_type(causal: bool) -> str:
    return "causal" if causal else "dense"


def ts_window_left(window: int | None, causal: bool) -> int:
    """prims_ts accepts a window only with a causal mask; dense windows go through the page table."""
    return window - 1 if (causal and window is not None) else -1


# --------------------------------------------------------------------------- visible key ranges


def exact_visible_range(seq_len: int, query_len: int, i: int, window: int | None, causal: bool) -> tuple[int, int]:
    """Keys query token ``i`` must attend to, as the reference defines them (docs/snapshot-format.md).

    Causal: ``k <= p``, with a window ``p - w < k``. Dense: ``k < L``, with a
    window vLLM's symmetric ``|p - k| < w`` -- which ends before ``L`` for the
    block's first tokens when ``w < q``.
    """
    p = seq_len - query_len + i
    hi = p + 1 if causal else seq_len
    lo = 0
    if window is not None:
        lo = max(0, p - window + 1)
        hi = min(hi, p + window)
    return lo, hi


def first_visible_key(seq_len: int, query_len: int, window: int | None) -> int:
    """The earliest key any query token of a request may see: ``max(0, L - q - w + 1)``, 0 without a window.

    Keys before it are outside every token's window (causal or dense alike), so
    no correct kernel reads them; vLLM's sliding-window manager frees their
    blocks and puts the null block in their table entries.
    """
    if window is None:
        return 0
    return max(0, seq_len - query_len - window + 1)


def kernel_visible_range(
    seq_len: int, query_len: int, i: int, window: int | None, causal: bool, page_size: int
) -> tuple[int, int]:
    """Keys the prims_ts kernel attends to for token ``i`` after the builder, in absolute positions.

    Dense: every key the (possibly restricted) table holds, one shared start.
    Causal: bottom-right aligned, and ``window_left`` gives each token its own
    window, so the kernel's range equals the exact one. Whether the builder
    handed the kernel the pages of that range is a separate question
    (:func:`visibility_table` answers it).
    """
    if causal:
        return exact_visible_range(seq_len, query_len, i, window, causal)
    restriction = restrict_to_window(seq_len, window, query_len, page_size)
    return restriction.first_kept_token, seq_len


# --------------------------------------------------------------------------- per-token table


@dataclass(frozen=True)
class TokenVisibility:
    """One query token: the keys its exact window holds against the keys the kernel reads."""

    index: int  # i within the query block
    position: int  # p = L - q + i
    exact_lo: int
    exact_hi: int
    kernel_lo: int
    kernel_hi: int  # capped at what the builder's table really covers
    extra: int  # keys the kernel sees that the exact window excludes
    missed: int  # keys of the exact window the kernel does not see (must be 0)


@dataclass(frozen=True)
class VisibilityTable:
    """Every query token of one request, with the worst extra keys and the shared-start drift."""

    tokens: list[TokenVisibility]
    worst_extra: int
    drift: int  # spread of the exact window starts the kernel collapses into one (q - 1 when dense+window)
    total_missed: int
    covered_hi: int  # absolute end of the keys the builder's table covers

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def visibility_table(
    seq_len: int,
    window: int | None,
    query_len: int,
    page_size: int,
    causal: bool,
    *,
    covered_hi: int | None = None,
    noop: bool = False,
) -> VisibilityTable:
    """Exact versus kernel-visible keys for every token of the query block.

    ``covered_hi`` is the absolute end of the keys reachable through the block
    table the builder copied (default: all of ``seq_len``); keys past it are
    read through columns the builder never wrote, so they count as missed.
    ``noop`` marks a batch the builder turned into a no-op: the kernel sees nothing.
    """
    covered = seq_len if covered_hi is None else covered_hi
    tokens = []
    for i in range(query_len):
        exact = exact_visible_range(seq_len, query_len, i, window, causal)
        if noop:
            seen = (exact[0], exact[0])
        else:
            lo, hi = kernel_visible_range(seq_len, query_len, i, window, causal, page_size)
            seen = (lo, max(lo, min(hi, covered)))
        both = _overlap(exact, seen)
        tokens.append(TokenVisibility(
            index=i, position=seq_len - query_len + i, exact_lo=exact[0], exact_hi=exact[1],
            kernel_lo=seen[0], kernel_hi=seen[1],
            extra=(seen[1] - seen[0]) - both, missed=(exact[1] - exact[0]) - both,
        ))
    if tokens:
        drift = (tokens[-1].exact_lo - tokens[0].exact_lo) - (tokens[-1].kernel_lo - tokens[0].kernel_lo)
    else:
        drift = 0
    return VisibilityTable(
        tokens=tokens,
        worst_extra=max((t.extra for t in tokens), default=0),
        drift=drift,
        total_missed=sum(t.missed for t in tokens),
        covered_hi=covered,
    )


# --------------------------------------------------------------------------- the whole picture for `kvdbg window`


@dataclass(frozen=True)
class BuilderOutput:
    """What FLASHINFER_TS's builder hands the kernel for one request."""

    restricted: bool  # the dense-window page restriction ran
    noop: bool  # query_len > max_decode_query_len: the builder plans nothing, outputs stay unwritten
    seq_len: int  # the kernel's seq_len
    first_kept_token: int  # absolute position of the kernel's key 0
    buffer_width: int  # columns of the persistent table buffer (sized for max_decode_query_len)
    columns_copied: int  # columns holding real entries of this request
    pages_needed: int  # cdiv(kernel seq_len, page_size)
    max_kv_len: int
    mask_type: str
    window_left: int
    note: str


@dataclass(frozen=True)
class StripCell:
    """One page (or an elided run of pages) of the page strip around the window's old edge."""

    page: int | None  # None: a gap of ``count`` elided pages
    kind: str  # dropped | edge | kept | query | missing | gap
    first_token: int = 0
    count: int = 1


STRIP_LETTERS = {"dropped": "D", "edge": "P", "kept": "K", "query": "Q", "missing": "X", "gap": "…"}


@dataclass(frozen=True)
class WindowAnalysis:
    """Everything `kvdbg window` shows: restriction, builder output, visibility, strip, findings."""

    seq_len: int
    window: int | None
    query_len: int
    page_size: int
    causal: bool
    max_model_len: int
    max_decode_query_len: int
    restriction: WindowRestriction
    applies: bool  # the builder really drops pages for this request
    reason: str  # why it does not, when it does not
    builder: BuilderOutput
    visibility: VisibilityTable
    strip: list[StripCell]
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(replace(self, findings=[]))
        out["findings"] = [f.to_json() for f in self.findings]
        return out


def _builder_output(seq_len, window, query_len, page_size, causal, max_model_len, max_decode_query_len,
                    restriction: WindowRestriction) -> BuilderOutput:
    buffer_width = ts_table_width(window, max_decode_query_len, page_size, max_model_len)
    engine_width = cdiv(max_model_len, page_size)  # vLLM sizes its block table for max_model_len
    max_kv_len = ts_max_kv_len(window, max_decode_query_len, page_size, max_model_len)
    mask_type, window_left = ts_mask_type(causal), ts_window_left(window, causal)
    noop = query_len > max_decode_query_len
    if window is not None and not causal:
        # The gather reads start_page + j for every buffer column, clamped to the
        # engine table's last column; columns past the request's pages repeat
        # entries the kernel never reaches.
        copied = min(buffer_width, max(0, engine_width - restriction.start_page))
        note = (f"dense + window: pages from {restriction.start_page} on, seq_len renumbered from "
                f"token {restriction.first_kept_token}")
        return BuilderOutput(True, noop, restriction.restricted_seq_len, restriction.first_kept_token,
                             buffer_width, copied, cdiv(restriction.restricted_seq_len, page_size),
                             max_kv_len, mask_type, window_left, note)
    copied = min(engine_width, buffer_width)
    if causal and window is not None:
        note = (f"causal + window: not restricted; the kernel gets window_left {window_left}, seq_len {seq_len} "
                f"and the first {copied} table columns")
    else:
        note = f"no window: seq_len {seq_len} and the first {copied} table columns as they are"
    return BuilderOutput(False, noop, seq_len, 0, buffer_width, copied, cdiv(seq_len, page_size),
                         max_kv_len, mask_type, window_left, note)


def _page_kind(page: int, *, page_size: int, union_lo: int, query_lo: int, covered_hi: int) -> str:
    first, last = page * page_size, (page + 1) * page_size
    if last <= union_lo:
        return "dropped"
    if first >= covered_hi:
        return "missing"
    if last > query_lo:
        return "query"
    return "edge" if first < union_lo else "kept"


def _strip(seq_len: int, query_len: int, page_size: int, union_lo: int, covered_hi: int,
           context: int = 3) -> list[StripCell]:
    """Pages around the window's old edge, a gap, and the pages of the query block."""
    total = cdiv(seq_len, page_size)
    if total == 0:
        return []
    edge_page = union_lo // page_size
    query_lo = seq_len - query_len
    shown = set(range(max(0, edge_page - context), min(total, edge_page + context + 1)))
    shown |= set(range(max(0, cdiv(query_lo + 1, page_size) - 2), total))
    if covered_hi < seq_len:
        cut = covered_hi // page_size
        shown |= set(range(max(0, cut - 1), min(total, cut + 1)))
    cells, previous = [], -1
    for page in sorted(shown):
        if page > previous + 1:
            cells.append(StripCell(None, "gap", (previous + 1) * page_size, page - previous - 1))
        kind = _page_kind(page, page_size=page_size, union_lo=union_lo, query_lo=query_lo, covered_hi=covered_hi)
        cells.append(StripCell(page, kind, page * page_size))
        previous = page
    return cells


def analyze_window(
    seq_len: int,
    window: int | None,
    *,
    query_len: int = 1,
    page_size: int = 16,
    causal: bool = False,
    max_model_len: int | None = None,
    max_decode_query_len: int | None = None,
) -> WindowAnalysis:
    """Everything `kvdbg window` shows: restriction, builder output, per-token visibility, strip, findings."""
    for name, value in (("--seq-len", seq_len), ("--query-len", query_len), ("--page-size", page_size),
                        ("--window", window), ("--max-model-len", max_model_len),
                        ("--max-decode-query-len", max_decode_query_len)):
        if value is not None:
            _require(name, value, 1)
            _require_int32(name, value)
    if query_len > seq_len:
        raise OptionError(f"--query-len {query_len} is longer than --seq-len {seq_len}")
    max_model_len = max(32768, seq_len) if max_model_len is None else max_model_len
    _require("--max-model-len", max_model_len, 1)
    if seq_len > max_model_len:
        raise OptionError(f"--seq-len {seq_len} exceeds --max-model-len {max_model_len}")
    max_decode_query_len = query_len if max_decode_query_len is None else max_decode_query_len
    _require("--max-decode-query-len", max_decode_query_len, 1)

    restriction = restrict_to_window(seq_len, window, query_len, page_size)
    if window is None:
        applies, reason = False, "no sliding window: nothing to restrict"
    elif causal:
        applies = False
        reason = ("causal mask: the builder passes the window to the kernel as window_left and does not "
                  "restrict the page table")
    else:
        applies, reason = restriction.applies, restriction.reason
    if not applies:
        restriction = replace(restriction, applies=False, reason=reason)

    builder = _builder_output(seq_len, window, query_len, page_size, causal, max_model_len,
                              max_decode_query_len, restriction)
    covered_hi = builder.first_kept_token + builder.columns_copied * page_size
    visibility = visibility_table(seq_len, window, query_len, page_size, causal,
                                  covered_hi=min(seq_len, covered_hi), noop=builder.noop)
    union_lo = exact_visible_range(seq_len, query_len, 0, window, causal)[0]
    strip = _strip(seq_len, query_len, page_size, union_lo, min(seq_len, covered_hi))

    findings: list[Finding] = []
    if builder.noop:
        findings.append(Finding(
            code="noop_batch", backend=TS_BACKEND,
            message=f"query_len {query_len} exceeds max_decode_query_len {max_decode_query_len}: the builder "
                    "plans a no-op batch and these query tokens are never computed",
            details={"query_len": query_len, "max_decode_query_len": max_decode_query_len},
        ))
    else:
        findings += check_plan(head_dim=None, page_size=page_size, q_dtype=None, kv_dtype=None,
                               mask_type=builder.mask_type, window_left=builder.window_left)
        findings += check_request(request=None, seq_len=builder.seq_len, query_len=query_len,
                                  max_kv_len=builder.max_kv_len, table_width=builder.columns_copied,
                                  page_size=page_size, mask_type=builder.mask_type)
    if visibility.total_missed and not builder.noop:
        worst = max(visibility.tokens, key=lambda t: t.missed)
        findings.append(Finding(
            code="tokens_missed", backend=TS_BACKEND,
            message=f"the kernel misses {visibility.total_missed} keys of the exact windows (worst: query token "
                    f"{worst.index} at position {worst.position} misses {worst.missed})",
            details={"total_missed": visibility.total_missed, "worst_token": worst.index},
        ))
    return WindowAnalysis(seq_len, window, query_len, page_size, causal, max_model_len, max_decode_query_len,
                          restriction, applies, reason, builder, visibility, strip, findings)
