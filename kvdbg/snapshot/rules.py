"""The rules a snapshot's ids, lengths and layer values obey, in plain Python (no torch).

One statement of what a file must hold beyond its structure (``format.check_structure``):
``store.load_snapshot`` (every replay) and ``store.save_snapshot`` hold a snapshot to it through
:func:`check_values`, and `kvdbg window SNAP`, which never imports torch, holds the file to the
same rules from its index tensors alone, so that window refuses, with the same message, what a
replay refuses. Each rule raises :class:`~kvdbg.errors.SnapshotError` naming the first offending
entry (``step.1.block_table[2, 7] = 913 is not among the 640 stored pages (page_ids)``).

Inputs are plain sequences of ints; the set operations and ``min``/``max`` that do the scanning run
in C, so a table of millions of entries costs tens of milliseconds.

May import :mod:`kvdbg.errors` and :mod:`kvdbg.snapshot.format` (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvdbg.errors import SnapshotError
from kvdbg.snapshot.format import CROSS_ATTN_TYPE, ENCODER_SELF_ATTN_TYPES, LAYER_VALUE_TENSORS, SnapshotMeta

# A request's live entries past its window name distinct pages in vLLM, all of them stored. An engine bug may
# map a page again (a finding for `kvdbg map` and replay, never refused for that alone); the entries beyond the
# stored pages are allowed up to what replaying them would cost at most (K and V in float64), so that a file of
# a few MB mapping one page a million times cannot ask a replay for gigabytes.
REPEATED_READS_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class StepValues:
    """One step's index tensors as plain ints: what the rules read (``block_table`` flattened, row-major)."""

    block_table: Sequence[int]
    width: int  # block_table's columns
    seq_lens: Sequence[int]
    query_start_loc: Sequence[int]
    num_tokens: int  # the query's rows
    slot_mapping: Sequence[int] | None = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_values(meta: SnapshotMeta, page_ids: Sequence[int], steps: Sequence[StepValues]) -> None:
    """Check ids, lengths and offsets of every step; raise SnapshotError naming the first bad entry."""
    check_page_ids(meta, page_ids)
    stored = frozenset(page_ids)
    for step_no, step in enumerate(steps):
        check_step(meta, meta.step_prefix(step_no), step, stored, len(page_ids))


def check_page_ids(meta: SnapshotMeta, page_ids: Sequence[int]) -> None:
    """Every stored page is one of the engine's pages, and stored once."""
    total = meta.backend.num_gpu_blocks
    if not page_ids:
        return
    if min(page_ids) < 0 or max(page_ids) >= total:
        i = next(i for i, page in enumerate(page_ids) if not 0 <= page < total)
        raise SnapshotError(f"page_ids[{i}] = {page_ids[i]} is outside the engine's cache of {total} pages "
                            "(backend.num_gpu_blocks)")
    if len(set(page_ids)) != len(page_ids):
        ordered = sorted(page_ids)
        dup = next(a for a, b in zip(ordered, ordered[1:]) if a == b)
        raise SnapshotError(f"page_ids lists page {dup} more than once")


def check_step(meta: SnapshotMeta, prefix: str, step: StepValues, stored: frozenset[int], num_stored: int) -> None:
    """One step's rules, in the order a replay meets them: lengths, query offsets, the block table, the slots."""
    backend, layer = meta.backend, meta.layer
    ps, total = backend.page_size, backend.num_gpu_blocks
    seq_lens, starts, width = step.seq_lens, step.query_start_loc, step.width
    for r, length in enumerate(seq_lens):
        if length < 0:
            raise SnapshotError(f"{prefix}seq_lens[{r}] = {length} is negative")
    for r, length in enumerate(seq_lens):
        if length > width * ps:
            raise SnapshotError(f"{prefix}seq_lens[{r}] = {length} needs {cdiv(length, ps)} pages of {ps} tokens, "
                                f"but {prefix}block_table has only {width} columns")
    for r, length in enumerate(seq_lens):
        if length > backend.max_model_len:
            raise SnapshotError(f"{prefix}seq_lens[{r}] = {length} exceeds backend.max_model_len "
                                f"({backend.max_model_len})")
    if starts[0] != 0:
        raise SnapshotError(f"{prefix}query_start_loc[0] = {starts[0]}, expected 0")
    for r in range(len(starts) - 1):
        if starts[r + 1] < starts[r]:
            raise SnapshotError(f"{prefix}query_start_loc decreases at index {r + 1} ({starts[r]} -> "
                                f"{starts[r + 1]})")
    if starts[-1] != step.num_tokens:
        raise SnapshotError(f"{prefix}query_start_loc[-1] = {starts[-1]} but {prefix}query has {step.num_tokens} "
                            "tokens")
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    # Cross-attention queries (decoder tokens) attend to the encoder's keys: as many or as few as there are.
    if layer.attn_type != CROSS_ATTN_TYPE:
        for r, (length, q) in enumerate(zip(seq_lens, query_lens)):
            if q > length:
                raise SnapshotError(f"{prefix}seq_lens[{r}] = {length} is shorter than the request's {q} query "
                                    "tokens")
    if layer.attn_type in ENCODER_SELF_ATTN_TYPES:
        for r, (length, q) in enumerate(zip(seq_lens, query_lens)):
            if length != q:
                raise SnapshotError(
                    f"{prefix}seq_lens[{r}] = {length} but the request has {q} query tokens: layer.attn_type "
                    f"{layer.attn_type!r} attends over the step's own tokens only, so they must be equal")
    table = step.block_table
    if table:
        if min(table) < 0 or max(table) >= total:
            i = next(i for i, page in enumerate(table) if not 0 <= page < total)
            raise SnapshotError(f"{prefix}block_table[{i // width}, {i % width}] = {table[i]} is outside the "
                                f"engine's cache of {total} pages (backend.num_gpu_blocks)")
        check_live_pages_stored(prefix, table, width, seq_lens, ps, stored, num_stored)
        check_reads_within_stored(meta, prefix, table, width, seq_lens, query_lens, num_stored)
    if step.slot_mapping is not None:
        check_slots(prefix, step.slot_mapping, ps, total, stored)


def check_live_pages_stored(prefix: str, table: Sequence[int], width: int, seq_lens: Sequence[int], page_size: int,
                            stored: frozenset[int], num_stored: int) -> None:
    """Every entry a request's length reaches (its live pages) names a stored page: a replay reads them all.

    ::

        seq_lens[r] = 40, page size 16: live columns 0..2 (cdiv(40, 16) = 3)
        block_table[r] = [ 7  3  9 | 12  0 ]     7, 3 and 9 must be in page_ids;
                           live      stale       12 and 0 need only be engine pages
    """
    for r, length in enumerate(seq_lens):
        live = table[r * width:r * width + cdiv(length, page_size)]
        missing = set(live).difference(stored)
        if missing:
            c = next(c for c, page in enumerate(live) if page in missing)
            raise SnapshotError(f"{prefix}block_table[{r}, {c}] = {live[c]} is not among the {num_stored} stored "
                                "pages (page_ids)")


def pages_before_window(layer, seq_len: int, query_len: int, page_size: int) -> int:
    """How many leading pages of a request hold only keys outside every query token's window.

    ::

        keys    0 ........ first ............... L-q ...... L-1
        pages   [ 0 ][ 0 ][ 0 ][ 7 ][ 3 ][ 9 ][ 4 ]
                 <- before ->   window of the first query token p = L-q

    The first query token sees keys from ``first = L - q - w + 1`` on (from its chunk's
    ``lookback``-th predecessor with chunk_lookback); later tokens see less of the past. vLLM's
    sliding-window managers free those pages and put the null block (engine page 0) in their entries,
    so one page legitimately fills all of them. 0 without a window.
    """
    if layer.sliding_window is None:
        return 0
    first_query = seq_len - query_len
    if layer.chunk_lookback is not None:
        chunk = layer.sliding_window // (layer.chunk_lookback + 1)
        first_key = (first_query // chunk - layer.chunk_lookback) * chunk
    else:
        first_key = first_query - layer.sliding_window + 1
    return max(0, first_key) // page_size


def check_reads_within_stored(meta: SnapshotMeta, prefix: str, table: Sequence[int], width: int,
                              seq_lens: Sequence[int], query_lens: Sequence[int], num_stored: int) -> None:
    """Refuse a table whose requests read far more pages than the snapshot stores (see REPEATED_READS_BYTES).

    Pages shared between requests (prefix caching) count once per request, and the entries before a
    sliding window (the null block, or a freed page since reused) are not counted.
    """
    layer, ps = meta.layer, meta.backend.page_size
    reads = []
    for r, (length, q) in enumerate(zip(seq_lens, query_lens)):
        first = min(pages_before_window(layer, length, q, ps), cdiv(length, ps))
        counted = table[r * width + first:r * width + cdiv(length, ps)]
        # R-SWA frees the pages between each request's visible prefix and its window; the prefix lengths are not
        # stored, so any null-block entry may be one of those.
        reads.append(len(counted) - (list(counted).count(0) if layer.rswa_window is not None else 0))
    beyond = [max(0, n - num_stored) for n in reads]
    token_bytes = 2 * layer.num_kv_heads * layer.head_size * 8
    if sum(beyond) * ps * token_bytes > REPEATED_READS_BYTES:
        r = next(r for r, extra in enumerate(beyond) if extra > 0)
        raise SnapshotError(
            f"{prefix}block_table[{r}] maps {reads[r]} live pages (seq_lens[{r}] = {seq_lens[r]}) but page_ids "
            f"stores only {num_stored}: its requests map stored pages again so often that replaying them would "
            f"take over {REPEATED_READS_BYTES // 1024**3} GiB; a request's pages are its own blocks in vLLM, so the "
            "table is not one it gives")


def check_slots(prefix: str, slots: Sequence[int], page_size: int, total: int, stored: frozenset[int]) -> None:
    """Each new token's slot is -1 (not written) or a slot of a stored page."""
    for t, slot in enumerate(slots):
        if slot < -1 or slot >= total * page_size:
            raise SnapshotError(f"{prefix}slot_mapping[{t}] = {slot} is outside the engine's cache of "
                                f"{total * page_size} slots")
    for t, slot in enumerate(slots):
        if slot >= 0 and slot // page_size not in stored:
            raise SnapshotError(f"{prefix}slot_mapping[{t}] = {slot} writes page {slot // page_size}, which is not "
                                "among the stored pages (page_ids)")


def check_layer_values(values: dict[str, Sequence[float]]) -> None:
    """The layer's value tensors (``sinks``, ``alibi_slopes``) hold finite numbers; SnapshotError naming the entry."""
    for name, column in values.items():
        for h, value in enumerate(column):
            if not math.isfinite(value):
                raise SnapshotError(f"tensor {name!r}[{h}] = {float(value)} is not finite (one value per query "
                                    f"head; meta field layer.{LAYER_VALUE_TENSORS[name]})")


__all__ = ["REPEATED_READS_BYTES", "StepValues", "check_layer_values", "check_live_pages_stored", "check_page_ids",
           "check_reads_within_stored", "check_slots", "check_step", "check_values", "pages_before_window"]
