"""Turn one engine step into what a snapshot file holds: the copying, in the engine's thread.

Everything here either returns a record or raises a typed error
(:class:`CaptureInputError` naming the field, ``TypeError`` for a caller's
programming error); it keeps no state, holds no budget and writes no file. The
never-raising shell around it (budgets, failure policy, the background writer)
is :class:`kvdbg.capture.capturer.Capturer`.

The three inputs of a capture (:mod:`kvdbg.capture.inputs`, re-exported here)::

    CaptureLayer    per layer, built and validated once: heads, head size, scale,
                    dtypes, FP8 scales, the engine cache's layout, ...
    CaptureBackend  the engine's settings for the backend: name, max_model_len, ...
    StepTensors     per step: query, cache, block table, lengths, causal, new K/V

What runs where::

    engine's thread (only copies; this module and kvdbg.capture.buffers)
      save_pre_update(layer, ...)             -> PreUpdate       before a cache update: new K/V, pages it overwrites
      plan_capture(layer, backend, tensors)   -> CapturePlan     shapes checked, small tensors copied, page ids, a size bound
      CapturePlan.gather()                    -> PendingCapture  the pages copied, in the engine's layout
      PendingCapture.attach_output(output)                       the engine's output copied after the forward
    writer's thread (kvdbg.capture.build)
      build_snapshot(pending)                 -> Snapshot        waits for the copies, converts and restores pages,
                                                                 metadata, provenance
    complete_capture(pending, output)         -> Snapshot        the last two in one call (kvdbg.capture.build)
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from kvdbg.capture.buffers import HostBuffers, StepCopies
from kvdbg.capture.engine_layouts import EngineLayout, engine_layout
from kvdbg.capture.inputs import (
    CaptureBackend,
    CaptureInputError,
    CaptureLayer,
    StepTensors,
    WrittenKVMismatch,
    infer_kv_layout,
    resolve_kv_layout,
)
from kvdbg.snapshot.format import MODEL_DTYPES
from kvdbg.snapshot.store import Step, dtype_name

__all__ = [
    "CaptureBackend",
    "CaptureInputError",
    "CaptureLayer",
    "CapturePlan",
    "PendingCapture",
    "PreUpdate",
    "StepTensors",
    "WrittenKVMismatch",
    "infer_kv_layout",
    "plan_capture",
    "prepare_capture",
    "referenced_page_ids",
    "resolve_kv_layout",
    "save_pre_update",
]


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _copy_now(t: torch.Tensor, copies: StepCopies) -> torch.Tensor:
    """A host copy whose values can be read at once: capture needs them to choose the pages.

    On CPU a clone; a tensor on a device is read synchronously (give these on the
    host to spare the engine that wait).
    """
    return copies.copy(t) if t.is_cpu else _to_cpu(t)


def _keep_on_host(t: torch.Tensor, copies: StepCopies) -> torch.Tensor:
    """The caller's own copy, kept; read to the host when it is on a device."""
    return t if t.is_cpu else _to_cpu(t)


# Up to this many block-table entries, the pages of a step are chosen in plain Python (see referenced_page_ids).
SMALL_TABLE_ENTRIES = 1024


def referenced_page_ids(block_table: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray | None,
                        page_size: int) -> np.ndarray:
    """Sorted engine ids (int64) of the pages a step reads (live block-table entries) or writes (its slots).

    The same rule as :func:`kvdbg.snapshot.store.referenced_pages`, without torch: it
    runs in the engine's thread on every captured step, where each torch call
    costs more than the arithmetic. A small batch (the usual decode step) is
    done in plain Python, which beats numpy's per-call cost up to about a
    thousand table entries; a larger one in numpy.
    """
    if block_table.size <= SMALL_TABLE_ENTRIES:
        ids: set[int] = set()
        for row, length in zip(block_table.tolist(), seq_lens.tolist()):
            ids.update(row[: (length + page_size - 1) // page_size])
        if slots is not None:
            ids.update(slot // page_size for slot in slots.tolist() if slot >= 0)
        return np.array(sorted(ids), dtype=np.int64)
    live_pages = (seq_lens.astype(np.int64) + (page_size - 1)) // page_size
    live = np.arange(block_table.shape[1]) < live_pages[:, None]
    ids = block_table[live].astype(np.int64, copy=False)
    if slots is not None:
        written = slots[slots >= 0].astype(np.int64, copy=False) // page_size
        ids = np.concatenate((ids, written))
    return np.unique(ids)


# --------------------------------------------------------------------------- before the cache update


@dataclass
class PreUpdate:
    """What an engine's cache update is about to change, copied before it runs.

    For engines that write the step's new K/V into the cache *before* calling the
    attention forward (vLLM's ``do_kv_cache_update``), this is how the snapshot
    still holds the cache as the step found it. The pages stay in the engine's
    layout; the writer converts them. With ``check_written`` the writer also
    reads the slots the update wrote back from the pages copied at the forward
    (:class:`WrittenKVMismatch` when they do not hold ``key``/``value``).
    """

    layer_name: str
    step: int | None
    key: torch.Tensor  # [tokens, Hkv, D] on the host, as given (padded rows included)
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [tokens]
    page_ids: torch.Tensor  # int64, sorted: pages the update writes
    pages: torch.Tensor  # their content before the update, in the engine's layout (kv_layout)
    kv_layout: str  # the name of the engine layout of the cache they came from
    page_size: int
    copies: StepCopies | None = field(default=None, repr=False)  # what the writer waits for
    layout: EngineLayout | None = field(default=None, repr=False)  # that layout (None: looked up by name)
    check_written: bool = False  # the writer reads the written slots back

    def snapshot_pages(self) -> torch.Tensor:
        """The saved pages in the snapshot layout (writer side: waits for the copies, converts)."""
        if self.copies is not None:
            self.copies.wait()
        return (self.layout or engine_layout(self.kv_layout)).convert(self.pages)


def save_pre_update(layer: CaptureLayer, *, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_cache: torch.Tensor, step: int | None = None, buffers: HostBuffers | None = None,
                    check_written: bool = False, ready: Any = None) -> PreUpdate:
    """Copy the step's new K/V and the pages they will overwrite; call it before the cache update.

    Only copies (engine's thread); the pages are converted when the snapshot is
    built. With ``check_written`` the snapshot's builder reads the slots the
    update wrote back from the pages the forward's capture copies, and refuses
    the step unless they hold ``key``/``value`` (:class:`WrittenKVMismatch`).
    ``ready``: ``slot_mapping`` is a host copy still in flight, complete once
    ``ready.synchronize()`` returns (see :class:`StepTensors` ``metadata_ready``).
    """
    _require(layer, CaptureLayer, "layer")
    layout = _layout_for(layer, kv_cache)
    if ready is not None:
        ready.synchronize()
    page_size = kv_cache.shape[layout.token_dim]
    num_blocks = kv_cache.shape[layout.page_dim]
    copies = StepCopies(kv_cache.device, buffers)
    slots = _copy_now(slot_mapping, copies)
    if slots.ndim != 1:
        raise CaptureInputError(f"slot_mapping has shape {list(slots.shape)}, expected [num_tokens]")
    if slots.shape[0] <= SMALL_TABLE_ENTRIES:  # plain Python beats numpy's per-call cost here (a decode step)
        written = [slot for slot in slots.tolist() if slot >= 0]
        highest = max(written, default=-1)
    else:
        written = slots.numpy()
        written = written[written >= 0]
        highest = int(written.max()) if written.size else -1
    if highest >= num_blocks * page_size:
        raise CaptureInputError(
            f"slot_mapping holds slot {highest}, outside the cache of {num_blocks * page_size} slots"
        )
    if isinstance(written, list):  # numpy builds the tensor in a third of torch.tensor's time
        page_ids = torch.from_numpy(np.array(sorted({slot // page_size for slot in written}), dtype=np.int64))
    else:
        page_ids = torch.from_numpy(np.unique(written.astype(np.int64, copy=False) // page_size))
    pre = PreUpdate(layer_name=layer.name, step=step, key=copies.copy(key), value=copies.copy(value),
                    slot_mapping=slots, page_ids=page_ids, pages=copies.gather(kv_cache, layout.page_dim, page_ids),
                    kv_layout=layout.name, page_size=page_size, copies=copies, layout=layout,
                    check_written=check_written)
    copies.close()
    return pre


# --------------------------------------------------------------------------- before the forward (engine thread)


@dataclass
class CapturePlan:
    """A step whose small tensors are copied to the host, its pages chosen but not yet copied.

    Built in the engine's thread by :func:`plan_capture`; only shapes were
    checked. Everything else (the metadata, the reader's checks, the layout
    conversion) happens when the snapshot is built (:func:`build_snapshot`).
    """

    layer: CaptureLayer
    backend: CaptureBackend
    layout: EngineLayout = field(repr=False)
    step: Step  # host copies, rows past the step's tokens dropped
    page_ids: torch.Tensor  # int64, sorted engine ids of the pages the step reads or writes
    num_tokens: int
    causal: bool | torch.Tensor  # a per-request tensor is checked when the snapshot is built
    lower_bound_bytes: int  # the file is at least this big (data without output or header)
    rank: int
    step_index: int | None
    rank_source: str = "given"
    engine: str | None = None
    info: Mapping[str, Any] | None = None
    notes: str = ""
    captured_at: float = 0.0  # time.time() in the engine's thread
    query_rows_given: int = 0
    kv_cache: torch.Tensor | None = field(default=None, repr=False)
    pre_update: PreUpdate | None = field(default=None, repr=False)
    copies: StepCopies | None = field(default=None, repr=False)
    staged: Any = field(default=None, repr=False)  # StagedPages: where the pages are read instead of kv_cache

    @property
    def output_bytes(self) -> int:
        """Bytes the engine's output for this step will add."""
        return self.num_tokens * self.layer.num_heads * self.layer.head_size * _MODEL_DTYPE_BYTES[self.layer.dtype]

    def gather(self) -> "PendingCapture":
        """Copy the step's pages to the host, in the engine's layout (the expensive part; engine's thread)."""
        if self.copies is None:
            self.copies = StepCopies(self.kv_cache.device)
        staged = self.staged
        select = None
        if staged is not None:  # the same pages, from the copy staged on the device when the step ran
            positions = staged.positions(self.page_ids.numpy())
            block = self.copies.block(staged.pages, staged.page_dim, positions) if staged.own_stream else None
            if block is not None:  # the staged span in one copy; the writer picks the step's pages from it
                pages, within = block
                select = (staged.page_dim, within)
            else:
                pages = self.copies.gather(staged.pages, staged.page_dim, positions)
        else:
            pages = self.copies.gather(self.kv_cache, self.layout.page_dim, self.page_ids)
        self.copies.mark()  # the copies so far are on this stream (the engine may switch before finish)
        return PendingCapture(plan=self, pages=pages, select=select)


@dataclass
class PendingCapture:
    """A step copied before the forward, waiting for the engine's output; then handed to the writer."""

    plan: CapturePlan
    pages: torch.Tensor  # the step's pages in the engine's layout, on the host
    output: torch.Tensor | None = None
    # (dim, positions): ``pages`` is a staged span holding the step's pages at these positions along dim, picked
    # by the writer (StepCopies.block); None: ``pages`` are the step's pages
    select: tuple[int, torch.Tensor] | None = None

    def step_pages(self) -> torch.Tensor:
        """The step's pages in the engine's layout (writer side, once the copies are complete)."""
        if self.select is None:
            return self.pages
        return self.pages.index_select(self.select[0], self.select[1])

    @property
    def layer(self) -> CaptureLayer:
        return self.plan.layer

    @property
    def step_index(self) -> int | None:
        return self.plan.step_index

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def nbytes(self) -> int:
        """Host memory this step holds until it is written (a little more than its file's data)."""
        plan = self.plan
        total = plan.lower_bound_bytes + (0 if self.output is None else plan.output_bytes)
        if self.select is not None:  # the staged span is held besides the pages picked from it
            total += _nbytes(self.pages)
        pre = plan.pre_update
        if pre is not None:
            total += _nbytes(pre.pages) + _nbytes(pre.key) + _nbytes(pre.value) + _nbytes(pre.slot_mapping)
        return total

    def attach_output(self, output: torch.Tensor | None) -> None:
        """Copy the engine's output (``[>= tokens, Hq, D]`` or ``[.., Hq*D]``) after the forward (engine's thread)."""
        layer = self.plan.layer
        if output is not None:
            out = output
            if out.ndim == 2 and out.shape[-1] == layer.num_heads * layer.head_size:
                out = out.view(out.shape[0], layer.num_heads, layer.head_size)
            shape = out.shape
            if len(shape) != 3 or shape[1] != layer.num_heads or shape[2] != layer.head_size \
                    or shape[0] < self.num_tokens:
                raise CaptureInputError(f"output has shape {list(output.shape)}, expected [>= {self.num_tokens}, "
                                        f"{layer.num_heads}, {layer.head_size}]")
            if out.dtype != _TORCH_DTYPES.get(layer.dtype):
                raise CaptureInputError(f"output has dtype {dtype_name(out.dtype)}, expected the model dtype "
                                        f"{layer.dtype}")
            copies = self.plan.copies
            rows = out if out.shape[0] == self.num_tokens else out[: self.num_tokens]
            self.output = copies.copy(rows) if copies is not None else _to_cpu(rows)
        if self.plan.copies is not None:
            self.plan.copies.close()

    def release(self) -> None:
        """Give the host buffers back once the snapshot is written (writer's thread)."""
        for copies in (self.plan.copies, getattr(self.plan.pre_update, "copies", None)):
            if copies is not None:
                copies.release()


_TORCH_DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}
_MODEL_DTYPE_BYTES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _TORCH_DTYPES.items()}


def _require(value: Any, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Per engine cache tensor (by id, checked by a weak reference): the layout resolved for it. The cache
# is the same tensor on every step, so its layout is checked once.
_LAYOUTS: dict[int, tuple] = {}


def _layout_for(layer: CaptureLayer, kv_cache: torch.Tensor) -> EngineLayout:
    key = (layer.kv_layout, layer.num_kv_heads, layer.head_size, kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
    hit = _LAYOUTS.get(id(kv_cache))
    if hit is not None and hit[0]() is kv_cache and hit[1] == key:
        return hit[2]
    layout = resolve_kv_layout(layer.kv_layout, kv_cache, layer.num_kv_heads, layer.head_size)
    try:
        if len(_LAYOUTS) > 4096:  # caches of engines long gone
            _LAYOUTS.clear()
        _LAYOUTS[id(kv_cache)] = (weakref.ref(kv_cache), key, layout)
    except TypeError:  # a tensor type that cannot be weakly referenced: resolved every step
        pass
    return layout


def plan_capture(layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, *, step: int | None = None,
                 rank: int = 0, rank_source: str = "given", engine: str | None = None,
                 info: Mapping[str, Any] | None = None, notes: str = "",
                 buffers: HostBuffers | None = None) -> CapturePlan:
    """Check one step's shapes, copy its small tensors to the host and choose its pages (engine's thread).

    Every torch call here costs the engine about a microsecond, so this does
    the least that copying needs: shape checks on the tensors as given, one copy
    each, the page ids in numpy. The rest waits for :func:`build_snapshot`.
    """
    _require(layer, CaptureLayer, "layer")
    _require(backend, CaptureBackend, "backend")
    _require(tensors, StepTensors, "tensors")
    t = tensors
    kv_cache = t.kv_cache
    layout = _layout_for(layer, kv_cache)
    cache_shape = kv_cache.shape
    page_size, tensor_blocks = cache_shape[layout.token_dim], cache_shape[layout.page_dim]
    if backend.page_size is not None and backend.page_size != page_size:
        raise CaptureInputError(f"page_size is {backend.page_size} but kv_cache holds pages of {page_size} tokens")
    if backend.num_gpu_blocks is not None and backend.num_gpu_blocks != tensor_blocks:
        raise CaptureInputError(f"num_gpu_blocks is {backend.num_gpu_blocks} but kv_cache holds {tensor_blocks} pages")

    # The metadata that decides which pages to copy: read now, on the host.
    if t.metadata_ready is not None:
        t.metadata_ready.synchronize()
    copies = t.copies if t.copies is not None else StepCopies(kv_cache.device, buffers)
    own = _keep_on_host if t.metadata_copied else _copy_now
    bt, sl, qsl = own(t.block_table, copies), own(t.seq_lens, copies), own(t.query_start_loc, copies)
    if bt.ndim != 2:
        raise CaptureInputError(f"block_table has shape {list(bt.shape)}, expected [num_reqs, max_pages]")
    num_reqs = bt.shape[0]
    if sl.shape != (num_reqs,):
        raise CaptureInputError(f"seq_lens has shape {list(sl.shape)}, expected [{num_reqs}] like block_table")
    if qsl.shape != (num_reqs + 1,):
        raise CaptureInputError(f"query_start_loc has shape {list(qsl.shape)}, expected [{num_reqs + 1}]")
    bt_np, sl_np = bt.numpy(), sl.numpy()
    num_tokens = int(qsl.numpy()[-1])
    query = t.query
    q_shape = query.shape
    if len(q_shape) != 3 or q_shape[1] != layer.num_heads or q_shape[2] != layer.head_size \
            or not 0 <= num_tokens <= q_shape[0]:
        raise CaptureInputError(
            f"query has shape {list(q_shape)}, expected [>= {num_tokens}, {layer.num_heads}, {layer.head_size}] "
            "(query_start_loc[-1] tokens, num_heads, head_size)"
        )
    causal = t.causal
    if isinstance(causal, torch.Tensor):
        causal = own(causal, copies)
    elif not isinstance(causal, bool):
        raise CaptureInputError(f"causal must be a bool, got {type(causal).__name__}")

    key, value, slot_mapping, pre = t.key, t.value, t.slot_mapping, t.pre_update
    if pre is not None:
        _require(pre, PreUpdate, "pre_update")
        if pre.kv_layout != layout.name or pre.page_size != page_size:
            raise CaptureInputError("pre_update was saved from a cache of another layout or page size")
        key, value, slot_mapping = pre.key, pre.value, pre.slot_mapping
    # Rows past the step's tokens (CUDA-graph padding) are not stored; most steps have none.
    padded = num_tokens != q_shape[0]
    step_record = Step(block_table=bt, seq_lens=sl, query_start_loc=qsl,
                       query=copies.copy(query[:num_tokens] if padded else query))
    host = _nbytes(bt) + _nbytes(sl) + _nbytes(qsl) + num_tokens * q_shape[1] * q_shape[2] * query.element_size()
    slots = None
    if key is not None or value is not None or slot_mapping is not None:
        if key is None or value is None or slot_mapping is None:
            given = [n for n, x in (("key", key), ("value", value), ("slot_mapping", slot_mapping)) if x is not None]
            raise CaptureInputError(f"key, value and slot_mapping come together; only {', '.join(given)} given")
        for name, x in (("key", key), ("value", value)):
            shape = x.shape
            if len(shape) != 3 or shape[1] != layer.num_kv_heads or shape[2] != layer.head_size \
                    or shape[0] < num_tokens:
                raise CaptureInputError(f"{name} has shape {list(shape)}, expected "
                                        f"[>= {num_tokens}, {layer.num_kv_heads}, {layer.head_size}]")
        if slot_mapping.ndim != 1 or slot_mapping.shape[0] < num_tokens:
            raise CaptureInputError(f"slot_mapping has shape {list(slot_mapping.shape)}, expected [>= {num_tokens}]")
        trim = key.shape[0] != num_tokens
        if pre is not None:  # already host copies: views suffice
            step_record.key, step_record.value = (key[:num_tokens], value[:num_tokens]) if trim else (key, value)
            slots = slot_mapping[:num_tokens] if slot_mapping.shape[0] != num_tokens else slot_mapping
        else:
            step_record.key = copies.copy(key[:num_tokens] if trim else key)
            step_record.value = copies.copy(value[:num_tokens] if trim else value)
            slots = own(slot_mapping[:num_tokens] if slot_mapping.shape[0] != num_tokens else slot_mapping, copies)
            host += 2 * num_tokens * layer.num_kv_heads * layer.head_size * key.element_size() + _nbytes(slots)
        step_record.slot_mapping = slots

    ids = referenced_page_ids(bt_np, sl_np, None if slots is None else slots.numpy(), page_size)
    if ids.size and (ids[0] < 0 or ids[-1] >= tensor_blocks):
        bad = int(ids[0]) if ids[0] < 0 else int(ids[-1])
        raise CaptureInputError(f"block_table or slot_mapping refers to page {bad}, outside the cache of "
                                f"{tensor_blocks} pages")
    page_bytes = kv_cache.element_size() * (kv_cache.numel() // max(1, tensor_blocks))
    return CapturePlan(
        layer=layer, backend=backend, layout=layout, step=step_record, page_ids=torch.from_numpy(ids),
        num_tokens=num_tokens, causal=causal, lower_bound_bytes=len(ids) * (page_bytes + 4) + host, rank=rank,
        step_index=step, rank_source=rank_source, engine=engine, info=info, notes=notes, captured_at=time.time(),
        query_rows_given=q_shape[0], kv_cache=kv_cache, pre_update=pre, copies=copies, staged=t.staged,
    )


def prepare_capture(layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, **kwargs) -> PendingCapture:
    """:func:`plan_capture`, then copy the pages: the step as the engine's thread leaves it, less the output."""
    return plan_capture(layer, backend, tensors, **kwargs).gather()
