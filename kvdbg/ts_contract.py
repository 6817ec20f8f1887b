"""Preconditions of FlashInfer's prims_ts BatchDecodePagedTSWrapper (pure Python, no torch).

FLASHINFER_TS runs the kernel with ``validate=False`` (its CUDA-graph path), so
nothing checks these at run time: a batch that breaks one gives undefined
output. Each check returns :class:`Violation` records instead of raising, so a
caller can report every broken precondition of a batch at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "HEAD_DIMS",
    "PAGE_SIZES",
    "SUPPORTED_CAPABILITIES",
    "KERNEL_DTYPES",
    "MASK_TYPES",
    "Violation",
    "canonical_dtype",
    "check_request",
    "check_plan",
    "check_capability",
]

HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (4, 8, 16, 32, 64, 128)
# B200, B300 and Rubin; Hopper (9.0) has no prims_ts build.
SUPPORTED_CAPABILITIES = ((10, 0), (10, 3), (10, 7))
KERNEL_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
MASK_TYPES = ("causal", "dense")

# Spellings callers use for the same dtype: torch names, vLLM's kv_cache_dtype, short forms.
_DTYPE_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn", "torch.float8_e4m3fn": "float8_e4m3fn",
}


@dataclass
class Violation:
    """One broken precondition, with a one-line message that carries the numbers."""

    code: str
    message: str
    request: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def canonical_dtype(name: str) -> str | None:
    """The kernel's name for a dtype spelling, or None when the kernel has no such dtype."""
    return _DTYPE_ALIASES.get(str(name).strip().lower())


def _who(request: int | None) -> str:
    return f"request {request}: " if request is not None else ""


def check_request(
    *, request: int | None, seq_len: int, query_len: int, max_kv_len: int, table_width: int, page_size: int
) -> list[Violation]:
    """Per-request preconditions: ``query_len <= seq_len <= max_kv_len`` and a wide enough table.

    ``table_width`` is the number of block-table columns that hold this
    request's real entries; the kernel reads ``cdiv(seq_len, page_size)`` of them.
    """
    who = _who(request)
    out = []
    if seq_len < query_len:
        out.append(Violation(
            "seq_len_below_query_len",
            f"{who}seq_len {seq_len} is shorter than its {query_len} query tokens",
            request, {"seq_len": seq_len, "query_len": query_len},
        ))
    if seq_len > max_kv_len:
        out.append(Violation(
            "seq_len_over_max_kv_len",
            f"{who}seq_len {seq_len} exceeds the plan's max_kv_len {max_kv_len}",
            request, {"seq_len": seq_len, "max_kv_len": max_kv_len},
        ))
    pages = -(-seq_len // page_size) if page_size > 0 else 0
    if pages > table_width:
        out.append(Violation(
            "table_too_narrow",
            f"{who}seq_len {seq_len} needs {pages} pages of {page_size} but the block table has "
            f"{table_width} columns",
            request, {"seq_len": seq_len, "pages_needed": pages, "table_width": table_width},
        ))
    return out


def check_plan(
    *,
    head_dim: int | None,
    page_size: int,
    q_dtype: str | None,
    kv_dtype: str | None,
    mask_type: str,
    window_left: int,
) -> list[Violation]:
    """Plan-level preconditions. ``None`` for head_dim or a dtype means "not known here" and skips that check."""
    out = []
    if head_dim is not None and head_dim not in HEAD_DIMS:
        out.append(Violation("head_dim_unsupported",
                             f"head_dim {head_dim} is not supported by prims_ts (needs one of "
                             f"{', '.join(map(str, HEAD_DIMS))})", details={"head_dim": head_dim}))
    if page_size not in PAGE_SIZES:
        out.append(Violation("page_size_unsupported",
                             f"page_size {page_size} is not supported by prims_ts (needs one of "
                             f"{', '.join(map(str, PAGE_SIZES))})", details={"page_size": page_size}))
    known = {}
    for role, name in (("q", q_dtype), ("kv", kv_dtype)):
        if name is None:
            continue
        canon = canonical_dtype(name)
        if canon is None:
            out.append(Violation(f"{role}_dtype_unsupported",
                                 f"{role} dtype {name} is not supported by prims_ts (needs float16, bfloat16 "
                                 "or float8_e4m3fn)", details={f"{role}_dtype": name}))
        else:
            known[role] = canon
    if len(known) == 2 and known["q"] != known["kv"]:
        out.append(Violation("dtype_mismatch",
                             f"q dtype {known['q']} differs from kv dtype {known['kv']}; prims_ts needs them equal",
                             details={"q_dtype": known["q"], "kv_dtype": known["kv"]}))
    if mask_type not in MASK_TYPES:
        out.append(Violation("mask_type_unknown",
                             f"mask_type {mask_type!r} is not one of {', '.join(MASK_TYPES)}",
                             details={"mask_type": mask_type}))
    if window_left < -1:
        out.append(Violation("window_left_invalid", f"window_left {window_left} must be -1 (no window) or >= 0",
                             details={"window_left": window_left}))
    elif window_left >= 0 and mask_type != "causal":
        out.append(Violation("window_needs_causal",
                             f"window_left {window_left} needs mask_type causal, got {mask_type}",
                             details={"window_left": window_left, "mask_type": mask_type}))
    return out


def check_capability(capability: tuple[int, int] | None) -> list[Violation]:
    """Whether a GPU of this compute capability can run prims_ts (None: no GPU)."""
    if capability is not None and tuple(capability) in SUPPORTED_CAPABILITIES:
        return []
    shown = "no CUDA device" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    wanted = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_CAPABILITIES)
    return [Violation("capability_unsupported", f"prims_ts runs only on compute capability {wanted}; found {shown}",
                      details={"capability": list(capability) if capability else None})]
