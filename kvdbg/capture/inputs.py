"""The inputs of a capture, checked when they are built, and the typed errors capture raises.

What the engine hands over: each layer's constants (:class:`CaptureLayer`), its
settings for the backend (:class:`CaptureBackend`) and one step's tensors
(:class:`StepTensors`); the engine cache's layout they declare, or that its
shape implies (:func:`resolve_kv_layout`). :class:`CaptureInputError` names the
field that cannot form a snapshot; :class:`WrittenKVMismatch` refuses a layer
whose cache does not read back as declared.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.capture.engine_layouts import EngineLayout, LayoutError, engine_layout
from kvdbg.errors import KvdbgError, SnapshotError
from kvdbg.snapshot.format import (
    FORMAT_VERSION,
    LAYOUT_KV_PLANES,
    LAYOUT_VLLM,
    MODEL_DTYPES,
    BackendMeta,
    LayerMeta,
    SnapshotMeta,
    parse_meta,
)
from kvdbg.snapshot.store import dtype_name

if TYPE_CHECKING:
    from kvdbg.capture.prepare import PreUpdate

__all__ = [
    "CaptureBackend",
    "CaptureInputError",
    "CaptureLayer",
    "StepTensors",
    "WrittenKVMismatch",
    "infer_kv_layout",
    "resolve_kv_layout",
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
    # The step's pages staged in device memory right after the engine ran it (a replayed CUDA graph's step,
    # kvdbg.vllm_plugin.graph_staging): read from there, by engine page id, instead of from kv_cache.
    staged: Any = None
    # Host copies already issued for this step (kvdbg.capture.buffers.StepCopies, copies issued ahead: the graph
    # capture thread issues a staged step's for every layer before it plans any): the capture takes them over.
    copies: Any = None


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
