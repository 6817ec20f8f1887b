"""Snapshot format v1, its metadata: the format's constants (keys, versions, layouts, dtypes, tensor names,
bounds) and the metadata schema (``SnapshotMeta`` and its layer and backend parts), parsed and checked field by
field from the header's JSON, without torch. ``kvdbg.snapshot.format`` reads and writes the file around it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvdbg.errors import SnapshotError

FORMAT_KEY = "kvdbg.format"
OUTPUTS_KEY = "kvdbg.replay"  # the metadata key of a `kvdbg replay -o` outputs file (a file-format name)
META_KEY = "kvdbg.meta"
FORMAT_VERSION = "1"
# "1.1": format 1 with a mask an older reader (which knows only "1") would replay wrongly, so that it refuses the
# file instead (docs/snapshot-format.md, Versioning). Readers accept both.
FORMAT_VERSION_MASKS = "1.1"
FORMAT_VERSIONS_READ = (FORMAT_VERSION, FORMAT_VERSION_MASKS)

# safetensors refuses headers above 100 MB; so do we, before reading one.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_META_BYTES = 1024 * 1024
# Bounds on the layer's shape that no real model comes near (the most query heads of a released model is 128,
# DeepSeek-V3 and Llama 3.1 405B; the widest head 576, MLA's 512 + 64). Every head costs a replay memory
# whether or not the file holds any data for it, so a few-KB file declaring 2**25 heads of zero tokens would
# otherwise ask for gigabytes.
MAX_HEADS = 4096
MAX_HEAD_SIZE = 4096

# The KV page layouts a snapshot may store, named in the file as these strings (``kv_layout``).
# vLLM's packed cache: per (page, KV head) a [page_size, 2*D] slot of token rows [K | V], the
# shape ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` of vLLM's FLEX_ATTENTION (and
# FLASHINFER_TS, and CPU_ATTN once converted at capture).
LAYOUT_VLLM = "pages,heads,tokens,2*dim"
# K and V as two planes: ``(2, num_blocks, block_size, num_kv_heads, head_size)``, the
# ``get_kv_cache_shape`` of vLLM's FlashAttention-style backends (FLASH_ATTN in its NHD order;
# FLEX_ATTENTION too, before it packed K and V into one tensor). K is plane 0, V plane 1.
LAYOUT_KV_PLANES = "2,pages,tokens,heads,dim"
LAYOUTS = (LAYOUT_VLLM, LAYOUT_KV_PLANES)

MODEL_DTYPES = ("float16", "bfloat16", "float32")

# A backend name as vLLM spells it: an enum member's name (FLASHINFER_TS, FLEX_ATTENTION, CPU_ATTN, ...).
# A snapshot's backend.name is read in that spelling (see canonical_backend_name), so that every
# comparison with an engine name (which column is the snapshot's own, and so counted) holds whatever
# case a writer used; "flex", kvdbg's name for FLEX_ATTENTION, is that backend too.
_BACKEND_NAME_ALIASES = {"FLEX": "FLEX_ATTENTION"}


def canonical_backend_name(name: str) -> str:
    """vLLM's spelling of an engine backend name: upper case, ``_`` for ``-``, ``flex`` as FLEX_ATTENTION.

    A name that is not a plain identifier (letters, digits, ``_`` and ``-``) is kept as written.
    """
    key = name.strip().replace("-", "_").upper()
    if not key or not key.replace("_", "").isalnum() or not key.isascii():
        return name
    return _BACKEND_NAME_ALIASES.get(key, key)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")

# safetensors dtype tag -> (bytes per element, kvdbg/torch name)
ST_DTYPES: dict[str, tuple[int, str]] = {
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "I16": (2, "int16"),
    "I32": (4, "int32"),
    "I64": (8, "int64"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "BOOL": (1, "bool"),
}
DTYPE_TO_ST = {name: tag for tag, (_, name) in ST_DTYPES.items()}
INDEX_DTYPES = ("int32", "int64")
FP8_STORAGE_DTYPES = ("uint8", "float8_e4m3fn")

STEP_TENSORS_REQUIRED = ("block_table", "seq_lens", "query_start_loc", "query")
STEP_TENSORS_UPDATE = ("key", "value", "slot_mapping")
STEP_TENSORS = STEP_TENSORS_REQUIRED + STEP_TENSORS_UPDATE + ("output",)
# Optional per-layer value tensors, [num_heads] float32, each present only when its layer flag is true:
# the learned sink logit of each query head, and each query head's ALiBi slope.
LAYER_VALUE_TENSORS = {"sinks": "has_sinks", "alibi_slopes": "has_alibi"}
GLOBAL_TENSORS = ("kv_cache", "page_ids") + tuple(LAYER_VALUE_TENSORS)

# vLLM's attention types (AttentionType): decoder self-attention over the cache; encoder and encoder_only
# self-attention over the step's own tokens, bidirectional; encoder_decoder (cross-attention): decoder queries
# over the encoder's cached keys.
ATTN_TYPES = ("decoder", "encoder", "encoder_only", "encoder_decoder")
ENCODER_SELF_ATTN_TYPES = ("encoder", "encoder_only")
CROSS_ATTN_TYPE = "encoder_decoder"


# --------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class LayerMeta:
    """The attention layer the snapshot was taken from."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    causal: bool
    sliding_window: int | None = None
    dtype: str = "bfloat16"  # the model dtype: query, new K/V and output use it
    kv_cache_dtype: str = "auto"  # "auto" (model dtype) or "fp8_e4m3"
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    logits_soft_cap: float | None = None
    has_sinks: bool = False
    has_alibi: bool = False
    kv_sharing_target: str | None = None
    attn_type: str = "decoder"
    # TRITON_ATTN's square-root ALiBi variant (use_alibi_sqrt): -slope * sqrt(p - k) for keys up to p.
    alibi_sqrt: bool = False
    # TRITON_ATTN's chunked attention with lookback (chunk_lookback >= 0): chunks of
    # sliding_window // (chunk_lookback + 1) tokens; a query sees its own chunk and chunk_lookback before it.
    chunk_lookback: int | None = None
    # Features recorded so that replay can refuse them by name: the snapshot does not hold what they need.
    mm_prefix: bool = False  # PrefixLM multimodal layers: per-request bidirectional ranges (use_mm_prefix)
    rswa_window: int | None = None  # Reference Sliding Window Attention: per-request prefix lengths

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


LAYER_FIELDS_WRITTEN_WHEN_SET = ("alibi_sqrt", "chunk_lookback", "mm_prefix", "rswa_window")
# Of those, the fields that change which keys a token sees: a reader of format "1" would ignore them.
MASK_FIELDS = ("chunk_lookback", "mm_prefix", "rswa_window")


def format_version(meta: "SnapshotMeta") -> str:
    """The ``kvdbg.format`` a file of ``meta`` is written with: "1.1" when its mask needs a field "1" lacks."""
    layer = meta.layer
    uses = any(getattr(layer, name) != LayerMeta.__dataclass_fields__[name].default for name in MASK_FIELDS)
    return FORMAT_VERSION_MASKS if uses else FORMAT_VERSION


@dataclass(frozen=True)
class BackendMeta:
    """The engine-side backend configuration the step ran under."""

    name: str
    page_size: int
    max_model_len: int
    num_gpu_blocks: int  # pages in the engine's cache; block-table ids are below this
    max_decode_query_len: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None


@dataclass(frozen=True)
class SnapshotMeta:
    """Everything kvdbg.meta holds: the layer, the backend, the layout and provenance."""

    layer: LayerMeta
    backend: BackendMeta
    kv_layout: str
    num_steps: int = 1
    capture: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    def to_json(self) -> str:
        record = _plain(self)
        # Feature fields added after the first release are written only when set, so a snapshot without them
        # keeps the bytes an earlier kvdbg wrote (fixtures regenerate byte for byte).
        for name in LAYER_FIELDS_WRITTEN_WHEN_SET:
            if record["layer"][name] == LayerMeta.__dataclass_fields__[name].default:
                del record["layer"][name]
        return json.dumps(record, sort_keys=True, separators=(",", ":"))

    def step_prefix(self, step: int) -> str:
        return step_prefix(step, self.num_steps)


_JSON_SCALARS = frozenset((str, int, float, bool, type(None)))


def _plain(value: Any) -> Any:
    """``value`` with its dataclasses as dicts, for ``json.dumps``: ``dataclasses.asdict`` without its deep copy.

    A capture's writer encodes every snapshot's metadata a few times; ``asdict``
    copies each leaf and took most of that time. The JSON is the same.
    """
    kind = type(value)
    if kind in _JSON_SCALARS:
        return value
    if hasattr(kind, "__dataclass_fields__"):
        return {name: _plain(getattr(value, name)) for name in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def step_prefix(step: int, num_steps: int) -> str:
    """Tensor-name prefix of one step: bare names for a single step, ``step.N.`` otherwise."""
    return "" if num_steps == 1 else f"step.{step}."


def _field_error(path: str, expected: str, value: Any) -> SnapshotError:
    shown = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return SnapshotError(f"meta field {path} must be {expected}, got {shown[:80]}")


def _get(obj: Mapping[str, Any], path: str, key: str, kind: str, *, required: bool = True, default: Any = None) -> Any:
    if key not in obj:
        if required:
            raise SnapshotError(f"meta field {path}.{key} is missing")
        return default
    value = obj[key]
    where = f"{path}.{key}"
    if kind == "str":
        if not isinstance(value, str):
            raise _field_error(where, "a string", value)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise _field_error(where, "true or false", value)
    elif kind in ("pos_int", "opt_pos_int", "nonneg_int", "opt_nonneg_int"):
        if value is None and kind in ("opt_pos_int", "opt_nonneg_int"):
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _field_error(where, "an integer", value)
        nonneg = kind in ("nonneg_int", "opt_nonneg_int")
        if nonneg and value < 0 or not nonneg and value <= 0:
            raise _field_error(where, "a non-negative integer" if nonneg else "a positive integer", value)
        if value > 2**40:
            raise _field_error(where, "an integer below 2**40", value)
    elif kind in ("scale", "opt_nonneg_float"):
        if value is None and kind == "opt_nonneg_float":
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _field_error(where, "a number", value)
        value = float(value)
        # json.loads reads NaN and Infinity: a scale or cap of either poisons every logit.
        if kind == "scale" and (not math.isfinite(value) or value <= 0):
            raise _field_error(where, "a finite positive number", value)
        if kind == "opt_nonneg_float" and (not math.isfinite(value) or value < 0):
            raise _field_error(where, "a finite non-negative number or null", value)
    elif kind == "opt_str":
        if value is not None and not isinstance(value, str):
            raise _field_error(where, "a string or null", value)
    return value


def parse_meta(raw: str) -> SnapshotMeta:
    """Parse and validate the ``kvdbg.meta`` JSON string."""
    if len(raw) > MAX_META_BYTES:
        raise SnapshotError(f"{META_KEY} is {len(raw)} bytes, over the {MAX_META_BYTES}-byte limit")
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise SnapshotError(f"{META_KEY} is nested too deeply to be kvdbg metadata") from None
    except ValueError as exc:
        raise SnapshotError(f"{META_KEY} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise SnapshotError(f"{META_KEY} must be a JSON object, got {type(obj).__name__}")
    for section in ("layer", "backend"):
        if not isinstance(obj.get(section), dict):
            raise SnapshotError(f"meta field {section} is missing or not an object")
    lo, bo = obj["layer"], obj["backend"]
    layer = LayerMeta(
        name=_get(lo, "layer", "name", "str"),
        num_heads=_get(lo, "layer", "num_heads", "pos_int"),
        num_kv_heads=_get(lo, "layer", "num_kv_heads", "pos_int"),
        head_size=_get(lo, "layer", "head_size", "pos_int"),
        scale=_get(lo, "layer", "scale", "scale"),
        causal=_get(lo, "layer", "causal", "bool"),
        sliding_window=_get(lo, "layer", "sliding_window", "opt_pos_int", required=False),
        dtype=_get(lo, "layer", "dtype", "str"),
        kv_cache_dtype=_get(lo, "layer", "kv_cache_dtype", "str", required=False, default="auto"),
        q_scale=_get(lo, "layer", "q_scale", "scale", required=False, default=1.0),
        k_scale=_get(lo, "layer", "k_scale", "scale", required=False, default=1.0),
        v_scale=_get(lo, "layer", "v_scale", "scale", required=False, default=1.0),
        logits_soft_cap=_get(lo, "layer", "logits_soft_cap", "opt_nonneg_float", required=False),
        has_sinks=_get(lo, "layer", "has_sinks", "bool", required=False, default=False),
        has_alibi=_get(lo, "layer", "has_alibi", "bool", required=False, default=False),
        kv_sharing_target=_get(lo, "layer", "kv_sharing_target", "opt_str", required=False),
        attn_type=_get(lo, "layer", "attn_type", "str", required=False, default="decoder"),
        alibi_sqrt=_get(lo, "layer", "alibi_sqrt", "bool", required=False, default=False),
        chunk_lookback=_get(lo, "layer", "chunk_lookback", "opt_nonneg_int", required=False),
        mm_prefix=_get(lo, "layer", "mm_prefix", "bool", required=False, default=False),
        rswa_window=_get(lo, "layer", "rswa_window", "opt_pos_int", required=False),
    )
    if layer.dtype not in MODEL_DTYPES:
        raise _field_error("layer.dtype", f"one of {', '.join(MODEL_DTYPES)}", layer.dtype)
    if layer.kv_cache_dtype == "fp8":
        layer = _replace(layer, kv_cache_dtype="fp8_e4m3")
    if layer.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise _field_error("layer.kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}", layer.kv_cache_dtype)
    for name, limit in (("num_heads", MAX_HEADS), ("num_kv_heads", MAX_HEADS), ("head_size", MAX_HEAD_SIZE)):
        if getattr(layer, name) > limit:
            raise _field_error(f"layer.{name}", f"at most {limit} (no real model has more)", getattr(layer, name))
    if layer.num_heads % layer.num_kv_heads:
        raise SnapshotError(
            f"meta field layer.num_heads ({layer.num_heads}) must be a multiple of "
            f"layer.num_kv_heads ({layer.num_kv_heads}) for grouped-query attention"
        )
    _check_layer_features(layer)
    backend = BackendMeta(
        name=canonical_backend_name(_get(bo, "backend", "name", "str")),
        page_size=_get(bo, "backend", "page_size", "pos_int"),
        max_model_len=_get(bo, "backend", "max_model_len", "pos_int"),
        num_gpu_blocks=_get(bo, "backend", "num_gpu_blocks", "pos_int"),
        max_decode_query_len=_get(bo, "backend", "max_decode_query_len", "pos_int", required=False, default=1),
        max_num_seqs=_get(bo, "backend", "max_num_seqs", "opt_pos_int", required=False),
        max_num_batched_tokens=_get(bo, "backend", "max_num_batched_tokens", "opt_pos_int", required=False),
    )
    kv_layout = _get(obj, "meta", "kv_layout", "str")
    if kv_layout not in LAYOUTS:
        raise SnapshotError(
            f"meta field kv_layout {json.dumps(kv_layout)[:60]} is not a known layout; "
            f"expected one of: {', '.join(repr(x) for x in LAYOUTS)}"
        )
    num_steps = _get(obj, "meta", "num_steps", "pos_int", required=False, default=1)
    if num_steps > 4096:
        raise _field_error("num_steps", "at most 4096", num_steps)
    capture = obj.get("capture", {})
    if not isinstance(capture, dict):
        raise _field_error("capture", "an object", capture)
    notes = _get(obj, "meta", "notes", "str", required=False, default="")
    return SnapshotMeta(layer=layer, backend=backend, kv_layout=kv_layout, num_steps=num_steps,
                        capture=capture, notes=notes)


def _check_layer_features(layer: LayerMeta) -> None:
    """Rules between the layer's feature fields (each value alone was checked as it was read)."""
    if layer.alibi_sqrt and not layer.has_alibi:
        raise SnapshotError("meta field layer.alibi_sqrt is true but layer.has_alibi is false: the square-root "
                            "variant needs ALiBi slopes")
    if layer.chunk_lookback is not None:
        if layer.sliding_window is None:
            raise SnapshotError("meta field layer.chunk_lookback needs layer.sliding_window: the chunk size is "
                                "sliding_window // (chunk_lookback + 1)")
        if layer.sliding_window // (layer.chunk_lookback + 1) == 0:
            raise SnapshotError(
                f"meta field layer.chunk_lookback = {layer.chunk_lookback} leaves chunks of 0 tokens "
                f"(layer.sliding_window = {layer.sliding_window} // {layer.chunk_lookback + 1})")
    if layer.attn_type in ENCODER_SELF_ATTN_TYPES + (CROSS_ATTN_TYPE,) and layer.causal:
        raise SnapshotError(f"meta field layer.causal is true but layer.attn_type {layer.attn_type!r} attends "
                            "bidirectionally: it must be false")


def _replace(obj, **changes):
    from dataclasses import replace

    return replace(obj, **changes)
