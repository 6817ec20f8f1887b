"""The prims_ts decode contract as one Triton kernel, for emulating FLASHINFER_TS fast on CUDA.

Same contract as ``flashinfer_ts.emulate_decode`` (which stays the definition and
the CPU path): request ``b`` reads ``cdiv(seq_lens[b], page_size)`` pages through
``block_tables[b]``; "dense" rows see every key below ``seq_lens[b]``; "causal"
rows are bottom-right aligned with ``window_left``; logits are scaled by
``bmm1_scale``, the normalised output by ``bmm2_scale``; rows that see no key are
left as they were. Q·K runs on tensor cores in the inputs' own 16-bit dtype
(FP8 is widened to bf16 exactly) with fp32 accumulation: every product is exact,
as in the fp32 torch emulation. The probabilities stay fp32 by splitting them
into two 16-bit halves (hi + lo, ~16 significant bits) for the P·V product. With
FP8 inputs the kernel instead models prims_ts's FP8 path as the torch emulation
does (``fp8_rounded_attention``): 128-key tiles dealt in turn to the planner's
one or two K/V instances from each row's first tile (the first its CTA's window
keeps), each instance with its own running max, P scaled by 448 and rounded to
e4m3 for P·V (exact in bf16), the instances merged at the end. With
an online softmax the results match the torch emulation to fp32-level rounding,
not bit for bit. One program handles one (request, KV head) pair and all of
that head's query rows (GQA group x query tokens), so each K/V byte is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdbg.ts.contract import FP8_P_STREAMS, FP8_P_TILE
from kvdbg.ts.planner import DecodeProfile


@triton.jit
def _tile_scores(q, k_ptr, v_ptr, table_ptr, b, kvh, toks, length, last, row_ok, dims,
                 stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_tb,
                 bmm1_scale, window_left, PAGE: tl.constexpr, CAUSAL: tl.constexpr):
    """Masked, scaled logits [rows, keys] of the keys ``toks`` and their values (FP8 widened to bf16, exactly)."""
    tok_ok = toks < length
    page = tl.load(table_ptr + b * stride_tb + toks // PAGE, mask=tok_ok, other=0).to(tl.int64)
    slot = toks % PAGE
    k_off = page[:, None] * stride_kp + kvh * stride_kh + slot[:, None] * stride_kt + dims[None, :]
    v_off = page[:, None] * stride_vp + kvh * stride_vh + slot[:, None] * stride_vt + dims[None, :]
    k = tl.load(k_ptr + k_off, mask=tok_ok[:, None], other=0.0)
    v = tl.load(v_ptr + v_off, mask=tok_ok[:, None], other=0.0)
    if k.dtype.is_fp8():
        k = k.to(tl.bfloat16)
        v = v.to(tl.bfloat16)
    s = tl.dot(q, tl.trans(k)) * bmm1_scale
    allowed = tok_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        allowed = allowed & (toks[None, :] <= last[:, None])
        if window_left >= 0:
            allowed = allowed & (toks[None, :] >= last[:, None] - window_left)
    return tl.where(allowed, s, float("-inf")), v


@triton.jit
def _fp8_p_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, tok0, length, last, row_ok, dims,
                stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_tb,
                bmm1_scale, window_left, m, denom, acc,
                PAGE: tl.constexpr, TILE: tl.constexpr, CAUSAL: tl.constexpr):
    """One 128-key tile of one FP8 stream: online softmax with P rounded to e4m3 at 448x for P.V."""
    s, v = _tile_scores(q, k_ptr, v_ptr, table_ptr, b, kvh, tok0 + tl.arange(0, TILE), length, last, row_ok, dims,
                        stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_tb,
                        bmm1_scale, window_left, PAGE=PAGE, CAUSAL=CAUSAL)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None]) * 448.0
    alpha = tl.exp(m - m_safe)
    denom = denom * alpha + tl.sum(p, axis=1)
    p8 = p.to(tl.float8e4nv).to(tl.bfloat16)  # every e4m3 value is exact in bf16
    acc = acc * alpha[:, None] + tl.dot(p8, v)
    return m_new, denom, acc


@triton.jit
def _request_defined(seq_lens_ptr, table_ptr, b, stride_tb, table_width, num_pages, max_kv_len,
                     SQ: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, SCAN: tl.constexpr):
    """Is request ``b`` computed? ``flashinfer_ts.undefined_codes`` == 0, evaluated in the kernel.

    A positive length within max_kv_len (a causal row: at least SQ), no more live
    pages than the table's width, every live entry a page of the cache. Reading
    it here keeps the launch free of the ~30 small torch ops the same scan costs
    from the host.
    """
    length = tl.load(seq_lens_ptr + b).to(tl.int64)
    pages = (tl.maximum(length, 0) + PAGE - 1) // PAGE
    ok = (length > 0) & (length <= max_kv_len) & (pages <= table_width)
    if CAUSAL:
        ok = ok & (length >= SQ)
    live = tl.minimum(pages, table_width)
    bad = length * 0
    for first in range(0, live, SCAN):
        cols = first + tl.arange(0, SCAN)
        entry = tl.load(table_ptr + b * stride_tb + cols, mask=cols < live, other=0)
        bad += tl.sum(((cols < live) & ((entry < 0) | (entry >= num_pages))).to(tl.int64), axis=0)
    return ok & (bad == 0)


@triton.jit(do_not_specialize=["window_left", "num_pages", "max_kv_len"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seq_lens_ptr, table_ptr, valid_ptr,
    bmm1_scale, bmm2_scale, window_left, num_pages, max_kv_len,
    # Strides and the table's width are fixed for a snapshot: as constants they fold into the
    # address arithmetic and leave Triton's launcher 14 fewer arguments to bind on every call.
    stride_qb: tl.constexpr, stride_qs: tl.constexpr, stride_qh: tl.constexpr,
    stride_kp: tl.constexpr, stride_kh: tl.constexpr, stride_kt: tl.constexpr,
    stride_vp: tl.constexpr, stride_vh: tl.constexpr, stride_vt: tl.constexpr,
    stride_ob: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    stride_tb: tl.constexpr, table_width: tl.constexpr,
    SQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FP8_P: tl.constexpr,
    INSTANCES: tl.constexpr, TOKENS_PER_CTA: tl.constexpr, HAS_VALID: tl.constexpr, CHECK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    length = tl.load(seq_lens_ptr + b).to(tl.int64)
    # A request left out (valid == 0, or a broken precondition) sees no key, so nothing of it is stored.
    if HAS_VALID:
        length = tl.where(tl.load(valid_ptr + b) != 0, length, 0)
    if CHECK:
        defined = _request_defined(seq_lens_ptr, table_ptr, b, stride_tb, table_width, num_pages, max_kv_len,
                                   SQ=SQ, PAGE=PAGE, CAUSAL=CAUSAL, SCAN=128)
        length = tl.where(defined, length, 0)

    rows = tl.arange(0, BLOCK_M)  # row = g * SQ + i
    g = rows // SQ
    i = rows % SQ
    row_ok = rows < GROUP * SQ
    head = kvh * GROUP + g
    dims = tl.arange(0, D)
    q_off = b * stride_qb + i[:, None] * stride_qs + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    if q.dtype.is_fp8():
        q = q.to(tl.bfloat16)

    last = length - SQ + i  # causal: the row's own position
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    start = length * 0
    if FP8_P:
        # BLOCK_N (= 128)-key tiles dealt in turn to INSTANCES K/V instances from each row's first tile: the
        # kernel skips whole tiles before the window of the row's CTA (its first token, TOKENS_PER_CTA per CTA).
        first = i * 0
        if CAUSAL:
            cta_token = (i // TOKENS_PER_CTA) * TOKENS_PER_CTA
            first = tl.where(window_left >= 0, tl.maximum(length - SQ + cta_token - window_left, 0) // BLOCK_N, 0)
            lo = tl.maximum(length - SQ - window_left, 0)  # row 0's CTA starts first: no row sees keys before
            start = tl.where(window_left >= 0, (lo // BLOCK_N) * BLOCK_N, start)
        m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom1 = tl.zeros([BLOCK_M], tl.float32)
        acc1 = tl.zeros([BLOCK_M, D], tl.float32)
        for tok0 in range(start, length, BLOCK_N):
            if INSTANCES == 1:
                m, denom, acc = _fp8_p_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, tok0, length, last, row_ok, dims,
                                            stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
                                            stride_tb, bmm1_scale, window_left, m, denom, acc,
                                            PAGE=PAGE, TILE=BLOCK_N, CAUSAL=CAUSAL)
            else:
                # Parity by bit: a tile before a row's first tile is masked for it whichever state it updates.
                mine = ((tok0 // BLOCK_N - first) & 1) == 0  # [BLOCK_M]: this tile is instance 0's
                m_new, denom_new, acc_new = _fp8_p_tile(
                    q, k_ptr, v_ptr, table_ptr, b, kvh, tok0, length, last, row_ok, dims,
                    stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_tb, bmm1_scale,
                    window_left, tl.where(mine, m, m1), tl.where(mine, denom, denom1),
                    tl.where(mine[:, None], acc, acc1), PAGE=PAGE, TILE=BLOCK_N, CAUSAL=CAUSAL)
                m, m1 = tl.where(mine, m_new, m), tl.where(mine, m1, m_new)
                denom, denom1 = tl.where(mine, denom_new, denom), tl.where(mine, denom1, denom_new)
                acc, acc1 = tl.where(mine[:, None], acc_new, acc), tl.where(mine[:, None], acc1, acc_new)
        if INSTANCES == 2:
            top = tl.maximum(m, m1)
            top_safe = tl.where(top == float("-inf"), 0.0, top)
            w0 = tl.exp(m - top_safe)
            w1 = tl.exp(m1 - top_safe)
            denom = denom * w0 + denom1 * w1
            acc = acc * w0[:, None] + acc1 * w1[:, None]
    else:
        if CAUSAL:
            # A causal window lets no row see keys before its first row's window: skip those blocks.
            lo = tl.maximum(length - SQ - window_left, 0)
            start = tl.where(window_left >= 0, (lo // BLOCK_N) * BLOCK_N, start)
        for tok0 in range(start, length, BLOCK_N):
            s, v = _tile_scores(q, k_ptr, v_ptr, table_ptr, b, kvh, tok0 + tl.arange(0, BLOCK_N), length, last,
                                row_ok, dims, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
                                stride_tb, bmm1_scale, window_left, PAGE=PAGE, CAUSAL=CAUSAL)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # Rows that have seen no key yet keep m = -inf; subtract 0 there to avoid inf - inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + tl.sum(p, axis=1)
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p_hi, v) + tl.dot(p_lo, v)
            m = m_new

    seen = row_ok & (denom > 0)
    result = acc / tl.where(seen, denom, 1.0)[:, None] * bmm2_scale
    o_off = b * stride_ob + i[:, None] * stride_os + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty), mask=seen[:, None])


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """None when the Triton path can run these tensors, else why not (the torch path runs instead)."""
    d = q.shape[-1]
    if not (q.is_cuda and k_cache.is_cuda):
        return "tensors are not on CUDA"
    if d & (d - 1) or d < 16:
        return f"head_dim {d} is not a power of two >= 16"
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        return "head_dim is not contiguous"
    kinds = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    if q.dtype not in kinds or k_cache.dtype not in kinds or (q.dtype.itemsize == 2 and q.dtype != k_cache.dtype):
        return f"query {q.dtype} / cache {k_cache.dtype} are not one of the kernel's dtype pairs"
    return None


def triton_decode(q, k_cache, v_cache, seq_lens, block_tables, *, mask_type: str, window_left: int,
                  bmm1_scale: float, bmm2_scale: float, out: torch.Tensor, requests: list[int] | None = None,
                  valid: torch.Tensor | None = None, max_kv_len: int | None = None, block_n: int | None = None,
                  num_warps: int = 4, num_stages: int = 2, fp8_p: bool | None = None,
                  fp8_profile: DecodeProfile | None = None):
    """Drop-in for ``emulate_decode`` on CUDA tensors (no ``key_mask``); the tile knobs are for bench/.

    ``fp8_p`` (default: FP8 q and K) models the FP8 kernel's P rounding, with 128-key tiles and the K/V
    instances and query tokens per CTA of ``fp8_profile`` (default: two, one), as ``emulate_decode`` does.

    ``max_kv_len``: the kernel itself leaves out every request the real kernel
    does not compute (``flashinfer_ts.undefined_codes``: a length outside
    [1, max_kv_len] or below the query length of a causal row, a table too
    narrow, a live entry outside the cache), with no host round trip and no
    extra launch. ``valid`` [batch] bool on the device selects requests too;
    ``requests`` (host indices) does the same the way ``emulate_decode`` takes it.
    """
    batch, sq, hq, d = q.shape
    hkv, page_size = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if requests is not None:
        chosen = torch.zeros(batch, dtype=torch.bool)
        chosen[list(requests)] = True
        chosen = chosen.to(q.device)
        valid = chosen if valid is None else valid & chosen
    if batch == 0 or sq == 0:
        return out
    block_m = max(16, triton.next_power_of_2(group * sq))
    # Keep the fp32 score and accumulator tiles within registers/shared memory.
    if fp8_p is None:
        fp8_p = q.dtype == torch.float8_e4m3fn and k_cache.dtype == torch.float8_e4m3fn
    instances = fp8_profile.kv_instances if fp8_profile is not None else FP8_P_STREAMS
    tokens_per_cta = fp8_profile.q_tokens_per_cta if fp8_profile is not None else 1
    if fp8_p:
        assert instances in (1, 2), "the Triton kernel models one or two FP8 K/V instances"
        block_n = FP8_P_TILE  # the kernel's tile, not a tuning knob here
    elif block_n is None:  # measured on an H200 (bench/ts_triton_tiles.py): larger key tiles while registers allow
        block_n = 128 if block_m * d <= 32 * 128 else 64 if block_m * d <= 64 * 128 else 32
    _decode_kernel[(batch, hkv)](
        q, k_cache, v_cache, out, seq_lens, block_tables, seq_lens if valid is None else valid.to(torch.int8),
        float(bmm1_scale), float(bmm2_scale), int(window_left), k_cache.shape[0], max_kv_len or 0,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3],
        block_tables.stride(0), block_tables.shape[1],
        SQ=sq, GROUP=group, D=d, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=mask_type == "causal", FP8_P=bool(fp8_p), INSTANCES=instances, TOKENS_PER_CTA=tokens_per_cta,
        HAS_VALID=valid is not None,
        CHECK=max_kv_len is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return out
