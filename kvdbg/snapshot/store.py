"""The in-memory snapshot model and its public API: save_snapshot, load_snapshot, open_snapshot.

A snapshot holds one attention layer's decode step(s): the referenced KV pages
in the engine's own layout, the block tables (engine page ids), lengths, query,
optionally the step's new K/V with their slots and the engine's output. The
format is specified in docs/snapshot-format.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from kvdbg.util.atomic import TEMP_PREFIX, atomic_write
from kvdbg.snapshot.layout import kv_views, page_dim, stored_index
from kvdbg.errors import OptionError, SnapshotError
from kvdbg.snapshot.format import (
    CROSS_ATTN_TYPE,
    DTYPE_TO_ST,
    ENCODER_SELF_ATTN_TYPES,
    FORMAT_KEY,
    LAYER_VALUE_TENSORS,
    format_version,
    META_KEY,
    Header,
    SnapshotMeta,
    TensorEntry,
    check_structure,
    read_header,
    write_safetensors,
)

__all__ = [
    "Step",
    "Snapshot",
    "save_snapshot",
    "load_snapshot",
    "open_snapshot",
    "referenced_pages",
    "compact_cache",
]


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Step:
    """One decode step as the engine saw it. Page ids are the engine's physical ids."""

    block_table: torch.Tensor  # [num_reqs, max_pages] int32/int64
    seq_lens: torch.Tensor  # [num_reqs] total length incl. this step's query tokens
    query_start_loc: torch.Tensor  # [num_reqs + 1] offsets of each request's query tokens
    query: torch.Tensor  # [num_tokens, Hq, D]
    key: torch.Tensor | None = None  # [num_tokens, Hkv, D] new tokens, written before attention
    value: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None  # [num_tokens] page_id * page_size + offset, -1 = pad
    output: torch.Tensor | None = None  # [num_tokens, Hq, D] what the engine produced

    @property
    def num_reqs(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query.shape[0])

    @property
    def query_lens(self) -> list[int]:
        qsl = self.query_start_loc.tolist()
        return [b - a for a, b in zip(qsl, qsl[1:])]

    @property
    def has_update(self) -> bool:
        return self.slot_mapping is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("block_table", "seq_lens", "query_start_loc", "query", "key", "value", "slot_mapping", "output")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class Snapshot:
    """A loaded (memory-mapped) or freshly built snapshot."""

    meta: SnapshotMeta
    kv_cache: torch.Tensor  # stored pages in meta.kv_layout
    page_ids: torch.Tensor  # [num_stored_pages] engine id of each stored page
    steps: list[Step]
    path: str | None = field(default=None, compare=False)
    # Set by load_snapshot: the file's identity and kv_cache's pointer and version counter
    # as loaded, so that remap_kv_cache can tell the tensor is still exactly the file's.
    kv_source: tuple | None = field(default=None, compare=False, repr=False)
    # Set by load_snapshot: the parsed file header, so a caller never parses the file again.
    header: Header | None = field(default=None, compare=False, repr=False)
    # The layer's learned values, [num_heads] float32 each, present when layer.has_sinks / has_alibi say so.
    sinks: torch.Tensor | None = None  # the sink logit of each query head (joins the softmax denominator)
    alibi_slopes: torch.Tensor | None = None  # the ALiBi slope of each query head

    @property
    def num_pages(self) -> int:
        return int(self.page_ids.shape[0])

    @property
    def page_size(self) -> int:
        return self.meta.backend.page_size

    def kv_views(self, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as views ``[pages, Hkv, page_size, D]`` of ``cache`` (default: the stored one); see kvdbg.snapshot.layout."""
        return kv_views(self.meta, self.kv_cache if cache is None else cache)

    def remap_kv_cache(self) -> torch.Tensor | None:
        """A fresh private (copy-on-write) mapping of the file's ``kv_cache``, or None.

        None unless ``kv_cache`` is still the tensor load_snapshot mapped, never
        written in place, and the file is unchanged since. Writing to the result
        changes neither the file nor ``kv_cache``; only pages written become memory
        of their own, which is why a replay uses it instead of copying the cache.
        """
        if self.kv_source is None or self.path is None:
            return None
        file_id, data_ptr, version = self.kv_source
        kv = self.kv_cache
        if kv.device.type != "cpu" or kv.data_ptr() != data_ptr or kv._version != version:
            return None
        try:
            if _file_identity(self.path) != file_id:
                return None
            from safetensors import safe_open

            with safe_open(self.path, framework="pt", device="cpu") as fh:
                mapped = fh.get_tensor("kv_cache")
        except Exception:  # the file moved or became unreadable: the caller copies instead
            return None
        if mapped.shape != kv.shape or mapped.dtype != kv.dtype or mapped.data_ptr() == kv.data_ptr():
            return None
        return mapped

    def to_stored_index(self, engine_ids: torch.Tensor) -> torch.Tensor:
        """Map engine page ids to indices into the stored pages; -1 where a page is not stored."""
        return stored_index(self.page_ids, engine_ids)

    def stored_block_table(self, step: int) -> torch.Tensor:
        """The step's block table with engine ids replaced by stored-page indices (-1: not stored)."""
        return self.to_stored_index(self.steps[step].block_table)

    def null_page_index(self) -> int | None:
        """Stored index of engine page 0 (vLLM's null block), if it is stored."""
        hits = (self.page_ids == 0).nonzero()
        return int(hits[0, 0]) if len(hits) else None

    def layer_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's value tensors the snapshot holds (``sinks``, ``alibi_slopes``), by file name."""
        return {n: getattr(self, n) for n in LAYER_VALUE_TENSORS if getattr(self, n) is not None}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"kv_cache": self.kv_cache, "page_ids": self.page_ids, **self.layer_tensors()}
        for i, step in enumerate(self.steps):
            prefix = self.meta.step_prefix(i)
            out.update({prefix + n: t for n, t in step.tensors().items()})
        return out


# --------------------------------------------------------------------------- compaction


def live_page_counts(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return (seq_lens.to(torch.int64) + page_size - 1) // page_size


def live_mask(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_reqs, width] True for the block-table entries a request's length reaches."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    return cols.unsqueeze(0) < live_page_counts(seq_lens, page_size).unsqueeze(1)


def referenced_pages(steps: Iterable[Step], page_size: int) -> torch.Tensor:
    """Sorted engine ids of every page a step reads (live block-table entries) or writes (slots)."""
    parts = []
    for step in steps:
        bt = step.block_table.to(torch.int64)
        parts.append(bt[live_mask(bt, step.seq_lens, page_size)])
        if step.slot_mapping is not None:
            slots = step.slot_mapping.to(torch.int64)
            parts.append(slots[slots >= 0] // page_size)
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    return torch.unique(torch.cat(parts))


def compact_cache(engine_cache: torch.Tensor, kv_layout: str, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy only ``page_ids`` out of a full engine cache tensor (in its own layout)."""
    idx = page_ids.to(torch.int64).to(engine_cache.device)
    return engine_cache.index_select(page_dim(kv_layout), idx).contiguous()


# --------------------------------------------------------------------------- validation


def _entries(tensors: dict[str, torch.Tensor]) -> dict[str, TensorEntry]:
    out = {}
    for name, t in tensors.items():
        out[name] = TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), 0, t.numel() * t.element_size())
    return out


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_values(meta: SnapshotMeta, page_ids: torch.Tensor, steps: list[Step]) -> None:
    """Check ids, lengths and offsets; raise SnapshotError naming the first bad entry."""
    backend = meta.backend
    ps, total = backend.page_size, backend.num_gpu_blocks
    ids = page_ids.to(torch.int64)
    if len(ids):
        bad = (ids < 0) | (ids >= total)
        if bad.any():
            (i,) = _first_index(bad)
            raise SnapshotError(
                f"page_ids[{i}] = {int(ids[i])} is outside the engine's cache of {total} pages "
                "(backend.num_gpu_blocks)"
            )
        uniq = torch.unique(ids)
        if len(uniq) != len(ids):
            sorted_ids, _ = torch.sort(ids)
            dup = int(sorted_ids[1:][sorted_ids[1:] == sorted_ids[:-1]][0])
            raise SnapshotError(f"page_ids lists page {dup} more than once")
    for step_no, step in enumerate(steps):
        prefix = meta.step_prefix(step_no)
        bt = step.block_table.to(torch.int64)
        sl = step.seq_lens.to(torch.int64)
        qsl = step.query_start_loc.to(torch.int64)
        width = bt.shape[1]
        if len(sl) and (sl < 0).any():
            (r,) = _first_index(sl < 0)
            raise SnapshotError(f"{prefix}seq_lens[{r}] = {int(sl[r])} is negative")
        too_long = sl > width * ps
        if too_long.any():
            (r,) = _first_index(too_long)
            need = (int(sl[r]) + ps - 1) // ps
            raise SnapshotError(
                f"{prefix}seq_lens[{r}] = {int(sl[r])} needs {need} pages of {ps} tokens, "
                f"but {prefix}block_table has only {width} columns"
            )
        over_model = sl > backend.max_model_len
        if over_model.any():
            (r,) = _first_index(over_model)
            raise SnapshotError(
                f"{prefix}seq_lens[{r}] = {int(sl[r])} exceeds backend.max_model_len ({backend.max_model_len})"
            )
        if int(qsl[0]) != 0:
            raise SnapshotError(f"{prefix}query_start_loc[0] = {int(qsl[0])}, expected 0")
        steps_back = qsl[1:] < qsl[:-1]
        if steps_back.any():
            (r,) = _first_index(steps_back)
            raise SnapshotError(
                f"{prefix}query_start_loc decreases at index {r + 1} ({int(qsl[r])} -> {int(qsl[r + 1])})"
            )
        if int(qsl[-1]) != step.num_tokens:
            raise SnapshotError(
                f"{prefix}query_start_loc[-1] = {int(qsl[-1])} but {prefix}query has {step.num_tokens} tokens"
            )
        qlens = qsl[1:] - qsl[:-1]
        attn_type = meta.layer.attn_type
        # Cross-attention queries (decoder tokens) attend to the encoder's keys: as many or as few as there are.
        short = qlens > sl if attn_type != CROSS_ATTN_TYPE else torch.zeros_like(sl, dtype=torch.bool)
        if short.any():
            (r,) = _first_index(short)
            raise SnapshotError(
                f"{prefix}seq_lens[{r}] = {int(sl[r])} is shorter than the request's {int(qlens[r])} query tokens"
            )
        if attn_type in ENCODER_SELF_ATTN_TYPES:
            context = sl != qlens
            if context.any():
                (r,) = _first_index(context)
                raise SnapshotError(
                    f"{prefix}seq_lens[{r}] = {int(sl[r])} but the request has {int(qlens[r])} query tokens: "
                    f"layer.attn_type {attn_type!r} attends over the step's own tokens only, so they must be equal"
                )
        if bt.numel():
            outside = (bt < 0) | (bt >= total)
            if outside.any():
                r, c = _first_index(outside)
                raise SnapshotError(
                    f"{prefix}block_table[{r}, {c}] = {int(bt[r, c])} is outside the engine's cache of "
                    f"{total} pages (backend.num_gpu_blocks)"
                )
            live = live_mask(bt, sl, ps)
            missing = live & (stored_index(ids, bt) < 0)
            if missing.any():
                r, c = _first_index(missing)
                raise SnapshotError(
                    f"{prefix}block_table[{r}, {c}] = {int(bt[r, c])} is not among the {len(ids)} "
                    "stored pages (page_ids)"
                )
            _check_reads_within_stored(meta, prefix, bt, sl, qlens, live, len(ids))
        if step.slot_mapping is not None:
            slots = step.slot_mapping.to(torch.int64)
            bad = (slots < -1) | (slots >= total * ps)
            if bad.any():
                (t,) = _first_index(bad)
                raise SnapshotError(
                    f"{prefix}slot_mapping[{t}] = {int(slots[t])} is outside the engine's cache of "
                    f"{total * ps} slots"
                )
            pages = slots // ps
            missing = (slots >= 0) & (stored_index(ids, pages) < 0)
            if missing.any():
                (t,) = _first_index(missing)
                raise SnapshotError(
                    f"{prefix}slot_mapping[{t}] = {int(slots[t])} writes page {int(pages[t])}, which is not "
                    "among the stored pages (page_ids)"
                )


def pages_before_window(layer, seq_lens: torch.Tensor, query_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_reqs] how many leading pages of each request hold only keys outside every query token's window.

    ::

        keys    0 ........ first ............... L-q ...... L-1
        pages   [ 0 ][ 0 ][ 0 ][ 7 ][ 3 ][ 9 ][ 4 ]
                 <- before ->   window of the first query token p = L-q

    The first query token sees keys from ``first = L - q - w + 1`` on (from its chunk's
    ``lookback``-th predecessor with chunk_lookback); later tokens see less of the past. vLLM's
    sliding-window managers free those pages and put the null block (engine page 0) in their entries,
    so one page legitimately fills all of them. 0 without a window.
    """
    lengths = seq_lens.to(torch.int64)
    if layer.sliding_window is None:
        return torch.zeros_like(lengths)
    first_query = lengths - query_lens.to(torch.int64)
    if layer.chunk_lookback is not None:
        chunk = layer.sliding_window // (layer.chunk_lookback + 1)
        first_key = (torch.div(first_query, chunk, rounding_mode="floor") - layer.chunk_lookback) * chunk
    else:
        first_key = first_query - layer.sliding_window + 1
    return first_key.clamp(min=0) // page_size


# A request's live entries past its window name distinct pages in vLLM, all of them stored. An engine bug may
# map a page again (a finding for `kvdbg map` and replay, never refused for that alone); the entries beyond the
# stored pages are allowed up to what replaying them would cost at most (K and V in float64), so that a file of
# a few MB mapping one page a million times cannot ask a replay for gigabytes.
REPEATED_READS_BYTES = 2 * 1024**3


def _check_reads_within_stored(meta: SnapshotMeta, prefix: str, block_table: torch.Tensor, seq_lens: torch.Tensor,
                               query_lens: torch.Tensor, live: torch.Tensor, num_stored: int) -> None:
    """Refuse a table whose requests read far more pages than the snapshot stores (see REPEATED_READS_BYTES).

    Pages shared between requests (prefix caching) count once per request, and the entries before a
    sliding window (the null block, or a freed page since reused) are not counted.
    """
    layer = meta.layer
    cols = torch.arange(block_table.shape[1], device=block_table.device).unsqueeze(0)
    counted = live & (cols >= pages_before_window(layer, seq_lens, query_lens, meta.backend.page_size).unsqueeze(1))
    if layer.rswa_window is not None:
        # R-SWA frees the pages between each request's visible prefix and its window; the prefix
        # lengths are not stored, so any null-block entry may be one of those.
        counted &= block_table != 0
    reads = counted.sum(dim=1)
    beyond = (reads - num_stored).clamp(min=0)
    token_bytes = 2 * layer.num_kv_heads * layer.head_size * 8
    cost = int(beyond.sum()) * meta.backend.page_size * token_bytes
    if cost > REPEATED_READS_BYTES:
        (r,) = _first_index(beyond > 0)
        raise SnapshotError(
            f"{prefix}block_table[{r}] maps {int(reads[r])} live pages (seq_lens[{r}] = {int(seq_lens[r])}) "
            f"but page_ids stores only {num_stored}: its requests map stored pages again so often that replaying "
            f"them would take over {REPEATED_READS_BYTES // 1024**3} GiB; a request's pages are its own blocks in "
            "vLLM, so the table is not one it gives"
        )


def check_layer_values(meta: SnapshotMeta, tensors: dict[str, torch.Tensor]) -> None:
    """The layer's value tensors (``sinks``, ``alibi_slopes``) hold finite numbers; SnapshotError naming the entry."""
    for name, values in tensors.items():
        bad = ~torch.isfinite(values.to(torch.float64))
        if bad.any():
            (h,) = _first_index(bad)
            raise SnapshotError(f"tensor {name!r}[{h}] = {float(values[h])} is not finite (one value per query "
                                f"head; meta field layer.{LAYER_VALUE_TENSORS[name]})")


def validate(snapshot: Snapshot) -> None:
    """Run every structural and value check on an in-memory snapshot."""
    if len(snapshot.steps) != snapshot.meta.num_steps:
        raise SnapshotError(
            f"meta field num_steps is {snapshot.meta.num_steps} but the snapshot has {len(snapshot.steps)} steps"
        )
    tensors = snapshot.tensors()
    header = Header("<memory>", 0, 0, {}, _entries(tensors), snapshot.meta)
    check_structure(header)
    check_values(snapshot.meta, snapshot.page_ids, snapshot.steps)
    check_layer_values(snapshot.meta, snapshot.layer_tensors())


# --------------------------------------------------------------------------- I/O


def save_snapshot(snapshot: Snapshot, path: str | os.PathLike, *, overwrite: bool = False,
                  temp_prefix: str = TEMP_PREFIX) -> str:
    """Validate and write ``snapshot`` atomically (temp file + rename). Returns the path.

    An existing file is never replaced unless ``overwrite`` is true. ``temp_prefix``
    names the temp file (kvdbg.util.atomic.atomic_write).
    """
    validate(snapshot)
    entries = []
    for name, t in snapshot.tensors().items():
        if dtype_name(t.dtype) not in DTYPE_TO_ST:
            raise OptionError(f"tensor {name!r} has dtype {t.dtype}, which the snapshot format cannot store")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        entries.append((name, dtype_name(t.dtype), tuple(t.shape), raw))
    metadata = {FORMAT_KEY: format_version(snapshot.meta), META_KEY: snapshot.meta.to_json()}
    return atomic_write(path, lambda fh: write_safetensors(fh, entries, metadata), overwrite=overwrite,
                        temp_prefix=temp_prefix)


def open_snapshot(path: str | os.PathLike) -> Header:
    """Read only the header: metadata, tensor shapes and dtypes. Never touches tensor data."""
    return read_header(path)


def load_snapshot(path: str | os.PathLike, *, validate_values: bool = True) -> Snapshot:
    """Load and validate a snapshot. Tensors are memory-mapped (private, copy-on-write):

    nothing is read until used, and writing to them never changes the file.
    """
    from safetensors import safe_open

    header = read_header(path)
    file_id = _file_identity(header.path)
    try:
        with safe_open(header.path, framework="pt", device="cpu") as fh:
            tensors = {name: fh.get_tensor(name) for name in header.tensors}
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise SnapshotError(f"{header.path}: safetensors cannot read the file: {str(exc).splitlines()[0][:200]}") from None
    meta = header.meta
    steps = []
    for i in range(meta.num_steps):
        prefix = meta.step_prefix(i)
        steps.append(Step(**{n: tensors.get(prefix + n) for n in (
            "block_table", "seq_lens", "query_start_loc", "query", "key", "value", "slot_mapping", "output")}))
    kv = tensors["kv_cache"]
    snap = Snapshot(meta=meta, kv_cache=kv, page_ids=tensors["page_ids"], steps=steps, path=header.path,
                    kv_source=(file_id, kv.data_ptr(), kv._version), header=header,
                    **{name: tensors.get(name) for name in LAYER_VALUE_TENSORS})
    if validate_values:
        try:
            check_values(meta, snap.page_ids, steps)
            check_layer_values(meta, snap.layer_tensors())
        except SnapshotError as exc:
            raise SnapshotError(f"{header.path}: {exc}") from None
    return snap


def _file_identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def with_meta(snapshot: Snapshot, **changes) -> Snapshot:
    """A copy of ``snapshot`` sharing its tensors, with metadata fields replaced."""
    return replace(snapshot, meta=replace(snapshot.meta, **changes))
