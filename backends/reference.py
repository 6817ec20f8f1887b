"""The exact reference: attention over the logical KV gathered through the block table.

Correctness is defined here; every backend is compared against it. Masks are
those of docs/snapshot-format.md, with ``p = L - q + i`` the absolute position of
query token ``i``: causal ``k <= p`` (window: ``p - w < k <= p``); dense
``k < L`` (window: vLLM's ``|p - k| < w`` and ``k < L``); with a chunk lookback
``b`` the window is replaced by chunks of ``c = w // (b + 1)`` tokens,
``p // c - k // c <= b``. The logit of key ``k`` is ``s = scale * q.k``, soft-capped
to ``cap * tanh(s / cap)``, plus the head's ALiBi bias ``-slope * |p - k|``
(square-root variant: ``-slope * sqrt(p - k)`` for ``k <= p``, 0 after). A head's
sink logit joins the softmax denominator once, with no value. A key no token may
see contributes nothing, even when its K or V holds NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.backends.base import BackendSpec, Capabilities, CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.snapshot.layout import as_fp8, dequantize_fp8, finite_pages, kv_head_dim, kv_views, page_dim, split_kv
from kvdbg.errors import SnapshotError
from kvdbg.snapshot.format import ATTN_TYPES

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

# Bytes of gathered K/V + scores one chunk may hold. Requests are grouped up to it,
# and a request too long for it alone is cut along its KV length into blocks merged
# by an exact log-sum-exp (online softmax), so neither a long batch nor a hostile
# table repeating one page thousands of times can make the reference allocate more.
# On CPU 64 MiB: a chunk's live temporaries come to ~1.5x it, and a replay must stay within 1.5x the file
# it reads plus torch; larger chunks saved nothing measurable on CPU (docs/benchmarks.md).
CHUNK_BUDGET_BYTES = 64 * 1024 * 1024
# On a GPU fewer, larger chunks save launches and syncs (64 x 8192 on an H200, bench/gpu_breakdown.py:
# 22 chunks 30 ms, 6 chunks 17-19 ms, 2 chunks 14-16 ms); the budget is also held to a quarter of the
# free device memory.
CUDA_CHUNK_BUDGET_BYTES = 4 * 1024 * 1024 * 1024


@dataclass
class ReferenceMetadata:
    """Requests grouped into chunks of similar length (passive; built by ReferenceBuilder)."""

    chunks: list["torch.Tensor"]  # each: request indices (int64) processed together
    page_counts: list[int]  # live pages each chunk gathers (its longest request)
    block_pages: list[int]  # pages of KV each chunk gathers at once (== page_counts[i] when not cut)
    query_lens: "torch.Tensor"  # [num_reqs] int64
    seq_lens: "torch.Tensor"  # [num_reqs] int64
    query_start_loc: "torch.Tensor"  # [num_reqs + 1] int64
    block_table: "torch.Tensor"  # [num_reqs, width] stored-page indices
    causal: bool
    sliding_window: int | None
    page_size: int
    sinks: "torch.Tensor | None" = None  # [Hq] sink logits, when the layer has them
    alibi_slopes: "torch.Tensor | None" = None  # [Hq] ALiBi slopes, when the layer has them


class ReferenceBuilder:
    def __init__(self, meta: "SnapshotMeta", compute_dtype: "torch.dtype"):
        self.meta = meta
        self.compute_dtype = compute_dtype

    def build(self, common: CommonMetadata) -> ReferenceMetadata:
        layer, ps = self.meta.layer, common.page_size
        _require_values(layer, common)
        seq_lens = common.seq_lens.to(torch.int64)
        query_lens = common.query_lens.to(torch.int64)
        pages = (seq_lens + ps - 1) // ps
        bytes_per = torch.finfo(self.compute_dtype).bits // 8
        budget = _budget_bytes(common.seq_lens.device) // bytes_per  # elements
        # Sorting by length makes each chunk pad to a length close to its members'.
        order = torch.argsort(pages, stable=True).cpu()
        pages_cpu = pages.cpu().tolist()
        qlens_cpu = query_lens.cpu().tolist()

        # K and V widened to the compute dtype, the cache's own pages they are widened from (alive
        # during the copy, counted in compute elements), then scores and probabilities.
        cache_bytes = 1 if layer.is_fp8 else torch.finfo(getattr(torch, layer.dtype)).bits // 8
        kv_elements = 2 * layer.num_kv_heads * layer.head_size
        gathered = -(-kv_elements * cache_bytes // bytes_per)

        def per_token(q_len: int) -> int:
            return kv_elements + gathered + 2 * layer.num_heads * q_len

        chunks, page_counts, block_pages, current, widest_q = [], [], [], [], 0

        def close(members: list[int], q_len: int) -> None:
            longest = pages_cpu[members[-1]]
            fit = budget // max(1, len(members) * ps * per_token(q_len))
            chunks.append(torch.tensor(members, dtype=torch.int64))
            page_counts.append(longest)
            block_pages.append(max(1, min(longest, fit)))

        for r in order.tolist():
            # Ascending order: the request just added is the chunk's longest.
            longest = pages_cpu[r] * ps
            wider = max(widest_q, qlens_cpu[r])
            if current and (len(current) + 1) * longest * per_token(wider) > budget:
                close(current, widest_q)
                current, wider = [], qlens_cpu[r]
            current.append(r)
            widest_q = wider
        if current:
            close(current, widest_q)
        device = common.seq_lens.device
        return ReferenceMetadata(
            chunks=[c.to(device) for c in chunks],
            page_counts=page_counts,
            block_pages=block_pages,
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=common.query_start_loc.to(torch.int64),
            block_table=common.block_table.to(torch.int64),
            causal=common.causal,
            sliding_window=common.sliding_window,
            page_size=ps,
            sinks=common.sinks,
            alibi_slopes=common.alibi_slopes,
        )


def _require_values(layer, common: CommonMetadata) -> None:
    """A layer flag whose values the snapshot does not hold cannot be modelled: refuse it by name."""
    for flag, values, name, what in (("has_sinks", common.sinks, "sinks", "attention sinks"),
                                     ("has_alibi", common.alibi_slopes, "alibi_slopes", "ALiBi slopes")):
        if getattr(layer, flag) and values is None:
            raise SnapshotError(
                f"meta field layer.{flag} is true but the snapshot holds no {name!r} tensor: the reference "
                f"cannot model {what} without their values (a capture by an older kvdbg records only the flag; "
                "capture the step again)")


def _budget_bytes(device: "torch.device") -> int:
    if device.type != "cuda":
        return CHUNK_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(CHUNK_BUDGET_BYTES, min(CUDA_CHUNK_BUDGET_BYTES, free // 4))


class ReferenceImpl:
    def __init__(self, meta: "SnapshotMeta", compute_dtype: "torch.dtype", dense_window: str = "symmetric"):
        self.meta = meta
        self.compute_dtype = compute_dtype
        self.left_window_only = dense_window == "left"  # ReplayOptions.dense_window: a what-if only

    def forward(self, query, kv_cache, md: ReferenceMetadata, output):
        layer = self.meta.layer
        dt = self.compute_dtype
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        group = hq // hkv
        ps = md.page_size
        _, v_pages = kv_views(self.meta, kv_cache)
        fp8 = layer.is_fp8
        query = as_fp8(query) if fp8 else query
        fp8_query = query.dtype == torch.float8_e4m3fn
        device = query.device
        soft_cap = float(layer.logits_soft_cap or 0.0)
        # Per query head, laid out as the score rows [Hkv, 1, G, 1] (row g * qmax + i of KV head h).
        sinks = None if md.sinks is None else md.sinks.to(device, dt).view(hkv, 1, group, 1)
        slopes = None if md.alibi_slopes is None else md.alibi_slopes.to(device, dt).view(hkv, 1, group, 1, 1)
        window, lookback = md.sliding_window, layer.chunk_lookback
        chunk = None if lookback is None else window // (lookback + 1)
        # One check of the whole V cache (one host sync) spares each chunk its own; a cache with a
        # non-finite value anywhere has each chunk checked for the keys its tokens cannot see.
        values_finite = bool(finite_pages(v_pages).all())

        for reqs, num_pages, step_pages in zip(md.chunks, md.page_counts, md.block_pages):
            n = reqs.numel()
            if n == 0 or num_pages == 0:
                continue
            seq_lens = md.seq_lens[reqs]
            qlens = md.query_lens[reqs]
            qmax = int(qlens.max())
            if qmax == 0:
                continue
            # Gather each request's query block, padded to qmax; padded rows are dropped below.
            offsets = torch.arange(qmax, device=device)
            token = md.query_start_loc[reqs].unsqueeze(1) + offsets.unsqueeze(0)  # [n, qmax]
            real = offsets.unsqueeze(0) < qlens.unsqueeze(1)
            token = torch.where(real, token, torch.zeros_like(token))
            q = query[token]  # [n, qmax, Hq, D]
            q = dequantize_fp8(q, layer.q_scale, dt) if fp8_query else q.to(dt)
            # Head-major [Hkv, n, G*qmax, D] (row g * qmax + i), as _gather lays out K and V.
            q = q.reshape(n, qmax, hkv, group, d).permute(2, 0, 3, 1, 4).reshape(hkv, n, group * qmax, d)
            pos = (seq_lens - qlens).unsqueeze(1) + offsets.unsqueeze(0)  # p = L - q + i, [n, qmax]

            def block_scores(first_page: int, last_page: int):
                """Masked scores [Hkv, n, G*qmax, keys] and values of pages [first_page, last_page)."""
                kv_len = (last_page - first_page) * ps
                # Entries past a request's live pages may be -1 (not stored) or stale; they are masked by k < L.
                table = md.block_table[reqs, first_page:last_page].clamp_min(0)
                keys, values = _gather(self.meta, kv_cache, table, dt)
                scores = torch.matmul(q, keys.transpose(-1, -2)) * layer.scale  # [Hkv, n, G*qmax, kv_len]
                del keys
                if soft_cap:
                    scores = torch.tanh(scores / soft_cap) * soft_cap
                k = torch.arange(first_page * ps, last_page * ps, device=device).view(1, 1, kv_len)
                p = pos.unsqueeze(2)
                allowed = (k <= p) if md.causal else (k < seq_lens.view(n, 1, 1))
                if chunk is not None:  # TRITON_ATTN: chunks with lookback replace the window
                    allowed = allowed & (torch.div(p, chunk, rounding_mode="floor")
                                         - torch.div(k, chunk, rounding_mode="floor") <= lookback)
                elif window is not None:
                    if md.causal or not self.left_window_only:
                        allowed = allowed & ((p - k).abs() < window)
                    else:
                        allowed = allowed & (p - k < window)
                allowed = allowed & real.unsqueeze(2)
                scores = scores.view(hkv, n, group, qmax, kv_len)
                if slopes is not None:  # in place: the bias never exists at the size of the scores
                    scores.addcmul_(slopes, _alibi_offsets(p - k, layer.alibi_sqrt, dt).unsqueeze(1))
                scores = scores.masked_fill(~allowed.view(1, n, 1, qmax, kv_len), float("-inf"))
                if values_finite:
                    return scores.view(hkv, n, group * qmax, kv_len), (values, None)
                return scores.view(hkv, n, group * qmax, kv_len), _masked_values(values, allowed, group)

            sink_rows = None if sinks is None else sinks.expand(hkv, n, group, qmax).reshape(hkv, n, group * qmax, 1)
            if step_pages >= num_pages and sink_rows is None:
                scores, (values, poisoned) = block_scores(0, num_pages)
                probs = torch.softmax(scores, dim=-1)
                del scores
                out = torch.matmul(probs, values)
                if poisoned is not None:
                    out = out.masked_fill(poisoned, float("nan"))
            else:
                out = self._online_softmax(block_scores, num_pages, step_pages, sink_rows)
            out = out.view(hkv, n, group, qmax, d).permute(1, 3, 0, 2, 4).reshape(n, qmax, hq, d)
            output[token[real]] = out[real].to(output.dtype)
        return output

    @staticmethod
    def _online_softmax(block_scores, num_pages: int, step_pages: int, sinks=None):
        """softmax(scores) @ values over KV blocks of ``step_pages`` pages, merged exactly.

        Keeps a running row maximum ``m``, denominator ``l`` and unnormalised
        output ``acc``; a new block rescales them by ``exp(m_old - m_new)``. Rows
        that see no key at all end as 0/0 = NaN, as one softmax over -inf gives.
        ``sinks`` [rows, 1]: each row's sink logit, counted once as the state
        before the first block (``m = sink``, ``l = 1``, no value); a row that
        sees no key then gives 0.
        """
        m = l = acc = poisoned = None
        if sinks is not None:
            m, l = sinks, torch.ones_like(sinks)
        for first in range(0, num_pages, step_pages):
            scores, (values, block_poisoned) = block_scores(first, min(first + step_pages, num_pages))
            if block_poisoned is not None:
                poisoned = block_poisoned if poisoned is None else poisoned | block_poisoned
            block_max = scores.amax(dim=-1, keepdim=True)
            m_new = block_max if m is None else torch.maximum(m, block_max)
            # A row with no visible key so far has m_new = -inf; shift by 0 there so exp gives 0, not NaN.
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            weights = torch.exp(scores - shift)
            del scores
            block_out = torch.matmul(weights, values)
            block_sum = weights.sum(dim=-1, keepdim=True)
            del weights, values
            if acc is None and m is not None:  # the sinks' state: nothing accumulated yet
                acc = torch.zeros_like(block_out)
            if m is None:
                acc, l = block_out, block_sum
            else:
                rescale = torch.exp(torch.where(torch.isinf(m), m, m - shift))
                acc = acc * rescale + block_out
                l = l * rescale + block_sum
            m = m_new
        out = acc / l
        return out if poisoned is None else out.masked_fill(poisoned, float("nan"))


def _alibi_offsets(distance, sqrt: bool, dtype):
    """ALiBi's position term for ``distance = p - k``, to be scaled by each head's slope.

    Linear: ``-|p - k|``, FlashAttention's definition, which for a causal row is
    ``k - p`` (TRITON_ATTN adds ``k - (L - q)``, CPU_ATTN ``k - p``, the same up to
    a per-row constant, which softmax ignores; for keys after ``p`` of a dense row
    their terms keep growing instead). Square root (TRITON_ATTN's use_alibi_sqrt):
    ``-sqrt(p - k)`` for keys up to ``p``, 0 after.
    """
    distance = distance.to(dtype)
    if sqrt:
        return torch.where(distance >= 0, -distance.clamp_min(0).sqrt(), torch.zeros_like(distance))
    return -distance.abs()


def _gather(meta: "SnapshotMeta", kv_cache, table, dtype):
    """K and V of pages ``table`` [n, P], each as [Hkv, n, P*ps, D] in ``dtype`` (FP8 dequantised).

    Whole pages are gathered at once (K and V together), then widened in one
    copy that also puts heads before pages: each (head, page) slot stays one
    contiguous run, and the K and V views of the result need no further copy
    for the products (a 64 x 8192 batch on an H200: 12.6 ms, against 16-30 ms
    for gathering K and V apart and reordering them after widening).
    """
    n, num = table.shape
    layout, layer = meta.kv_layout, meta.layer
    pages_at, heads_at = page_dim(layout), kv_head_dim(layout)
    picked = kv_cache.index_select(pages_at, table.reshape(-1))
    if layer.is_fp8:
        picked = as_fp8(picked)
    order = [i for i in range(picked.dim()) if i != heads_at]
    order.insert(pages_at, heads_at)  # the head dimension moved just before the page dimension
    wide = torch.empty([picked.shape[i] for i in order], dtype=dtype, device=picked.device)
    wide.copy_(picked.permute(order))
    keys, values = split_kv(wide.permute([order.index(i) for i in range(len(order))]), layout, layer.head_size)
    if layer.is_fp8:
        for view, scale in ((keys, layer.k_scale), (values, layer.v_scale)):
            if scale != 1.0:
                view.mul_(scale)
    hkv, ps, d = keys.shape[1:]
    return (keys.transpose(0, 1).reshape(hkv, n, num * ps, d),
            values.transpose(0, 1).reshape(hkv, n, num * ps, d))


def _masked_values(values, allowed, group: int):
    """(values with non-finite entries zeroed, [Hkv, n, G*q, D] mask of outputs they make NaN) or (values, None).

    ``probs @ values`` would turn a NaN value under a zero probability (a key
    outside the token's window) into NaN: 0 x NaN = NaN. The exact answer is that
    such a key contributes nothing, while a NaN a token does see makes its output
    NaN in that channel. ``values`` [Hkv, n, keys, D], ``allowed`` [n, q, keys].
    The check is one reduction; only a poisoned block pays for the extra product.
    """
    # One fp32 sum is finite for every finite block (its values are far below fp32's range); only a
    # poisoned block pays for the element-wise check.
    if bool(torch.isfinite(values.sum(dtype=torch.float32))):
        return values, None
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return values, None
    hkv, n, kv_len, d = values.shape
    qmax = allowed.shape[1]
    seen = allowed.to(values.dtype).view(1, n, qmax, kv_len)
    hits = torch.matmul(seen, bad.to(values.dtype)) > 0  # [Hkv, n, qmax, D]
    poisoned = hits.unsqueeze(2).expand(hkv, n, group, qmax, d).reshape(hkv, n, group * qmax, d)
    return torch.where(bad, torch.zeros_like(values), values), poisoned


def feature_notes(layer) -> list[str]:
    """What the reference models of the layer's features, one note each (describe() and the docs say the same)."""
    notes = []
    if layer.has_sinks:
        notes.append("attention sinks: each head's sink logit joins the softmax denominator once (no value, no "
                     "scale, soft cap or bias), as vLLM's kernels initialise the running max with it")
    if layer.has_alibi:
        if layer.alibi_sqrt:
            notes.append("ALiBi, square-root variant: -slope * sqrt(p - k) for keys up to p, 0 after "
                         "(TRITON_ATTN's use_alibi_sqrt), added after the soft cap")
        else:
            notes.append("ALiBi: -slope * |p - k| added after the soft cap (FlashAttention's definition; for a "
                         "causal row vLLM's kernels agree up to a per-row constant)")
            if not layer.causal:
                notes.append("ALiBi on a dense mask: TRITON_ATTN adds slope * (k - (L - q)) instead, and CPU_ATTN's "
                             "kernel slope * (k - p) (vLLM 0.32; `kvdbg conform` shows it), which grow for keys "
                             "after p: their output differs from this definition there")
    if layer.chunk_lookback is not None and layer.sliding_window is not None:
        chunk = layer.sliding_window // (layer.chunk_lookback + 1)
        notes.append(f"chunked attention: chunks of {chunk} tokens (sliding_window // (chunk_lookback + 1)); a "
                     f"query sees its own chunk and {layer.chunk_lookback} before it, instead of the window")
    if layer.attn_type in ("encoder", "encoder_only"):
        notes.append(f"attn_type {layer.attn_type}: bidirectional over the step's own tokens (seq_len = query length)")
    elif layer.attn_type == "encoder_decoder":
        notes.append("attn_type encoder_decoder: each decoder query sees every one of the request's seq_len "
                     "encoder keys")
    if layer.kv_sharing_target is not None:
        notes.append(f"KV shared: the cache is {layer.kv_sharing_target}'s, read as captured (this layer writes "
                     "none)")
    return notes


class ReferenceInstance:
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions):
        self.meta = meta
        self.options = options
        self.compute_dtype = torch.float64 if options.exact else torch.float32
        self.output_dtype = self.compute_dtype
        self.builder = ReferenceBuilder(meta, self.compute_dtype)
        self.impl = ReferenceImpl(meta, self.compute_dtype, options.dense_window)

    def describe(self) -> RunInfo:
        name = "float64" if self.options.exact else "float32"
        notes = ["logical KV gathered through the block table; GQA by head grouping"]
        if self.meta.layer.is_fp8:
            notes.append("FP8 query/K/V dequantised with the q/k/v scales before attention")
        layer = self.meta.layer
        if layer.logits_soft_cap:
            cap = layer.logits_soft_cap
            notes.append(f"logits soft-capped: {cap:g} * tanh(scale * q.k / {cap:g}) before the mask")
        notes.extend(feature_notes(layer))
        if self.impl.left_window_only and not layer.causal and layer.sliding_window:
            notes.append("what-if: a non-causal window bounding keys on the left only (p - w < k), not vLLM's "
                         "|p - k| < w")
        return RunInfo(backend="reference", kernel=f"exact torch attention ({name} accumulate)",
                       device=self.options.device, dtype=name, notes=notes)

    def findings(self, common: CommonMetadata, metadata: Any) -> list[Finding]:
        return []

    def explain(self, common: CommonMetadata, metadata: ReferenceMetadata) -> list[dict[str, Any]]:
        rows = []
        w, lookback = metadata.sliding_window, self.meta.layer.chunk_lookback
        for r, (length, q) in enumerate(zip(metadata.seq_lens.tolist(), metadata.query_lens.tolist())):
            first = length - q
            if lookback is not None and w:
                c = w // (lookback + 1)
                end = "p" if metadata.causal else str(length - 1)
                seen = f"[max(0, {c} * (p // {c} - {lookback})), {end}] for p in [{first}, {length - 1}]"
            elif metadata.causal:
                lo = (first - w + 1) if w else 0
                seen = f"[{max(lo, 0)}, p] for p in [{first}, {length - 1}]"
            else:
                seen = (f"[max(0, p-{w - 1}), min({length - 1}, p+{w - 1})] for p in [{first}, {length - 1}]"
                        if w else f"[0, {length - 1}]")
            rows.append({"request": r, "seq_len": length, "query_len": q, "keys": seen})
        return rows


BACKEND = BackendSpec(
    name="reference",
    engine_name="REFERENCE",
    summary="exact attention over the logical KV (fp32, fp64 with --exact)",
    # Everything the format records is modelled except what needs per-request data it does not hold.
    capabilities=Capabilities(who="the reference", sinks=True, alibi=True, alibi_sqrt=True, chunk_lookback=True,
                              kv_sharing=True, attn_types=ATTN_TYPES),
    create=lambda meta, options: ReferenceInstance(meta, options),
)
