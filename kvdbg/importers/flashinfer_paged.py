"""One FlashInfer paged-attention call (a wrapper's ``__init__`` + ``plan`` + ``run``) as a kvdbg snapshot.

What is read, from FlashInfer 0.7.x's signatures (``flashinfer/decode.py``, ``flashinfer/prefill.py``):

- ``BatchDecodeWithPagedKVCacheWrapper`` and ``BatchPrefillWithPagedKVCacheWrapper``: ``__init__``'s
  ``kv_layout``; ``plan``'s page table (``indptr``/``indices``/``last_page_len``, the prefill's
  ``qo_indptr``), heads, ``head_dim``, ``page_size``, ``causal`` (prefill; decode is causal), ``window_left``,
  ``logits_soft_cap``, ``sm_scale``, ``q_len_per_req`` (decode); ``run``'s ``q``, ``paged_kv_cache`` (a
  ``(k, v)`` tuple or one 5-D tensor), ``q_scale``/``k_scale``/``v_scale``, ``sinks``, ``window_left``;
  the recorded result as the engine's output.

How it maps (docs/import.md): request r's pages are ``indices[indptr[r]:indptr[r+1]]``, its length
``(pages - 1) * page_size + last_page_len[r]``; the block table holds those pages, padded with page 0 past
them (entries past a request's live pages are never read). NHD pages ``[P, page_size, Hkv, D]`` become the
format's ``2,pages,tokens,heads,dim`` (K and V stacked), HND pages ``[P, Hkv, page_size, D]`` its
``pages,heads,tokens,2*dim`` (K and V side by side): no page is transposed. ``window_left = w`` (a query at
position p sees keys down to ``p - w``) is ``sliding_window = w + 1``; FlashInfer's sinks are natural-log
logits, unscaled, as the format's.

Refused, naming the argument: anything the snapshot cannot say (a custom mask, RoPE or ALiBi inside the
kernel, NVFP4 block scales, skip-softmax, different K and V head sizes, a caller-owned block table, an
e5m2 cache, a not-causal query block with a window), and every inconsistent value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvdbg.errors import SnapshotError
from kvdbg.importers.dumpdir import DumpCall, DumpError

# FlashInfer's decode plan still takes its options positionally after page_size, in this order
# (``_BATCH_DECODE_PLAN_LEGACY_POS_ARGS`` in flashinfer/decode.py, 0.7.x); the dump records them as arg_8...
DECODE_PLAN_LEGACY_POSITIONAL = (
    "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "o_data_type",
    "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "block_tables", "seq_lens",
    "fixed_split_size", "disable_split_kv", "q_len_per_req",
)

DECODE_WRAPPER = "BatchDecodeWithPagedKVCacheWrapper"
PREFILL_WRAPPER = "BatchPrefillWithPagedKVCacheWrapper"
WRAPPERS = (DECODE_WRAPPER, PREFILL_WRAPPER)
LAYOUTS = ("NHD", "HND")
# A block table bigger than this (requests x widest request, in pages) is refused before it is built.
MAX_BLOCK_TABLE_ENTRIES = 1 << 26
BACKEND_NAME = "FLASHINFER"


@dataclass
class PagedCall:
    """FlashInfer's paged-attention arguments, whichever API they came through, checked for shape."""

    function: str
    kv_layout: str  # "NHD" or "HND"
    q: Any  # [tokens, Hq, D]
    k_cache: Any  # NHD [P, page_size, Hkv, D]; HND [P, Hkv, page_size, D]
    v_cache: Any
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: Any  # int64 [n]
    kv_last_page_len: list[int]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    window_left: int = -1
    logits_soft_cap: float = 0.0
    sm_scale: float | None = None
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    sinks: Any = None
    output: Any = None
    provenance: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- typed reads of arguments


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _describe(value: Any) -> str:
    if _is_tensor(value):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return repr(value)[:60]


def _index_vector(value: Any, where: str):
    import torch

    if not _is_tensor(value) or value.dim() != 1 or value.dtype not in (torch.int32, torch.int64, torch.uint32):
        raise DumpError(f"{where} must be a 1-D int32 tensor, got {_describe(value)}")
    return value.to(torch.int64)


def _int(value: Any, where: str, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DumpError(f"{where} must be an integer, got {_describe(value)}")
    if low is not None and value < low:
        raise DumpError(f"{where} must be at least {low}, got {value}")
    return value


def _scalar(value: Any, where: str, default: float | None) -> float | None:
    """A float argument (a one-element tensor too, as the FP8 scales may be); None keeps ``default``."""
    if value is None:
        return default
    if _is_tensor(value):
        if value.numel() != 1:
            raise DumpError(f"{where} must be a number or a one-element tensor, got {_describe(value)}")
        value = float(value.reshape(-1)[0].float())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DumpError(f"{where} must be a finite number, got {_describe(value)}")
    return float(value)


def _absent(args: dict[str, Any], name: str, where: str, why: str, *, allowed: tuple = (None,)) -> None:
    value = args.get(name)
    if _is_tensor(value) or value not in allowed:
        raise DumpError(f"{where}.{name} = {_describe(value)}: {why}, which a kvdbg snapshot cannot hold")


# ----------------------------------------------------------------------------- wrapper calls


def wrapper_class(function: str) -> str | None:
    head, _, _ = function.partition(".")
    return head if head in WRAPPERS else None


def from_wrapper(init: DumpCall | None, plan: DumpCall, run: DumpCall, layout: str | None) -> PagedCall:
    """The arguments of one ``run`` of a paged decode or prefill wrapper, with its ``plan`` and ``__init__``."""
    cls = wrapper_class(run.function)
    decode = cls == DECODE_WRAPPER
    init_args = init.arguments(tensors=False) if init is not None else {}
    recorded_layout = init_args.get("kv_layout", "NHD") if init is not None else None
    if recorded_layout is not None and recorded_layout not in LAYOUTS:
        raise DumpError(f"{init.name}: {cls}.__init__ kv_layout = {recorded_layout!r}, neither NHD nor HND")
    if recorded_layout is not None and layout is not None and layout != recorded_layout:
        raise DumpError(f"--kv-layout {layout}, but {init.name} records the wrapper's kv_layout "
                        f"{recorded_layout}")
    kv_layout = recorded_layout or layout
    if kv_layout is None:
        raise DumpError(f"{run.name}: the {cls}'s __init__ is not in the dump, and its kv_layout (NHD or HND) "
                        "is an argument of the constructor, never guessed from a shape: give --kv-layout, or "
                        "dump __init__ too (FLASHINFER_DUMP_INCLUDE)")

    where_plan, where_run = f"{plan.name}: {cls}.plan", f"{run.name}: {cls}.run"
    p = plan.arguments(DECODE_PLAN_LEGACY_POSITIONAL if decode else ())
    r = run.arguments()
    if decode:
        names = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")
    else:
        names = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                 "num_kv_heads", "head_dim_qk", "page_size")
    for name in names + (() if decode else ("qo_indptr",)):
        if name not in p:
            raise DumpError(f"{where_plan}: argument {name} is not recorded")
    for name in ("q", "paged_kv_cache"):
        if name not in r:
            raise DumpError(f"{where_run}: argument {name} is not recorded")

    _absent(p, "pos_encoding_mode", where_plan, "position encoding inside the kernel (RoPE, ALiBi)",
            allowed=(None, "NONE"))
    _absent(p, "block_tables", where_plan, "a caller-owned block table")
    _absent(r, "kv_cache_sf", where_run, "NVFP4 block scales")
    _absent(r, "skip_softmax_threshold_scale_factor", where_run, "skip-softmax sparsity (an approximation)")
    if not decode:
        _absent(p, "custom_mask", where_plan, "a custom mask")
        _absent(p, "packed_custom_mask", where_plan, "a custom mask")
        _absent(p, "prefix_len_ptr", where_plan, "multi-item scoring")
        head_dim_vo = p.get("head_dim_vo")
        if head_dim_vo is not None and head_dim_vo != p["head_dim_qk"]:
            raise DumpError(f"{where_plan}.head_dim_vo = {head_dim_vo} differs from head_dim_qk = "
                            f"{p['head_dim_qk']}, which a kvdbg snapshot cannot hold")

    head_dim = _int(p["head_dim" if decode else "head_dim_qk"], f"{where_plan}.head_dim", low=1)
    batch = _index_vector(p["last_page_len" if decode else "paged_kv_last_page_len"],
                          f"{where_plan}.last_page_len").numel()
    if decode:
        q_len = _int(p.get("q_len_per_req", 1), f"{where_plan}.q_len_per_req", low=1)
        if r.get("q_len_per_req") not in (None, q_len):
            raise DumpError(f"{where_run}.q_len_per_req = {r['q_len_per_req']} differs from plan's {q_len}")
        qo_indptr = [i * q_len for i in range(batch + 1)]
        causal = True  # a decode block is causal (one token: every key; q_len_per_req > 1: bottom-right)
    else:
        qo_indptr = _index_vector(p["qo_indptr"], f"{where_plan}.qo_indptr").tolist()
        causal = p.get("causal", False)
        if not isinstance(causal, bool):
            raise DumpError(f"{where_plan}.causal must be true or false, got {_describe(causal)}")

    window_left = _int(p.get("window_left", -1), f"{where_plan}.window_left", low=-1)
    if r.get("window_left") is not None and r["window_left"] != window_left:
        raise DumpError(f"{where_run}.window_left = {_describe(r['window_left'])} differs from plan's "
                        f"{window_left} (FlashInfer asserts they are equal)")
    cap = _scalar(p.get("logits_soft_cap"), f"{where_plan}.logits_soft_cap", 0.0)
    if cap < 0:
        raise DumpError(f"{where_plan}.logits_soft_cap must be >= 0, got {cap}")
    sm_scale = _scalar(p.get("sm_scale"), f"{where_plan}.sm_scale", None)
    k_cache, v_cache = _kv_pair(r["paged_kv_cache"], f"{where_run}.paged_kv_cache")
    outputs = run.tensors("outputs")
    output = outputs.get("result", outputs.get("result_0"))
    return PagedCall(
        function=run.function, kv_layout=kv_layout, q=r["q"], k_cache=k_cache, v_cache=v_cache,
        qo_indptr=qo_indptr,
        kv_indptr=_index_vector(p["indptr" if decode else "paged_kv_indptr"], f"{where_plan}.indptr").tolist(),
        kv_indices=_index_vector(p["indices" if decode else "paged_kv_indices"], f"{where_plan}.indices"),
        kv_last_page_len=_index_vector(p["last_page_len" if decode else "paged_kv_last_page_len"],
                                       f"{where_plan}.last_page_len").tolist(),
        num_qo_heads=_int(p["num_qo_heads"], f"{where_plan}.num_qo_heads", low=1),
        num_kv_heads=_int(p["num_kv_heads"], f"{where_plan}.num_kv_heads", low=1),
        head_dim=head_dim, page_size=_int(p["page_size"], f"{where_plan}.page_size", low=1),
        causal=causal, window_left=window_left, logits_soft_cap=cap, sm_scale=sm_scale,
        q_scale=_scalar(r.get("q_scale"), f"{where_run}.q_scale", 1.0),
        k_scale=_scalar(r.get("k_scale"), f"{where_run}.k_scale", 1.0),
        v_scale=_scalar(r.get("v_scale"), f"{where_run}.v_scale", 1.0),
        sinks=r.get("sinks"), output=output,
        provenance={
            "engine": f"flashinfer {run.flashinfer_version}", "flashinfer": run.flashinfer_version,
            "torch": (run.record.get("versions") or {}).get("torch", "unknown")
            if isinstance(run.record.get("versions"), dict) else "unknown",
            "function": run.function, "module": str(run.record.get("module", "")),
            "dump": str(run.path), "plan_dump": plan.name, "init_dump": init.name if init else None,
            "kv_layout": kv_layout, "kv_layout_from": "__init__" if init is not None else "--kv-layout",
            "process_id": run.record.get("process_id"), "self_id": run.record.get("self_id"),
            "timestamp": str(run.record.get("timestamp", "")),
            "device": _recorded_device(run), "output_recorded": output is not None,
        },
    )


# The one-shot paged functions (no wrapper, no plan: a block table and lengths, as vLLM's own metadata):
# flashinfer/decode.py's trtllm_batch_decode_with_kv_cache and flashinfer/prefill.py's
# trtllm_batch_context_with_kv_cache (0.7.x), both ``kv_layout="HND"`` unless told.
ONE_SHOT = {"trtllm_batch_decode_with_kv_cache": "decode", "trtllm_batch_context_with_kv_cache": "prefill"}


def from_one_shot(call: DumpCall) -> PagedCall:
    """The arguments of one ``trtllm_batch_decode_with_kv_cache`` or ``trtllm_batch_context_with_kv_cache`` call.

    Their ``block_tables [B, W]`` and ``seq_lens [B]`` become FlashInfer's indptr form (request r's first
    ``cdiv(seq_lens[r], page_size)`` entries); ``bmm1_scale`` (the softmax scale with q and k scales folded
    in) is the scale, ``bmm2_scale`` the V scale.
    """
    import torch

    where = f"{call.name}: {call.function}"
    decode = ONE_SHOT[call.function] == "decode"
    a = call.arguments()
    for name in ("query", "kv_cache", "block_tables", "seq_lens") + (() if decode else ("cum_seq_lens_q",)):
        if name not in a:
            raise DumpError(f"{where}: argument {name} is not recorded")
    kv_layout = a.get("kv_layout", "HND")
    if kv_layout not in LAYOUTS:
        raise DumpError(f"{where}.kv_layout = {kv_layout!r}, neither NHD nor HND")
    for name, why in (("mask", "a custom mask"), ("kv_cache_sf", "NVFP4 block scales"),
                      ("skip_softmax_threshold_scale_factor", "skip-softmax sparsity (an approximation)"),
                      ("request_order", "a reordered batch"), ("causal_seqlens_kv_global", "context parallelism")):
        _absent(a, name, where, why)
    _absent(a, "enable_block_sparse_attention", where, "block-sparse attention", allowed=(None, False))
    _absent(a, "uses_shared_paged_kv_idx", where, "separate K and V page tables", allowed=(None, True))
    _absent(a, "cp_world", where, "context parallelism", allowed=(None, 1))
    _absent(a, "o_scale", where, "an output scale", allowed=(None, 1, 1.0))
    _absent(a, "out_dtype", where, "an NVFP4 output", allowed=(None, "float16", "bfloat16", "float32"))
    value = a["kv_cache"]
    if _is_tensor(value) and value.dim() == 5 and value.shape[1] == 2:
        value = (value[:, 0], value[:, 1])  # [P, 2, ...]: the key and value planes
    k_cache, v_cache = _kv_pair(value, f"{where}.kv_cache")
    q = a["query"]
    if not _is_tensor(q) or q.dim() != 3:
        raise DumpError(f"{where}.query must be [tokens, heads, head_dim], got {_describe(q)}")
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    num_kv_heads = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    table = a["block_tables"]
    if not _is_tensor(table) or table.dim() != 2 or table.dtype not in (torch.int32, torch.int64):
        raise DumpError(f"{where}.block_tables must be a [batch, pages] int32 tensor, got {_describe(table)}")
    seq_lens = _index_vector(a["seq_lens"], f"{where}.seq_lens").tolist()
    if len(seq_lens) != table.shape[0]:
        raise DumpError(f"{where}: seq_lens has {len(seq_lens)} entries, block_tables {table.shape[0]} rows")
    indptr, indices, last = [0], [], []
    for r, length in enumerate(seq_lens):
        pages = -(-length // page_size) if length > 0 else 0
        if length <= 0 or pages > table.shape[1]:
            raise DumpError(f"{where}: seq_lens[{r}] = {length} needs {pages} pages; block_tables has "
                            f"{table.shape[1]} columns")
        indices.append(table[r, :pages].to(torch.int64))
        indptr.append(indptr[-1] + pages)
        last.append(length - (pages - 1) * page_size)
    if a.get("cum_seq_lens_q") is not None:
        qo_indptr = _index_vector(a["cum_seq_lens_q"], f"{where}.cum_seq_lens_q").tolist()
    else:
        q_len = _int(a.get("q_len_per_req", 1) or 1, f"{where}.q_len_per_req", low=1)
        qo_indptr = [r * q_len for r in range(len(seq_lens) + 1)]
    causal = True if decode else a.get("causal", True)
    if not isinstance(causal, bool):
        raise DumpError(f"{where}.causal must be true or false, got {_describe(causal)}")
    scale = _scalar(a.get("bmm1_scale"), f"{where}.bmm1_scale", 1.0)
    if a.get("bmm1_scale_log2") is not None:  # takes precedence over bmm1_scale: log2(e) * scale
        scale = _scalar(a["bmm1_scale_log2"], f"{where}.bmm1_scale_log2", None) / math.log2(math.e)
    outputs = call.tensors("outputs")
    output = outputs.get("result", outputs.get("result_0"))
    versions = call.record.get("versions") if isinstance(call.record.get("versions"), dict) else {}
    return PagedCall(
        function=call.function, kv_layout=kv_layout, q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr,
        kv_indptr=indptr, kv_indices=torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64),
        kv_last_page_len=last, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim=q.shape[2],
        page_size=page_size, causal=causal,
        window_left=_int(a.get("window_left", -1), f"{where}.window_left", low=-1),
        sm_scale=scale, v_scale=_scalar(a.get("bmm2_scale"), f"{where}.bmm2_scale", 1.0),
        sinks=a.get("sinks"), output=output,
        provenance={
            "engine": f"flashinfer {call.flashinfer_version}", "flashinfer": call.flashinfer_version,
            "torch": versions.get("torch", "unknown"), "function": call.function,
            "module": str(call.record.get("module", "")), "dump": str(call.path), "kv_layout": kv_layout,
            "kv_layout_from": "kv_layout argument" if "kv_layout" in a else "the function's default",
            "process_id": call.record.get("process_id"), "timestamp": str(call.record.get("timestamp", "")),
            "device": _recorded_device(call, "arg_0"), "output_recorded": output is not None,
        },
    )


def _recorded_device(call: DumpCall, key: str = "arg_1") -> str:
    details = call.record.get("tensor_details")
    q = details.get(key) if isinstance(details, dict) else None
    return str(q.get("device", "unknown")) if isinstance(q, dict) else "unknown"


def _kv_pair(value: Any, where: str):
    """K and V pages from ``paged_kv_cache``: a ``(k, v)`` tuple of 4-D tensors, or one 5-D tensor [P, 2, ...]."""
    if isinstance(value, tuple):
        if len(value) != 2 or not all(_is_tensor(t) and t.dim() == 4 for t in value):
            raise DumpError(f"{where} must be a (k_cache, v_cache) pair of 4-D tensors")
        k, v = value
    elif _is_tensor(value):
        if value.dim() != 5 or value.shape[1] != 2:
            raise DumpError(f"{where} must be [pages, 2, ...] (5-D) or a (k, v) pair, got {_describe(value)}")
        k, v = value[:, 0], value[:, 1]
    else:
        raise DumpError(f"{where} must be a tensor or a (k, v) pair, got {_describe(value)}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise DumpError(f"{where}: K {list(k.shape)} {k.dtype} and V {list(v.shape)} {v.dtype} differ")
    return k, v


# ----------------------------------------------------------------------------- the snapshot


def to_snapshot(call: PagedCall, *, layer_name: str, notes: str | None = None):
    """The kvdbg snapshot of ``call``: checked value by value, each error naming the argument. ``notes`` (default:
    the dump it came from) is the snapshot's free text."""
    import torch

    from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM, MAX_HEAD_SIZE, MAX_HEADS
    from kvdbg.snapshot.meta import BackendMeta, LayerMeta, SnapshotMeta
    from kvdbg.snapshot.store import Snapshot, Step, dtype_name

    fn = call.function
    if call.num_qo_heads > MAX_HEADS or call.num_kv_heads > MAX_HEADS or call.head_dim > MAX_HEAD_SIZE:
        raise DumpError(f"{fn}: {call.num_qo_heads} query heads, {call.num_kv_heads} KV heads of size "
                        f"{call.head_dim}: beyond the snapshot bounds ({MAX_HEADS} heads, size {MAX_HEAD_SIZE})")
    if call.num_qo_heads % call.num_kv_heads:
        raise DumpError(f"{fn}: num_qo_heads {call.num_qo_heads} is not a multiple of num_kv_heads "
                        f"{call.num_kv_heads}")
    k, v = call.k_cache, call.v_cache
    if call.kv_layout == "NHD":
        pages, page_size, kv_heads, dim = k.shape
    else:
        pages, kv_heads, page_size, dim = k.shape
    if (page_size, kv_heads, dim) != (call.page_size, call.num_kv_heads, call.head_dim):
        raise DumpError(f"{fn}: paged_kv_cache pages {list(k.shape)} ({call.kv_layout}) do not match plan's "
                        f"page_size {call.page_size}, num_kv_heads {call.num_kv_heads}, head_dim {call.head_dim}")
    if pages < 1:
        raise DumpError(f"{fn}: paged_kv_cache holds no page")
    q = call.q
    if not _is_tensor(q) or q.dim() != 3 or tuple(q.shape[1:]) != (call.num_qo_heads, call.head_dim):
        raise DumpError(f"{fn}: q must be [tokens, {call.num_qo_heads}, {call.head_dim}], got {_describe(q)}")

    batch = len(call.kv_last_page_len)
    if len(call.kv_indptr) != batch + 1 or len(call.qo_indptr) != batch + 1:
        raise DumpError(f"{fn}: plan's indptr ({len(call.kv_indptr)} entries) and qo_indptr "
                        f"({len(call.qo_indptr)}) must have one more entry than last_page_len ({batch} requests)")
    if batch < 1:
        raise DumpError(f"{fn}: plan has no request")
    if call.qo_indptr[0] != 0 or call.qo_indptr[-1] > q.shape[0] or any(
            b < a for a, b in zip(call.qo_indptr, call.qo_indptr[1:])):
        raise DumpError(f"{fn}: qo_indptr {call.qo_indptr[:8]} must start at 0, never decrease and end within "
                        f"q's {q.shape[0]} rows")
    if any(b < a for a, b in zip(call.kv_indptr, call.kv_indptr[1:])) or call.kv_indptr[0] < 0 or \
            call.kv_indptr[-1] > call.kv_indices.numel():
        raise DumpError(f"{fn}: indptr must never decrease and stay within indices' "
                        f"{call.kv_indices.numel()} entries")
    if call.kv_indices.numel() and (int(call.kv_indices.min()) < 0 or int(call.kv_indices.max()) >= pages):
        bad = int(((call.kv_indices < 0) | (call.kv_indices >= pages)).nonzero()[0, 0])
        raise DumpError(f"{fn}: indices[{bad}] = {int(call.kv_indices[bad])} is outside the cache's {pages} pages")
    widths = [b - a for a, b in zip(call.kv_indptr, call.kv_indptr[1:])]
    width = max(widths)
    if batch * max(width, 1) > MAX_BLOCK_TABLE_ENTRIES:
        raise DumpError(f"{fn}: {batch} requests of up to {width} pages: a block table beyond "
                        f"{MAX_BLOCK_TABLE_ENTRIES} entries")
    seq_lens, query_lens = [], []
    for r in range(batch):
        last = call.kv_last_page_len[r]
        if widths[r] == 0 or not 0 <= last <= call.page_size:
            raise DumpError(f"{fn}: request {r} has {widths[r]} pages and last_page_len {last}; FlashInfer reads "
                            f"(pages - 1) * page_size + last_page_len keys, last_page_len in [0, {call.page_size}]")
        seq_lens.append((widths[r] - 1) * call.page_size + last)
        query_lens.append(call.qo_indptr[r + 1] - call.qo_indptr[r])
        if query_lens[r] > seq_lens[r]:
            raise DumpError(f"{fn}: request {r} has {query_lens[r]} query tokens but {seq_lens[r]} keys")
    if not call.causal and call.window_left >= 0 and max(query_lens) > 1:
        raise DumpError(f"{fn}: window_left {call.window_left} on a not-causal block: FlashInfer's window "
                        "bounds keys on the left only, the format's dense window both sides")

    # Dtypes: the model dtype is the query's (the output's when the query is FP8).
    fp8_names = ("float8_e4m3fn",)
    kv_dtype, q_dtype = dtype_name(k.dtype), dtype_name(q.dtype)
    if kv_dtype not in ("float16", "bfloat16", "float32") + fp8_names:
        raise DumpError(f"{fn}: paged_kv_cache dtype {kv_dtype} is not one a kvdbg snapshot holds "
                        "(float16, bfloat16, float32, float8_e4m3fn)")
    output = call.output
    if output is not None and (not _is_tensor(output) or tuple(output.shape) != (q.shape[0], call.num_qo_heads,
                                                                                 call.head_dim)):
        raise DumpError(f"{fn}: the recorded output is {_describe(output)}, not [tokens, heads, head_dim] like q")
    model_dtype = q_dtype if q_dtype not in fp8_names else (dtype_name(output.dtype) if output is not None
                                                            else "bfloat16")
    if model_dtype not in ("float16", "bfloat16", "float32"):
        raise DumpError(f"{fn}: q dtype {q_dtype} is not one a kvdbg snapshot holds")
    fp8 = kv_dtype in fp8_names
    if q_dtype in fp8_names and not fp8:
        raise DumpError(f"{fn}: an FP8 query over a {kv_dtype} cache, which a kvdbg snapshot cannot hold")
    if not fp8 and kv_dtype != model_dtype:
        raise DumpError(f"{fn}: q is {q_dtype} but the cache {kv_dtype}; a kvdbg snapshot holds one model dtype")
    if output is not None and dtype_name(output.dtype) != model_dtype:
        output = output.to(getattr(torch, model_dtype))

    # FlashInfer folds q_scale and k_scale into the softmax scale and multiplies the output by v_scale, for any
    # cache dtype; the format's scales dequantise FP8 values only. So: an FP8 cache keeps k_scale and v_scale
    # (and an FP8 query q_scale); every other scale is folded into the layer's scale, and an output scale on a
    # cache that is not FP8 is refused.
    scale = call.sm_scale if call.sm_scale is not None else 1.0 / math.sqrt(call.head_dim)
    q_scale, k_scale, v_scale = call.q_scale, call.k_scale, call.v_scale
    if q_dtype not in fp8_names:
        scale, q_scale = scale * q_scale, 1.0
    if not fp8:
        scale, k_scale = scale * k_scale, 1.0
        if v_scale != 1.0:
            raise DumpError(f"{fn}: v_scale (or bmm2_scale) {v_scale} scales the output of a {kv_dtype} cache, which "
                            "a kvdbg snapshot cannot hold")
    if not (math.isfinite(scale) and scale > 0) or min(q_scale, k_scale, v_scale) <= 0:
        raise DumpError(f"{fn}: the softmax scale {scale} and the scales q {q_scale}, k {k_scale}, v {v_scale} "
                        "must be finite and > 0")

    sinks = call.sinks
    if isinstance(sinks, tuple) and len(sinks) == 1:  # the trtllm functions take a list of one tensor
        sinks = sinks[0]
    if sinks is not None:
        if not _is_tensor(sinks) or sinks.numel() != call.num_qo_heads:
            raise DumpError(f"{fn}: sinks must hold one value per query head ({call.num_qo_heads}), got "
                            f"{_describe(sinks)}")
        sinks = sinks.reshape(-1).to(torch.float32).contiguous()

    # The block table: each request's pages, then page 0 (never read: past the live pages).
    block_table = torch.zeros(batch, max(width, 1), dtype=torch.int32)
    for r in range(batch):
        block_table[r, :widths[r]] = call.kv_indices[call.kv_indptr[r]:call.kv_indptr[r + 1]].to(torch.int32)
    live = [block_table[r, :-(-seq_lens[r] // call.page_size)] for r in range(batch)]
    page_ids = torch.unique(torch.cat(live).to(torch.int64))
    if call.kv_layout == "NHD":
        kv_layout = LAYOUT_KV_PLANES  # [2, P, page_size, Hkv, D]
        kv_cache = torch.stack([k.index_select(0, page_ids), v.index_select(0, page_ids)])
    else:
        kv_layout = LAYOUT_VLLM  # [P, Hkv, page_size, 2*D]
        kv_cache = torch.cat([k.index_select(0, page_ids), v.index_select(0, page_ids)], dim=-1)
    tokens = call.qo_indptr[-1]
    layer = LayerMeta(
        name=layer_name, num_heads=call.num_qo_heads, num_kv_heads=call.num_kv_heads, head_size=call.head_dim,
        scale=scale, causal=call.causal, sliding_window=call.window_left + 1 if call.window_left >= 0 else None,
        dtype=model_dtype, kv_cache_dtype="fp8_e4m3" if fp8 else "auto",
        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        logits_soft_cap=call.logits_soft_cap or None, has_sinks=sinks is not None)
    backend = BackendMeta(name=BACKEND_NAME, page_size=call.page_size,
                          max_model_len=max(block_table.shape[1] * call.page_size, max(seq_lens)),
                          num_gpu_blocks=pages, max_decode_query_len=max(1, max(query_lens)))
    meta = SnapshotMeta(layer=layer, backend=backend, kv_layout=kv_layout, num_steps=1,
                        capture=dict(call.provenance),
                        notes=notes or f"imported by kvdbg from a FlashInfer level-10 dump of {fn}")
    step = Step(block_table=block_table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query_start_loc=torch.tensor(call.qo_indptr, dtype=torch.int32),
                query=q[:tokens].contiguous(),
                output=None if output is None else output[:tokens].contiguous())
    snapshot = Snapshot(meta=meta, kv_cache=kv_cache.contiguous(), page_ids=page_ids.to(torch.int32),
                        steps=[step], sinks=sinks)
    try:
        from kvdbg.snapshot.store import validate

        validate(snapshot)
    except SnapshotError as exc:
        raise DumpError(f"{fn}: the imported snapshot is not valid: {exc}") from None
    return snapshot
