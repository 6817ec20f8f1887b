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
from kvdbg.snapshot import rules
from kvdbg.snapshot.rules import StepValues
from kvdbg.snapshot.format import (
    DTYPE_TO_ST,
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


def check_values(meta: SnapshotMeta, page_ids: torch.Tensor, steps: list[Step]) -> None:
    """Check ids, lengths and offsets; raise SnapshotError naming the first bad entry.

    The rules are kvdbg.snapshot.rules' (plain Python, shared with `kvdbg window SNAP`, which holds a file
    to them without torch); here the index tensors are handed over as lists.
    """
    plain = []
    for step in steps:
        table = step.block_table
        plain.append(StepValues(
            block_table=table.reshape(-1).tolist(), width=int(table.shape[1]) if table.dim() == 2 else 0,
            seq_lens=step.seq_lens.tolist(), query_start_loc=step.query_start_loc.tolist(),
            num_tokens=step.num_tokens,
            slot_mapping=None if step.slot_mapping is None else step.slot_mapping.reshape(-1).tolist()))
    rules.check_values(meta, page_ids.reshape(-1).tolist(), plain)


def check_layer_values(meta: SnapshotMeta, tensors: dict[str, torch.Tensor]) -> None:
    """The layer's value tensors (``sinks``, ``alibi_slopes``) hold finite numbers (kvdbg.snapshot.rules)."""
    rules.check_layer_values({name: values.to(torch.float64).reshape(-1).tolist() for name, values in tensors.items()})


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
