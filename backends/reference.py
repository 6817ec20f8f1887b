"""The exact reference: attention over the logical KV gathered through the block table.

Correctness is defined here; every backend is compared against it. Masks are
those of docs/snapshot-format.md, with ``p = L - q + i`` the absolute position of
query token ``i``: causal ``k <= p`` (window: ``p - w < k <= p``); dense
``k < L`` (window: vLLM's ``|p - k| < w`` and ``k < L``). A soft-capped layer
caps the scaled logits as ``cap * tanh(s / cap)`` before the mask. A key no
token may see contributes nothing, even when its K or V holds NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.backend_api import BackendSpec, Capabilities, CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.cache import as_fp8, dequantize_fp8, finite_pages, kv_head_dim, kv_views, page_dim, split_kv

if TYPE_CHECKING:
    from kvdbg.format import SnapshotMeta

# Bytes of gathered K/V + scores one chunk may hold. Requests are grouped up to it,
# and a request too long for it alone is cut along its KV length into blocks merged
# by an exact log-sum-exp (online softmax), so neither a long batch nor a hostile
# table repeating one page thousands of times can make the reference allocate more.
CHUNK_BUDGET_BYTES = 256 * 1024 * 1024
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


class ReferenceBuilder:
    def __init__(self, meta: "SnapshotMeta", compute_dtype: "torch.dtype"):
        self.meta = meta
        self.compute_dtype = compute_dtype

    def build(self, common: CommonMetadata) -> ReferenceMetadata:
        layer, ps = self.meta.layer, common.page_size
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
        )


def _budget_bytes(device: "torch.device") -> int:
    if device.type != "cuda":
        return CHUNK_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(CHUNK_BUDGET_BYTES, min(CUDA_CHUNK_BUDGET_BYTES, free // 4))


class ReferenceImpl:
    def __init__(self, meta: "SnapshotMeta", compute_dtype: "torch.dtype"):
        self.meta = meta
        self.compute_dtype = compute_dtype

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
                if md.sliding_window is not None:
                    allowed = allowed & ((p - k).abs() < md.sliding_window)
                allowed = allowed & real.unsqueeze(2)
                scores = scores.view(hkv, n, group, qmax, kv_len)
                scores = scores.masked_fill(~allowed.view(1, n, 1, qmax, kv_len), float("-inf"))
                if values_finite:
                    return scores.view(hkv, n, group * qmax, kv_len), (values, None)
                return scores.view(hkv, n, group * qmax, kv_len), _masked_values(values, allowed, group)

            if step_pages >= num_pages:
                scores, (values, poisoned) = block_scores(0, num_pages)
                probs = torch.softmax(scores, dim=-1)
                del scores
                out = torch.matmul(probs, values)
                if poisoned is not None:
                    out = out.masked_fill(poisoned, float("nan"))
            else:
                out = self._online_softmax(block_scores, num_pages, step_pages)
            out = out.view(hkv, n, group, qmax, d).permute(1, 3, 0, 2, 4).reshape(n, qmax, hq, d)
            output[token[real]] = out[real].to(output.dtype)
        return output

    @staticmethod
    def _online_softmax(block_scores, num_pages: int, step_pages: int):
        """softmax(scores) @ values over KV blocks of ``step_pages`` pages, merged exactly.

        Keeps a running row maximum ``m``, denominator ``l`` and unnormalised
        output ``acc``; a new block rescales them by ``exp(m_old - m_new)``. Rows
        that see no key at all end as 0/0 = NaN, as one softmax over -inf gives.
        """
        m = l = acc = poisoned = None
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
            if m is None:
                acc, l = block_out, block_sum
            else:
                rescale = torch.exp(torch.where(torch.isinf(m), m, m - shift))
                acc = acc * rescale + block_out
                l = l * rescale + block_sum
            m = m_new
        out = acc / l
        return out if poisoned is None else out.masked_fill(poisoned, float("nan"))


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


class ReferenceInstance:
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions):
        self.meta = meta
        self.options = options
        self.compute_dtype = torch.float64 if options.exact else torch.float32
        self.output_dtype = self.compute_dtype
        self.builder = ReferenceBuilder(meta, self.compute_dtype)
        self.impl = ReferenceImpl(meta, self.compute_dtype)

    def describe(self) -> RunInfo:
        name = "float64" if self.options.exact else "float32"
        notes = ["logical KV gathered through the block table; GQA by head grouping"]
        if self.meta.layer.is_fp8:
            notes.append("FP8 query/K/V dequantised with the q/k/v scales before attention")
        if self.meta.layer.logits_soft_cap:
            cap = self.meta.layer.logits_soft_cap
            notes.append(f"logits soft-capped: {cap:g} * tanh(scale * q.k / {cap:g}) before the mask")
        return RunInfo(backend="reference", kernel=f"exact torch attention ({name} accumulate)",
                       device=self.options.device, dtype=name, notes=notes)

    def findings(self, common: CommonMetadata, metadata: Any) -> list[Finding]:
        return []

    def explain(self, common: CommonMetadata, metadata: ReferenceMetadata) -> list[dict[str, Any]]:
        rows = []
        w = metadata.sliding_window
        for r, (length, q) in enumerate(zip(metadata.seq_lens.tolist(), metadata.query_lens.tolist())):
            first = length - q
            if metadata.causal:
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
    # Soft cap, KV sharing and every layout are modelled; sinks and ALiBi are not.
    capabilities=Capabilities(who="the reference", kv_sharing=True, attn_types=("decoder",)),
    create=lambda meta, options: ReferenceInstance(meta, options),
)
