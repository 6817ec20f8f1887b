"""Preconditions of FlashInfer's prims_ts BatchDecodePagedTSWrapper (pure Python, no torch).

FLASHINFER_TS runs the kernel with ``validate=False`` (its CUDA-graph path), so
nothing checks these at run time: a batch that breaks one gives undefined
output. Each check returns findings (:class:`kvdbg.judge.findings.Finding`, codes
from the registry) instead of raising, so a caller can report every broken
precondition of a batch at once. Every rule
names its ``source``: the wrapper validation in flashinfer-python that would
refuse the input with ``validate=True`` (read from the 0.7.1, 0.7.2 and 0.7.4
releases' ``flashinfer/attention/prims_ts/decode.py``).

The wrapper's keywords and a few rules changed between releases, so the rules
come per API generation (:data:`API_0_7_1`, :data:`API_0_7_4`); see
:func:`api_for_version`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvdbg.judge.findings import CODES, Finding

__all__ = [
    "API_0_7_1",
    "API_0_7_4",
    "API_GENERATIONS",
    "ApiGeneration",
    "NEWEST_KNOWN",
    "STRICTEST",
    "MAX_HEAD_RATIO",
    "FP8_P_TILE",
    "FP8_P_STREAMS",
    "PRECONDITIONS",
    "api_for_version",
    "check_heads",
    "check_kv_view",
    "check_kv_views",
    "HEAD_DIMS",
    "PAGE_SIZES",
    "SUPPORTED_CAPABILITIES",
    "KERNEL_DTYPES",
    "MASK_TYPES",
    "canonical_dtype",
    "check_request",
    "check_plan",
    "request_inactive",
]

HEAD_DIMS = (64, 128, 256)  # 0.7.1-0.7.2; 0.7.4 adds 192 and 512 (ApiGeneration.head_dims)
PAGE_SIZES = (4, 8, 16, 32, 64, 128)
# B200, B300 and Rubin; Hopper (9.0) has no prims_ts build.
SUPPORTED_CAPABILITIES = ((10, 0), (10, 3), (10, 7))
KERNEL_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
MASK_TYPES = ("causal", "dense")
MAX_HEAD_RATIO = 128  # Hq / Hkv, _validate_head_geometry
# The FP8 kernel streams keys in tiles of 128 through its K/V instances, each with its own running max
# (fmha_decode helpers_softmax): two unless the planner picks a Keeps tile at head_dim 192/256, which has one
# (kvdbg.ts.planner). The torch and Triton emulations of its P rounding both follow these.
FP8_P_TILE = 128
FP8_P_STREAMS = 2  # the instances of every profile but those one-instance Keeps ones

# Spellings callers use for the same dtype: torch names, vLLM's kv_cache_dtype, short forms.
_DTYPE_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn", "torch.float8_e4m3fn": "float8_e4m3fn",
}

# Where each rule lives in flashinfer-python: the wrapper validation that refuses the input when
# validate=True. FLASHINFER_TS runs with validate=False, so none of them runs there. Read from the
# finding registry, which holds each rule once: code -> (the rule, its source).
PRECONDITIONS: dict[str, tuple[str, str]] = {c.name: (c.rule, c.source) for c in CODES.values() if c.rule}


@dataclass(frozen=True)
class ApiGeneration:
    """One generation of BatchDecodePagedTSWrapper's API: its keyword names and the rules that differ.

    ``plan_names`` / ``run_names`` map the keyword FLASHINFER_TS writes (flashinfer 0.7.1-0.7.2
    names) to this generation's keyword; a name not listed is unchanged.
    """

    label: str
    first: tuple[int, int, int]  # the first release of this generation
    plan_names: dict[str, str]
    run_names: dict[str, str]
    head_dims: tuple[int, ...]
    # 0.7.4: "Nonpositive per-run K/V lengths mark inactive requests ... output is left untouched";
    # 0.7.1-0.7.2 require every length in [1, max_kv_len].
    nonpositive_is_inactive: bool

    def plan_kwargs(self, ts_kwargs: dict[str, Any]) -> dict[str, Any]:
        return {self.plan_names.get(k, k): v for k, v in ts_kwargs.items()}

    def run_kwargs(self, ts_kwargs: dict[str, Any]) -> dict[str, Any]:
        return {self.run_names.get(k, k): v for k, v in ts_kwargs.items()}


API_0_7_1 = ApiGeneration(
    label="flashinfer 0.7.1-0.7.2 API", first=(0, 7, 1), plan_names={}, run_names={},
    head_dims=HEAD_DIMS, nonpositive_is_inactive=False)
# 0.7.4 renamed these keywords without keeping the old names.
API_0_7_4 = ApiGeneration(
    label="flashinfer 0.7.4+ API", first=(0, 7, 4),
    plan_names={"max_seq_len_q": "max_q_len", "q_data_type": "q_dtype", "kv_data_type": "kv_dtype",
                "o_data_type": "out_dtype"},
    run_names={"seq_lens": "seq_lens_kv", "bmm1_scale": "softmax_scale", "bmm2_scale": "output_scale"},
    head_dims=(64, 128, 192, 256, 512), nonpositive_is_inactive=True)
API_GENERATIONS = (API_0_7_1, API_0_7_4)
NEWEST_KNOWN = (0, 7, 4)
# With no flashinfer installed, the emulation holds a batch to the strictest generation kvdbg knows.
STRICTEST = API_0_7_1


def api_for_version(version: tuple[int, int, int]) -> tuple[ApiGeneration | None, str | None]:
    """The API generation of a flashinfer release, and a label when kvdbg has not seen that release.

    None below 0.7.1. A release newer than the newest known is tried with the
    newest mapping and labelled as such.
    """
    if version < API_0_7_1.first:
        return None, None
    if version < API_0_7_4.first:
        return API_0_7_1, None
    if version == NEWEST_KNOWN:
        return API_0_7_4, None
    newest = ".".join(map(str, NEWEST_KNOWN))
    return API_0_7_4, (f"flashinfer {'.'.join(map(str, version))} is newer than {newest}, the newest release "
                       f"kvdbg knows: called with the {newest} keywords, not verified against this release")


BACKEND = "flashinfer_ts"  # the backend whose kernel these rules belong to


def _broken(code: str, message: str, request: int | None = None, details: dict[str, Any] | None = None) -> Finding:
    """One broken precondition of prims_ts, as a finding of the flashinfer_ts backend."""
    return Finding(code=code, message=message, backend=BACKEND, request=request, details=details or {},
                   context=BACKEND if code == "page_size_unsupported" else None)


def canonical_dtype(name: str) -> str | None:
    """The kernel's name for a dtype spelling, or None when the kernel has no such dtype."""
    return _DTYPE_ALIASES.get(str(name).strip().lower())


def _who(request: int | None) -> str:
    return f"request {request}: " if request is not None else ""


def check_request(
    *, request: int | None, seq_len: int, query_len: int, max_kv_len: int, table_width: int, page_size: int,
    mask_type: str, api: ApiGeneration = STRICTEST,
) -> list[Finding]:
    """Per-request preconditions of ``run`` (``_validate_decode_run_metadata_values``).

    ``1 <= seq_len <= max_kv_len`` and a table with ``cdiv(seq_len, page_size)``
    columns; for a causal mask also ``query_len <= seq_len``. A dense mask has
    no such bound: each of its rows sees every key below ``seq_len``, however
    short. From 0.7.4 on, ``seq_len <= 0`` marks an inactive request whose
    output is left untouched: no violation (see :func:`request_inactive`).
    ``table_width`` is the number of block-table columns that hold this
    request's real entries.
    """
    who = _who(request)
    out = []
    if seq_len <= 0:
        if api.nonpositive_is_inactive:
            return out
        out.append(_broken(
            "seq_len_not_positive",
            f"{who}seq_len {seq_len} is not positive; the {api.label} needs every seq_len in [1, max_kv_len]",
            request, {"seq_len": seq_len},
        ))
        return out
    if mask_type == "causal" and seq_len < query_len:
        out.append(_broken(
            "seq_len_below_query_len",
            f"{who}seq_len {seq_len} is shorter than its {query_len} query tokens, which a causal mask needs",
            request, {"seq_len": seq_len, "query_len": query_len},
        ))
    if seq_len > max_kv_len:
        out.append(_broken(
            "seq_len_over_max_kv_len",
            f"{who}seq_len {seq_len} exceeds the plan's max_kv_len {max_kv_len}",
            request, {"seq_len": seq_len, "max_kv_len": max_kv_len},
        ))
    pages = -(-seq_len // page_size) if page_size > 0 else 0
    if pages > table_width:
        out.append(_broken(
            "table_too_narrow",
            f"{who}seq_len {seq_len} needs {pages} pages of {page_size} but the block table has "
            f"{table_width} columns",
            request, {"seq_len": seq_len, "pages_needed": pages, "table_width": table_width},
        ))
    return out


def request_inactive(seq_len: int, api: ApiGeneration) -> bool:
    """0.7.4+: a request with ``seq_len <= 0`` is inactive; the kernel leaves its output untouched."""
    return api.nonpositive_is_inactive and seq_len <= 0


def check_heads(num_qo_heads: int, num_kv_heads: int) -> list[Finding]:
    """GQA geometry (``_validate_head_geometry``): Hq a multiple of Hkv, and ``1 <= Hq/Hkv <= 128``."""
    if num_kv_heads <= 0 or num_qo_heads <= 0 or num_qo_heads % num_kv_heads:
        return [_broken("heads_not_divisible",
                        f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}",
                        details={"num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads})]
    ratio = num_qo_heads // num_kv_heads
    if ratio > MAX_HEAD_RATIO:
        return [_broken("head_ratio_unsupported",
                        f"Hq/Hkv = {num_qo_heads}/{num_kv_heads} = {ratio} exceeds prims_ts's limit of "
                        f"{MAX_HEAD_RATIO} query heads per KV head",
                        details={"num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "ratio": ratio})]
    return []


def check_kv_view(
    name: str, shape: tuple[int, ...], strides: tuple[int, ...], element_size: int, data_ptr: int | None,
) -> list[Finding]:
    """What ``_validate_native_hnd_tma_strides`` requires of one K or V view ``[pages, Hkv, page_size, D]``.

    The kernel builds TMA descriptors from the view's own strides, so any
    strides work that: keep head_dim contiguous; make the page, head and token
    strides positive and 16-byte multiples; start at a 16-byte aligned address
    (``data_ptr`` None: not known, not checked); and never overlap -- taking the
    dimensions from the smallest stride up, each stride must reach past
    everything the smaller ones span::

        D=64, 16 tokens of stride 2*D=128, 2 heads of stride 2048:
        head dim spans [0, 64); tokens start at 128 >= 64, span to 1984;
        heads start at 2048 >= 1984: no overlap (the gap is V's half).

    K and V are checked apart: nothing requires their strides to be equal.
    """
    if len(shape) != 4 or len(strides) != 4:
        return [_broken("kv_view_shape", f"{name} view has shape {list(shape)}, expected rank 4 "
                        "[pages, Hkv, page_size, head_dim]", details={"shape": list(shape)})]
    out = []
    page_stride, head_stride, token_stride, dim_stride = strides
    if dim_stride != 1:
        out.append(_broken("kv_head_dim_not_contiguous",
                           f"{name} view has head_dim stride {dim_stride}; the kernel needs stride 1",
                           details={"strides": list(strides)}))
    named = (("page", page_stride), ("head", head_stride), ("token", token_stride))
    bad = [n for n, st in named if st <= 0]
    if bad:
        out.append(_broken("kv_stride_not_positive",
                           f"{name} view has non-positive {'/'.join(bad)} stride(s) {list(strides)}",
                           details={"strides": list(strides)}))
    misaligned = [f"{n} {st * element_size} bytes" for n, st in named if st > 0 and st * element_size % 16]
    if misaligned:
        out.append(_broken("kv_stride_misaligned",
                           f"{name} view strides are not 16-byte multiples for TMA: {', '.join(misaligned)}",
                           details={"strides": list(strides), "element_size": element_size}))
    if data_ptr is not None and data_ptr % 16:
        out.append(_broken("kv_base_misaligned",
                           f"{name} view starts at an address {data_ptr % 16} bytes past a 16-byte boundary",
                           details={"offset_mod_16": data_ptr % 16}))
    pages, heads, tokens, dims = shape
    span = 1
    for stride, extent, dim in sorted(((1, dims, "head_dim"), (token_stride, tokens, "token"),
                                       (head_stride, heads, "head"), (page_stride, pages, "page"))):
        if extent <= 1:
            continue
        if stride < span:
            out.append(_broken("kv_dims_overlap",
                               f"{name} view's {dim} dimension (stride {stride}) overlaps the {span} elements "
                               "its smaller dimensions span", details={"strides": list(strides),
                                                                       "shape": list(shape)}))
            break
        span += (extent - 1) * stride
    return out


def check_kv_views(k: dict[str, Any], v: dict[str, Any], head_dim: int) -> list[Finding]:
    """Both views (each a dict of shape, strides, element_size, data_ptr): one logical shape, each valid."""
    out = []
    if tuple(k["shape"]) != tuple(v["shape"]):
        out.append(_broken("kv_view_shape", f"K view shape {list(k['shape'])} differs from V view shape "
                           f"{list(v['shape'])}", details={"k": list(k["shape"]), "v": list(v["shape"])}))
    for name, view in (("K", k), ("V", v)):
        if len(view["shape"]) == 4 and view["shape"][-1] != head_dim:
            out.append(_broken("kv_view_shape", f"{name} view has head_dim {view['shape'][-1]}, the plan "
                               f"{head_dim}", details={"shape": list(view["shape"])}))
        out += check_kv_view(name, tuple(view["shape"]), tuple(view["strides"]), view["element_size"],
                             view.get("data_ptr"))
    return out


def check_plan(
    *,
    head_dim: int | None,
    num_qo_heads: int | None = None,
    num_kv_heads: int | None = None,
    api: ApiGeneration = STRICTEST,
    page_size: int,
    q_dtype: str | None,
    kv_dtype: str | None,
    mask_type: str,
    window_left: int,
) -> list[Finding]:
    """Plan-level preconditions. ``None`` for a value means "not known here" and skips that check."""
    out = []
    if head_dim is not None and head_dim not in api.head_dims:
        out.append(_broken("head_dim_unsupported",
                           f"head_dim {head_dim} is not supported by prims_ts (the {api.label} needs one of "
                           f"{', '.join(map(str, api.head_dims))})", details={"head_dim": head_dim}))
    if num_qo_heads is not None and num_kv_heads is not None:
        out += check_heads(num_qo_heads, num_kv_heads)
    if page_size not in PAGE_SIZES:
        out.append(_broken("page_size_unsupported",
                           f"page_size {page_size} is not supported by prims_ts (needs one of "
                           f"{', '.join(map(str, PAGE_SIZES))})", details={"page_size": page_size}))
    known = {}
    for role, name in (("q", q_dtype), ("kv", kv_dtype)):
        if name is None:
            continue
        canon = canonical_dtype(name)
        if canon is None:
            out.append(_broken("q_dtype_unsupported" if role == "q" else "kv_dtype_unsupported",
                               f"{role} dtype {name} is not supported by prims_ts (needs float16, bfloat16 "
                               "or float8_e4m3fn)", details={f"{role}_dtype": name}))
        else:
            known[role] = canon
    if len(known) == 2 and known["q"] != known["kv"]:
        out.append(_broken("dtype_mismatch",
                           f"q dtype {known['q']} differs from kv dtype {known['kv']}; prims_ts needs them equal",
                           details={"q_dtype": known["q"], "kv_dtype": known["kv"]}))
    if mask_type not in MASK_TYPES:
        out.append(_broken("mask_type_unknown",
                           f"mask_type {mask_type!r} is not one of {', '.join(MASK_TYPES)}",
                           details={"mask_type": mask_type}))
    if window_left < -1:
        out.append(_broken("window_left_invalid", f"window_left {window_left} must be -1 (no window) or >= 0",
                           details={"window_left": window_left}))
    elif window_left >= 0 and mask_type != "causal":
        out.append(_broken("window_needs_causal",
                           f"window_left {window_left} needs mask_type causal, got {mask_type}",
                           details={"window_left": window_left, "mask_type": mask_type}))
    return out
