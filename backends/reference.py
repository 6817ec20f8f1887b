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
from kvdbg.cache import as_fp8, dequantize_fp8, kv_views

if TYPE_CHECKING:
    from kvdbg.format import SnapshotMeta

# Bytes of gathered K/V + scores one chunk may hold. Requests are grouped up to it,
# and a request too long for it alone is cut along its KV length into blocks merged
# by an exact log-sum-exp (online softmax), so neither a long batch nor a hostile
# table repeating one page thousands of times can make the reference allocate more.
CHUNK_BUDGET_BYTES = 256 * 1024 * 1024


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
        budget = CHUNK_BUDGET_BYTES // bytes_per  # elements
        # Sorting by length makes each chunk pad to a length close to its members'.
        order = torch.argsort(pages, stable=True).cpu()
        pages_cpu = pages.cpu().tolist()
        qlens_cpu = query_lens.cpu().tolist()

        def per_token(q_len: int) -> int:  # gathered K and V, plus scores and probabilities
            return 2 * layer.num_kv_heads * layer.head_size + 2 * layer.num_heads * q_len

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
        k_pages, v_pages = kv_views(self.meta, kv_cache)
        fp8 = layer.is_fp8
        query = as_fp8(query) if fp8 else query
        fp8_query = query.dtype == torch.float8_e4m3fn
        device = query.device
        soft_cap = float(layer.logits_soft_cap or 0.0)

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
            q = q.reshape(n, qmax, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, group * qmax, d)
            pos = (seq_lens - qlens).unsqueeze(1) + offsets.unsqueeze(0)  # p = L - q + i, [n, qmax]

            def block_scores(first_page: int, last_page: int):
                """Masked scores [n, Hkv, G*qmax, keys] and values of pages [first_page, last_page)."""
                kv_len = (last_page - first_page) * ps
                # Entries past a request's live pages may be -1 (not stored) or stale; they are masked by k < L.
                table = md.block_table[reqs, first_page:last_page].clamp_min(0)
                if fp8:  # [n, pages, Hkv, ps, D]
                    keys = dequantize_fp8(k_pages[table], layer.k_scale, dt)
                    values = dequantize_fp8(v_pages[table], layer.v_scale, dt)
                else:
                    keys, values = k_pages[table].to(dt), v_pages[table].to(dt)
                keys = keys.permute(0, 2, 1, 3, 4).reshape(n, hkv, kv_len, d)
                values = values.permute(0, 2, 1, 3, 4).reshape(n, hkv, kv_len, d)
                scores = torch.matmul(q, keys.transpose(-1, -2)) * layer.scale  # [n, Hkv, G*qmax, kv_len]
                del keys
                if soft_cap:
                    scores = torch.tanh(scores / soft_cap) * soft_cap
                k = torch.arange(first_page * ps, last_page * ps, device=device).view(1, 1, kv_len)
                p = pos.unsqueeze(2)
                allowed = (k <= p) if md.causal else (k < seq_lens.view(n, 1, 1))
                if md.sliding_window is not None:
                    allowed = allowed & ((p - k).abs() < md.sliding_window)
                allowed = allowed & real.unsqueeze(2)
                scores = scores.view(n, hkv, group, qmax, kv_len)
                scores = scores.masked_fill(~allowed.view(n, 1, 1, qmax, kv_len), float("-inf"))
                return scores.view(n, hkv, group * qmax, kv_len), _masked_values(values, allowed, group)

            if step_pages >= num_pages:
                scores, (values, poisoned) = block_scores(0, num_pages)
                probs = torch.softmax(scores, dim=-1)
                del scores
                out = torch.matmul(probs, values)
                if poisoned is not None:
                    out = out.masked_fill(poisoned, float("nan"))
            else:
                out = self._online_softmax(block_scores, num_pages, step_pages)
            out = out.view(n, hkv, group, qmax, d).permute(0, 3, 1, 2, 4).reshape(n, qmax, hq, d)
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


def _masked_values(values, allowed, group: int):
    """(values with non-finite entries zeroed, [n, Hkv, G*q, D] mask of outputs they make NaN) or (values, None).

    ``probs @ values`` would turn a NaN value under a zero probability (a key
    outside the token's window) into NaN: 0 x NaN = NaN. The exact answer is that
    such a key contributes nothing, while a NaN a token does see makes its output
    NaN in that channel. The check is one reduction; only a poisoned cache pays
    for the extra product.
    """
    # One fp32 sum is finite for every finite cache (its values are far below fp32's range); only a
    # poisoned block pays for the element-wise check.
    if bool(torch.isfinite(values.sum(dtype=torch.float32))):
        return values, None
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return values, None
    n, hkv, kv_len, d = values.shape
    qmax = allowed.shape[1]
    seen = allowed.to(values.dtype).view(n, 1, qmax, kv_len)
    hits = torch.matmul(seen, bad.to(values.dtype)) > 0  # [n, Hkv, qmax, D]
    poisoned = hits.unsqueeze(2).expand(n, hkv, group, qmax, d).reshape(n, hkv, group * qmax, d)
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
