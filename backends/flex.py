"""vLLM's FLEX_ATTENTION backend replayed with torch flex_attention over the physical (stored) cache.

Semantics follow current vLLM (v0.33): the physical→logical page map ignores
block-table entries past ``cdiv(L, page_size)``, keeps the highest logical block
when a page appears twice in a request, and resets the null block (engine page
0) to -1 so its tokens are masked. kvdbg reproduces those rules and reports
each entry they touch: an error when it hides a key the mask must show, a note
when it lies before the window (vLLM's sliding-window manager does that by design).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kvdbg.attention import BackendSpec, CommonMetadata, Finding, ReplayOptions, RunInfo

if TYPE_CHECKING:
    import torch

    from kvdbg.format import SnapshotMeta

# vLLM's direct build uses 16-token query blocks on torch >= 2.9 and KV blocks of one page.
Q_BLOCK_SIZE = 16
# Eager flex_attention materialises [Hq, tokens, cache tokens] scores; above this we split the
# query tokens into independent calls (rows are computed independently, so results do not change).
EAGER_SCORE_BUDGET_BYTES = 512 * 1024 * 1024
VLLM_KERNEL_BLOCK_MULTIPLE = 16

_compiled_flex: dict[str, Callable] = {}


def _flex_compiled(device_type: str) -> Callable:
    if device_type not in _compiled_flex:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        # On CPU, inductor's dynamic-shape flex kernel fails to build once a second shape
        # triggers automatic dynamic (C++ compile error, torch 2.13); static shapes recompile fine.
        dynamic = None if device_type == "cuda" else False
        _compiled_flex[device_type] = torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)
    return _compiled_flex[device_type]


@dataclass
class FlexMetadata:
    """What FlexBuilder derives for one step (passive: no work happens here)."""

    num_actual_tokens: int
    total_cache_tokens: int  # stored pages * page_size: the flattened physical KV length
    page_size: int
    causal: bool
    sliding_window: int | None
    physical_to_logical: "torch.Tensor"  # [num_reqs, num_pages] logical block of each stored page, -1 unmapped
    seq_lens: "torch.Tensor"  # [num_reqs] int64
    query_start_loc: "torch.Tensor"  # [num_reqs + 1] int64
    decode_offset: "torch.Tensor"  # [num_reqs] L - q: absolute position of each request's first query token
    doc_ids: "torch.Tensor"  # [num_tokens] request of each query token
    kv_num_blocks: "torch.Tensor"  # [num_q_blocks] int32 KV blocks (pages) each query block visits
    kv_indices: "torch.Tensor"  # [num_q_blocks, width] int32 stored page indices, first kv_num_blocks valid
    q_block_size: int
    kv_block_size: int
    lost_blocks: "torch.Tensor"  # [num_reqs, width] live logical blocks the map does not point back to
    mask_mod: Callable
    block_mask: Any  # torch BlockMask over (num_actual_tokens, total_cache_tokens)


def make_mask_mod(physical_to_logical, doc_ids, query_start_loc, decode_offset, seq_lens, page_size: int,
                  causal: bool, sliding_window: int | None, q_offset: int = 0) -> Callable:
    """The paged mask: physical KV index → logical position, then the logical causal/window mask.

    ``q_offset`` shifts query indices for a call that covers only part of the tokens.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        q_idx = q_idx + q_offset
        req = doc_ids[q_idx]
        logical_block = physical_to_logical[req, kv_idx // page_size]
        logical_k = logical_block * page_size + kv_idx % page_size
        valid = (logical_block >= 0) & (logical_k < seq_lens[req])
        logical_q = q_idx - query_start_loc[req] + decode_offset[req]
        keep = (logical_q >= logical_k) if causal else (logical_q >= 0)
        if sliding_window is not None:
            keep = keep & ((logical_q - logical_k).abs() < sliding_window)
        return valid & keep

    return mask_mod


class FlexBuilder:
    def __init__(self, meta: "SnapshotMeta", q_block_size: int = Q_BLOCK_SIZE):
        self.meta = meta
        self.q_block_size = q_block_size

    def build(self, common: CommonMetadata) -> FlexMetadata:
        import torch

        from kvdbg.snapshot import live_mask

        ps, num_pages, device = common.page_size, common.num_pages, common.seq_lens.device
        table = common.block_table.to(torch.int64)
        seq_lens = common.seq_lens.to(torch.int64)
        qsl = common.query_start_loc.to(torch.int64)
        qlens = qsl[1:] - qsl[:-1]
        num_reqs, width = table.shape
        live = live_mask(table, seq_lens, ps) & (table >= 0)

        # Inverse map; non-live entries go to a scratch column that is dropped, like vLLM's
        # masking of entries past cdiv(L, page_size). amax: a page listed twice keeps its last block.
        cols = torch.arange(width, device=device).expand(num_reqs, width)
        p2l = torch.full((num_reqs, num_pages + 1), -1, dtype=torch.int64, device=device)
        p2l.scatter_reduce_(1, torch.where(live, table, num_pages), torch.where(live, cols, -1), reduce="amax")
        p2l = p2l[:, :num_pages].contiguous()
        if common.null_page is not None:
            p2l[:, common.null_page] = -1
        mapped_back = p2l.gather(1, table.clamp(0, max(num_pages - 1, 0))) if num_pages else table
        lost = live & (mapped_back != cols)

        doc_ids = torch.repeat_interleave(torch.arange(num_reqs, device=device), qlens)
        decode_offset = seq_lens - qlens
        mask_mod = make_mask_mod(p2l, doc_ids, qsl, decode_offset, seq_lens, ps, common.causal,
                                 common.sliding_window)
        kv_num_blocks, kv_indices = self._kv_blocks(common, table, doc_ids, qsl, decode_offset)
        from torch.nn.attention.flex_attention import BlockMask

        block_mask = BlockMask.from_kv_blocks(
            kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=(self.q_block_size, ps),
            mask_mod=mask_mod, seq_lengths=(common.num_actual_tokens, num_pages * ps), compute_q_blocks=False)
        return FlexMetadata(
            num_actual_tokens=common.num_actual_tokens, total_cache_tokens=num_pages * ps, page_size=ps,
            causal=common.causal, sliding_window=common.sliding_window, physical_to_logical=p2l,
            seq_lens=seq_lens, query_start_loc=qsl, decode_offset=decode_offset, doc_ids=doc_ids,
            kv_num_blocks=kv_num_blocks, kv_indices=kv_indices, q_block_size=self.q_block_size,
            kv_block_size=ps, lost_blocks=lost, mask_mod=mask_mod, block_mask=block_mask)

    def _kv_blocks(self, common, table, doc_ids, qsl, decode_offset):
        """Per query block, the distinct stored pages its tokens' requests may read (vLLM's direct build).

        Like vLLM, every token fetches its request's first cdiv(max_seq_len, page_size) table entries
        (over-fetching for short requests; mask_mod masks the excess), the window drops blocks wholly
        before it, and the null page is never listed.
        """
        import torch

        ps, num_pages, qb = common.page_size, common.num_pages, self.q_block_size
        device = table.device
        tokens = doc_ids.numel()
        num_q_blocks = max(1, -(-tokens // qb))
        span = min(table.shape[1], -(-common.max_seq_len // ps))
        used = table[doc_ids, :span] if tokens else table.new_zeros(0, span)
        skip = used < 0
        if common.null_page is not None:
            skip |= used == common.null_page
        if common.sliding_window is not None and tokens:
            logical_q = torch.arange(tokens, device=device) - qsl[doc_ids] + decode_offset[doc_ids]
            first_block = (logical_q - (common.sliding_window - 1)).clamp_min(0) // ps
            skip |= torch.arange(span, device=device).unsqueeze(0) < first_block.unsqueeze(1)
        # Value 0 means "nothing here"; real pages are shifted by one.
        values = torch.where(skip, torch.zeros_like(used), used + 1)
        padded = values.new_zeros(num_q_blocks * qb, span)
        padded[:tokens] = values
        rows = padded.reshape(num_q_blocks, qb * span)
        never = rows.shape[1] + 1
        first_seen = torch.full((num_q_blocks, num_pages + 1), never, dtype=torch.int64, device=device)
        positions = torch.arange(rows.shape[1], device=device).expand_as(rows)
        first_seen.scatter_reduce_(1, rows, positions, reduce="amin")
        first_seen[:, 0] = never
        counts = (first_seen < never).sum(1)
        # torch's CPU flex kernel takes the BlockMask's KV extent from kv_indices' width and asserts
        # it covers the whole cache, so the width is the page count rather than the longest row.
        width = max(1, num_pages)
        # Pages ordered by where they first appear, matching vLLM's first-occurrence order.
        order = torch.argsort(first_seen, dim=1, stable=True)[:, :width]
        present = torch.arange(width, device=device).unsqueeze(0) < counts.unsqueeze(1)
        kv_indices = torch.where(present, order - 1, torch.zeros_like(order))
        return counts.to(torch.int32), kv_indices.to(torch.int32)


class FlexImpl:
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions, compiled: bool):
        self.meta = meta
        self.options = options
        self.compiled = compiled
        self.calls = 0  # flex_attention calls the last forward made (eager splits big batches)

    def forward(self, query, kv_cache, md: FlexMetadata, output):
        import torch
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        from kvdbg.replay import kv_views

        layer = self.meta.layer
        model_dtype = getattr(torch, layer.dtype)
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        k_pages, v_pages = kv_views(self.meta, kv_cache)
        if layer.is_fp8:
            # vLLM's flex has no FP8 path; dequantising is kvdbg's choice, stated in RunInfo.notes.
            q = query.view(torch.float8_e4m3fn) if query.dtype == torch.uint8 else query
            q = (q.float() * layer.q_scale).to(model_dtype) if q.dtype == torch.float8_e4m3fn else q.to(model_dtype)
            keys = (k_pages.float() * layer.k_scale).to(model_dtype)
            values = (v_pages.float() * layer.v_scale).to(model_dtype)
        else:
            q, keys, values = query.to(model_dtype), k_pages, v_pages
        # [pages, Hkv, ps, D] -> [1, Hkv, pages*ps, D]: physical token index = page * ps + offset.
        keys = keys.permute(1, 0, 2, 3).reshape(1, hkv, md.total_cache_tokens, d)
        values = values.permute(1, 0, 2, 3).reshape(1, hkv, md.total_cache_tokens, d)
        tokens = md.num_actual_tokens
        q = q[:tokens].permute(1, 0, 2).unsqueeze(0)  # [1, Hq, T, D]
        gqa = hq != hkv
        kwargs = {"scale": float(layer.scale), "enable_gqa": gqa}
        self.calls = 0
        if tokens == 0:
            return output
        if self.compiled:
            if q.is_cuda:
                kwargs["kernel_options"] = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": md.q_block_size,
                                            "BLOCK_N": md.kv_block_size}
            out = _flex_compiled(q.device.type)(q, keys, values, block_mask=md.block_mask, **kwargs)
            self.calls = 1
            output[:tokens].copy_(out[0].permute(1, 0, 2))
            return output
        per_token = hq * md.total_cache_tokens * 4 * 3
        step = max(md.q_block_size, EAGER_SCORE_BUDGET_BYTES // max(per_token, 1) // md.q_block_size * md.q_block_size)
        poisoned = _PoisonedPages.find(keys, values, md, kv_cache)
        if poisoned is not None:
            step = md.q_block_size  # one query block a call: each loads only its own listed pages
            keys, values = poisoned.keys, poisoned.values
        for start in range(0, tokens, step):
            stop = min(tokens, start + step)
            if poisoned is not None:
                poisoned.load_for_block(start // md.q_block_size)
            if start == 0 and stop == tokens:
                mask = md.block_mask
            else:
                first, last = start // md.q_block_size, -(-stop // md.q_block_size)
                part_mod = make_mask_mod(md.physical_to_logical, md.doc_ids, md.query_start_loc, md.decode_offset,
                                         md.seq_lens, md.page_size, md.causal, md.sliding_window, q_offset=start)
                mask = BlockMask.from_kv_blocks(
                    md.kv_num_blocks[first:last][None, None], md.kv_indices[first:last][None, None],
                    BLOCK_SIZE=(md.q_block_size, md.kv_block_size), mask_mod=part_mod,
                    seq_lengths=(stop - start, md.total_cache_tokens), compute_q_blocks=False)
            with warnings.catch_warnings():
                # torch warns that eager flex is unfused; RunInfo already says it ran eager.
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                out = flex_attention(q[:, :, start:stop], keys, values, block_mask=mask, **kwargs)
            output[start:stop].copy_(out[0].permute(1, 0, 2))
            self.calls += 1
        return output


class _PoisonedPages:
    """Eager flex over a cache whose pages hold NaN/inf: only the pages a query block lists are loaded.

    The compiled kernel reads only the KV blocks its BlockMask lists for a query
    block; a NaN in a listed page poisons that block's rows (0 x NaN), a NaN
    elsewhere is never read. Eager flex computes every (query, cache token) pair,
    so a NaN anywhere in the cache would reach every row through a zero
    probability. To give the kernel's answer, non-finite pages are zeroed in a
    private copy, and each call (one query block) restores the ones it lists.
    """

    def __init__(self, keys, values, bad, page_size: int, md: FlexMetadata):
        self.keys, self.values, self.md = keys, values, md
        self.bad = bad  # stored page indices holding a non-finite K or V value
        shape = (keys.shape[0], keys.shape[1], -1, page_size, keys.shape[-1])
        self.k5, self.v5 = keys.view(shape), values.view(shape)
        self.raw_k, self.raw_v = self.k5[:, :, bad].clone(), self.v5[:, :, bad].clone()
        self.k5[:, :, bad] = 0
        self.v5[:, :, bad] = 0
        self.loaded = bad[:0]

    @classmethod
    def find(cls, keys, values, md: FlexMetadata, kv_cache) -> "_PoisonedPages | None":
        import torch

        ps = md.kv_block_size
        per_page = lambda t: torch.isfinite(t).view(t.shape[0], t.shape[1], -1, ps, t.shape[-1]).all(4).all(3) \
            .all(1).all(0)  # noqa: E731
        bad = (~(per_page(keys) & per_page(values))).nonzero().flatten()
        if bad.numel() == 0:
            return None
        # Never zero the working cache itself: the flattened views are copies unless the layout made them views.
        shares = lambda t: t.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()  # noqa: E731
        keys = keys.clone() if shares(keys) else keys
        values = values.clone() if shares(values) else values
        return cls(keys, values, bad, ps, md)

    def load_for_block(self, block: int) -> None:
        import torch

        count = int(self.md.kv_num_blocks[block])
        listed = self.md.kv_indices[block, :count].to(self.bad.device, torch.int64)
        wanted = torch.isin(self.bad, listed)
        self.k5[:, :, self.loaded] = 0  # the previous block's pages go back to zero
        self.v5[:, :, self.loaded] = 0
        self.loaded = self.bad[wanted]
        self.k5[:, :, self.loaded] = self.raw_k[:, :, wanted]
        self.v5[:, :, self.loaded] = self.raw_v[:, :, wanted]


def _resolve_compile(options: ReplayOptions) -> bool:
    if options.compile is not None:
        return bool(options.compile)
    return options.device.startswith("cuda")


class FlexInstance:
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions):
        import torch

        self.meta = meta
        self.options = options
        self.compiled = _resolve_compile(options)
        self.output_dtype = getattr(torch, meta.layer.dtype)
        self.builder = FlexBuilder(meta)
        self.impl = FlexImpl(meta, options, self.compiled)

    def describe(self) -> RunInfo:
        layer = self.meta.layer
        mode = "compiled" if self.compiled else "eager"
        notes = [f"BlockMask built directly from the page table (BlockMask.from_kv_blocks), "
                 f"blocks {Q_BLOCK_SIZE} query tokens x {self.meta.backend.page_size} (one page)"]
        if not self.compiled:
            notes.append("eager flex_attention evaluates mask_mod over every (query, cache token) pair; "
                         "only the compiled kernel skips the blocks the BlockMask leaves out")
            if self.impl.calls > 1:
                notes.append(f"query tokens split into {self.impl.calls} eager calls to bound memory")
        if layer.is_fp8:
            notes.append(f"FP8 KV cache: vLLM's FLEX_ATTENTION rejects quantized caches; kvdbg dequantises "
                         f"query/K/V with the q/k/v scales to {layer.dtype} and runs flex on that")
        return RunInfo(backend="flex", kernel=f"flex_attention ({mode})", device=self.options.device,
                       dtype=layer.dtype, emulated=False, compiled=self.compiled, notes=notes)

    def findings(self, common: CommonMetadata, md: FlexMetadata) -> list[Finding]:
        import torch

        from kvdbg.pagemap import hazard_message, paging_hazards
        from kvdbg.snapshot import live_mask

        out: list[Finding] = []
        ps = common.page_size
        engine = common.block_table_engine.to(torch.int64)
        live = live_mask(engine, common.seq_lens, ps)
        engine_cpu, live_cpu = engine.cpu(), live.cpu()
        seq_lens = common.seq_lens.cpu().tolist()
        query_lens = common.query_lens.cpu().tolist()
        codes = {("null_block", True): "null_page_masked", ("null_block", False): "null_block_outside_window",
                 ("aliased", True): "page_mapped_twice", ("aliased", False): "page_reused_outside_window"}
        for r in range(common.num_reqs):
            live_ids = engine_cpu[r][live_cpu[r]].tolist()
            for h in paging_hazards(live_ids, seq_lens[r], query_lens[r], ps, common.sliding_window):
                out.append(Finding(
                    backend="flex", code=codes[(h.kind, h.hidden_keys > 0)], severity=h.severity,
                    step=common.step, request=r, message=hazard_message(r, h, ps, seq_lens[r]),
                    details={"page": h.page, "logical_blocks": list(h.blocks), "masked_blocks": list(h.dropped),
                             "kept": h.kept, "hidden_keys": h.hidden_keys, "first_visible_key": h.first_visible}))
        if common.page_size % VLLM_KERNEL_BLOCK_MULTIPLE:
            out.append(Finding(
                backend="flex", code="page_size_unsupported", severity="warning", step=common.step,
                message=(f"page_size {common.page_size} is not a multiple of {VLLM_KERNEL_BLOCK_MULTIPLE}, "
                         f"which vLLM's FLEX_ATTENTION requires; torch flex runs it here anyway")))
        if self.meta.layer.is_fp8:
            out.append(Finding(
                backend="flex", code="fp8_dequantised", severity="warning", step=common.step,
                message="FP8 KV cache: vLLM's FLEX_ATTENTION refuses quantized caches; replayed on dequantised "
                        "values, so this column shows what flex would compute, not what vLLM runs"))
        return out

    def explain(self, common: CommonMetadata, md: FlexMetadata) -> list[dict[str, Any]]:
        import torch

        from kvdbg.snapshot import live_page_counts

        ps = common.page_size
        mapped = (md.physical_to_logical >= 0).sum(1).tolist()
        live_pages = live_page_counts(common.seq_lens, ps).tolist()
        lost = md.lost_blocks.sum(1).tolist()
        # Query blocks overlapping each request, to show how many KV blocks its tokens visit.
        qsl = md.query_start_loc.tolist()
        kv_counts = md.kv_num_blocks.tolist()
        rows = []
        for r in range(common.num_reqs):
            first_block, last_block = qsl[r] // md.q_block_size, max(qsl[r], qsl[r + 1] - 1) // md.q_block_size
            visited = max(kv_counts[first_block:last_block + 1] or [0]) if qsl[r + 1] > qsl[r] else 0
            rows.append({
                "request": r,
                "seq_len": int(md.seq_lens[r]),
                "query_len": qsl[r + 1] - qsl[r],
                "decode_offset": int(md.decode_offset[r]),
                "live_pages": live_pages[r],
                "mapped_pages": mapped[r],
                "lost_blocks": lost[r],
                "kv_blocks_visited": visited,
            })
        del torch
        return rows


def _cols(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _unsupported(meta: "SnapshotMeta") -> str | None:
    layer = meta.layer
    if layer.has_sinks:
        return "vLLM's FLEX_ATTENTION does not support attention sinks"
    if layer.has_alibi:
        return "vLLM's FLEX_ATTENTION does not support ALiBi slopes"
    if layer.logits_soft_cap:
        return "vLLM's FLEX_ATTENTION does not support logits soft-capping"
    if layer.kv_sharing_target:
        return "vLLM's FLEX_ATTENTION does not support KV sharing between layers"
    if layer.attn_type != "decoder":
        return f"kvdbg replays FLEX_ATTENTION's paged decoder path only, not attn_type {layer.attn_type!r}"
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return "this torch has no torch.nn.attention.flex_attention"
    if not hasattr(BlockMask, "from_kv_blocks"):
        return "this torch's BlockMask has no from_kv_blocks (needs torch >= 2.5)"
    return None


BACKEND = BackendSpec(
    name="flex",
    engine_name="FLEX_ATTENTION",
    summary="torch flex_attention over the physical cache with vLLM's paged mask_mod",
    unsupported_reason=_unsupported,
    create=lambda meta, options: FlexInstance(meta, options),
)
