"""vLLM's FLEX_ATTENTION backend replayed with torch flex_attention over the physical (stored) cache.

Semantics follow current vLLM (v0.33): the physical→logical page map ignores
block-table entries past ``cdiv(L, page_size)``, keeps the highest logical block
when a page appears twice in a request, and resets the null block (engine page
0) to -1 so its tokens are masked. kvdbg reproduces those rules and reports
each entry they touch: an error when it hides a key the mask must show, a note
when it lies before the window (vLLM's sliding-window manager does that by design).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvdbg.backends.base import BackendSpec, Capabilities, CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.errors import OptionError
from kvdbg.snapshot.layout import as_fp8, dequantize_fp8, finite_pages, kv_views
from kvdbg.snapshot.pagemap import hazard_finding, paging_hazards, physical_to_logical
from kvdbg.snapshot.store import live_mask, live_page_counts

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

# vLLM's direct build uses 16-token query blocks on torch >= 2.9 and KV blocks of one page.
Q_BLOCK_SIZE = 16
# Eager flex_attention materialises [Hq, tokens, cache tokens] scores: each eager call covers a run of
# query blocks over only the pages they list, with the run sized to keep those scores within this. With
# the mask function's index tensors (int64, as large as the scores), a call holds about three times it:
# 128 MiB keeps a CPU replay of a 512 MiB capture within 1.5x the file + torch (bench/flex_memory.py).
EAGER_SCORE_BUDGET_BYTES = 128 * 1024 * 1024
# Requests are merged into one eager call while the call scores at most this many elements: fewer
# calls for many tiny requests. A merged call's temporaries are ~50 bytes an element (scores, masked
# scores, probabilities, the mask's index tensors): 2^20 elements keep it near 50 MiB.
EAGER_MERGE_SCORES = 1 << 20
VLLM_KERNEL_BLOCK_MULTIPLE = 16
# Unless --compile/--no-compile says otherwise, a CUDA replay compiles flex only when the eager
# path would score more than this many (query, key, head) elements: compiling costs ~10 s a
# process, eager scores ~0.25e9 elements a second on an H200 (docs/benchmarks.md), so eager wins
# below ~2e9 elements.
COMPILE_ABOVE_SCORES = 1 << 31
# Who evaluates an eager step: "torch" calls torch's flex_attention (its unfused implementation); "kvdbg"
# runs the same operations itself (eager_math). Torch's eager call imports Dynamo, Inductor's IR and
# sympy even when nothing is traced: ~1.5 s of a process with bytecode caches, ~5 s without them on the
# H200 host (docs/benchmarks.md), which a small CUDA replay pays against a 2x-of-`import torch` target;
# kvdbg's evaluation imports nothing more.
# Default: kvdbg on CUDA, torch on CPU; KVDBG_FLEX_EAGER=torch or =kvdbg decides on any device.
FLEX_EAGER_ENV = "KVDBG_FLEX_EAGER"
EAGER_IMPLS = ("torch", "kvdbg")
EAGER_MATH_KERNEL = "flex eager math (kvdbg)"

_compiled_flex: dict[str, Callable] = {}


def _flex_compiled(device_type: str) -> Callable:
    if device_type not in _compiled_flex:
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
                  causal: bool, sliding_window: int | None, q_offset: int = 0, listed_by=None) -> Callable:
    """The paged mask: physical KV index → logical position, then the logical causal/window mask.

    ``q_offset`` shifts query indices for a call that covers only part of the tokens.
    ``listed_by`` = (table, q_block_size, first_block): for eager calls, which ignore
    the BlockMask's page lists, also keep only keys whose page
    ``table[(q_idx + q_offset) // q_block_size - first_block]`` lists -- what the
    compiled kernel reads.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        q_idx = q_idx + q_offset
        req = doc_ids[q_idx]
        logical_block = physical_to_logical[req, kv_idx // page_size]
        logical_k = logical_block * page_size + kv_idx % page_size
        valid = (logical_block >= 0) & (logical_k < seq_lens[req])
        if listed_by is not None:
            table, q_block_size, first_block = listed_by
            valid = valid & table[q_idx // q_block_size - first_block, kv_idx // page_size]
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
        ps, num_pages, device = common.page_size, common.num_pages, common.seq_lens.device
        table = common.block_table.to(torch.int64)
        seq_lens = common.seq_lens.to(torch.int64)
        qsl = common.query_start_loc.to(torch.int64)
        qlens = qsl[1:] - qsl[:-1]
        num_reqs, width = table.shape
        live = live_mask(table, seq_lens, ps) & (table >= 0)
        p2l = physical_to_logical(table, seq_lens, ps, num_pages, common.null_page)
        cols = torch.arange(width, device=device).expand(num_reqs, width)
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
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions, compiled: bool | None,
                 eager_impl: str = "torch"):
        self.meta = meta
        self.options = options
        self.requested = compiled  # True/False as asked; None: chosen per step by size (CUDA only)
        self.eager_impl = eager_impl  # who evaluates an eager step: one of EAGER_IMPLS
        self.reset()

    def reset(self) -> None:
        """Forget what the last forward ran (describe() reports it), as a new impl knows nothing yet."""
        self.compiled = bool(self.requested)  # what the last forward ran
        self.scores = 0  # (query, key, head) elements the eager path scores for the last step
        self.calls = 0  # flex_attention calls the last forward made (eager splits big batches)
        self.compile_cache: tuple[int, int] | None = None  # graphs loaded from / compiled into torch's cache

    def eager_scores(self, md: FlexMetadata) -> int:
        """Score elements eager flex materialises for this step: listed pages x their tokens x heads."""
        listed = int(md.kv_num_blocks.sum())
        return listed * md.q_block_size * md.kv_block_size * self.meta.layer.num_heads

    def forward(self, query, kv_cache, md: FlexMetadata, output):
        layer = self.meta.layer
        model_dtype = getattr(torch, layer.dtype)
        k_pages, v_pages = kv_views(self.meta, kv_cache)
        # vLLM's flex has no FP8 path; dequantising is kvdbg's choice, stated in RunInfo.notes.
        q = as_fp8(query) if layer.is_fp8 else query
        q = dequantize_fp8(q, layer.q_scale, model_dtype) if q.dtype == torch.float8_e4m3fn else q.to(model_dtype)
        tokens = md.num_actual_tokens
        q = q[:tokens].permute(1, 0, 2).unsqueeze(0)  # [1, Hq, T, D]
        self.calls = 0
        if tokens == 0:
            return output
        self.scores = self.eager_scores(md)
        self.compiled = self.requested if self.requested is not None else \
            (q.is_cuda and self.scores > COMPILE_ABOVE_SCORES)
        if self.compiled:
            return self._forward_compiled(q, k_pages, v_pages, md, output)
        return self._forward_eager(q, k_pages, v_pages, md, output)

    def _pages(self, k_pages, v_pages, pages=None):
        """K/V of ``pages`` (all when None) as [1, Hkv, pages*ps, D] in the model dtype (FP8 dequantised)."""
        layer = self.meta.layer
        keys, values = (k_pages, v_pages) if pages is None else (k_pages[pages], v_pages[pages])
        if layer.is_fp8:
            model_dtype = getattr(torch, layer.dtype)
            keys = dequantize_fp8(keys, layer.k_scale, model_dtype)
            values = dequantize_fp8(values, layer.v_scale, model_dtype)
        n, hkv, ps, d = keys.shape
        # [pages, Hkv, ps, D] -> [1, Hkv, pages*ps, D]: token index = page * ps + offset.
        return (keys.permute(1, 0, 2, 3).reshape(1, hkv, n * ps, d),
                values.permute(1, 0, 2, 3).reshape(1, hkv, n * ps, d))

    def _kwargs(self) -> dict:
        layer = self.meta.layer
        return {"scale": float(layer.scale), "enable_gqa": layer.num_heads != layer.num_kv_heads}

    def _forward_compiled(self, q, k_pages, v_pages, md: FlexMetadata, output):
        """One call over the whole physical cache: the compiled kernel skips what the BlockMask leaves out."""
        keys, values = self._pages(k_pages, v_pages)
        kwargs = self._kwargs()
        if q.is_cuda:
            kwargs["kernel_options"] = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": md.q_block_size,
                                        "BLOCK_N": md.kv_block_size}
        before = _compile_cache_counts()
        out = _flex_compiled(q.device.type)(q, keys, values, block_mask=md.block_mask, **kwargs)
        loaded, compiled = (after - first for after, first in zip(_compile_cache_counts(), before))
        if loaded or compiled:
            self.compile_cache = (loaded, compiled)
        self.calls = 1
        output[:md.num_actual_tokens].copy_(out[0].permute(1, 0, 2))
        return output

    def _forward_eager(self, q, k_pages, v_pages, md: FlexMetadata, output):
        """Request chunks, each over a compact cache of only the pages its tokens can read.

        Eager flex scores every (query, key) pair it is given and applies the
        mask_mod; it ignores the BlockMask's page lists. The compiled kernel reads,
        for a token of query block b, the pages b lists, and masks within them. So
        each eager call gets the pages its tokens' blocks list that their own
        requests map (a page no request of the call maps is masked for all of its
        tokens anyway), and the mask_mod also checks that the key's page is listed
        by the token's block: the same keys the kernel admits, in a cache sized by
        the chunk rather than the batch, whatever the chunking. One difference
        stays: a NaN/inf in a listed page poisons the kernel's whole tile
        (0 x NaN), also for tokens that mask it. A chunk whose blocks list such a
        page therefore runs one query block a call over exactly the pages that
        block lists, as the kernel reads them.
        """
        qb = md.q_block_size
        page_finite = finite_pages(k_pages, v_pages)
        finite: dict[int, bool] = {}  # query block -> every page it lists is finite

        def blocks_finite(start: int, stop: int) -> bool:
            for block in range(start // qb, -(-stop // qb)):
                if block not in finite:
                    listed = md.kv_indices[block, :int(md.kv_num_blocks[block])].long()
                    finite[block] = bool(page_finite[listed.to(page_finite.device)].all())
                if not finite[block]:
                    return False
            return True

        for start, stop in self._eager_chunks(md):
            if blocks_finite(start, stop):
                self._eager_call(q, k_pages, v_pages, md, output, start, stop, restrict=True)
                continue
            for block in range(start // qb, -(-stop // qb)):  # poisoned pages: the kernel's tiles
                lo, hi = max(start, block * qb), min(stop, (block + 1) * qb)
                self._eager_call(q, k_pages, v_pages, md, output, lo, hi, restrict=False)
        return output

    def _eager_chunks(self, md: FlexMetadata) -> list[tuple[int, int]]:
        """Token ranges: small requests merged, a request too big for the score budget split."""
        heads, ps = self.meta.layer.num_heads, md.kv_block_size
        qsl = md.query_start_loc.tolist()
        mapped = (md.physical_to_logical >= 0).sum(dim=1).tolist()
        budget = max(1, EAGER_SCORE_BUDGET_BYTES // (4 * 3))  # scores, masked scores, probabilities (fp32)
        chunks: list[tuple[int, int]] = []
        start = keys = 0
        for req in range(len(qsl) - 1):
            lo, hi = qsl[req], qsl[req + 1]
            if hi <= lo:
                continue
            req_keys = max(1, mapped[req]) * ps
            if chunks and start < lo and (hi - start) * (keys + req_keys) * heads <= EAGER_MERGE_SCORES:
                chunks[-1], keys = (start, hi), keys + req_keys  # merge into the chunk before
                continue
            step = max(1, budget // (req_keys * heads))
            for piece in range(lo, hi, step):
                chunks.append((piece, min(hi, piece + step)))
            start, keys = (lo, req_keys) if step >= hi - lo else (hi, 0)
        return chunks

    def _eager_call(self, q, k_pages, v_pages, md: FlexMetadata, output, start: int, stop: int, *,
                    restrict: bool) -> None:
        """Tokens [start, stop) over the pages their query blocks list (``restrict``: and their requests map)."""
        qb, ps = md.q_block_size, md.kv_block_size
        first, last = start // qb, -(-stop // qb)
        counts = md.kv_num_blocks[first:last].to(torch.int64)
        indices = md.kv_indices[first:last].to(torch.int64)
        listed = torch.arange(indices.shape[1], device=indices.device).unsqueeze(0) < counts.unsqueeze(1)
        pages = torch.unique(indices[listed])
        if restrict and pages.numel():
            reqs = md.doc_ids[start:stop]
            rows = md.physical_to_logical[int(reqs.min()):int(reqs.max()) + 1]
            pages = pages[(rows[:, pages] >= 0).any(dim=0)]
        keys, values = self._pages(k_pages, v_pages, pages)
        p2l = md.physical_to_logical[:, pages]
        if pages.numel() == 0:  # rows that list no page still need one key column: a page nothing maps
            keys = keys.new_zeros(1, keys.shape[1], ps, keys.shape[-1])
            values = values.new_zeros(1, values.shape[1], ps, values.shape[-1])
            p2l = md.physical_to_logical.new_full((md.physical_to_logical.shape[0], 1), -1)
        width = p2l.shape[1]
        # listed_by[b, c]: compact page c is in the list of query block first + b.
        compact = torch.full((md.physical_to_logical.shape[1],), width, dtype=torch.int64, device=pages.device)
        compact[pages] = torch.arange(pages.numel(), device=pages.device)
        listed_by = torch.zeros(last - first, width + 1, dtype=torch.bool, device=pages.device)
        listed_by.scatter_(1, torch.where(listed, compact[indices], width), True)
        listed_by = listed_by[:, :width].contiguous()
        paged = make_mask_mod(p2l, md.doc_ids, md.query_start_loc, md.decode_offset, md.seq_lens, ps,
                              md.causal, md.sliding_window, q_offset=start, listed_by=(listed_by, qb, first))
        # GQA: the G query heads of one KV head are laid along the query axis (row g * T + t), so
        # eager flex upcasts K/V once per KV head instead of repeating them G times; the mask
        # does not depend on the head, each score is the same dot product.
        tokens = stop - start
        _, hq, _, d = q.shape
        hkv = keys.shape[1]
        group = hq // hkv
        folded = q[:, :, start:stop].reshape(1, hkv, group * tokens, d)

        def mask_mod(b, h, q_idx, kv_idx):
            return paged(b, h, q_idx % tokens, kv_idx)

        if self.eager_impl == "kvdbg":
            out = eager_math(folded, keys, values, mask_mod, scale=float(self.meta.layer.scale))
        else:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention

            q_blocks = -(-(group * tokens) // qb)
            mask = BlockMask.from_kv_blocks(
                torch.full((1, 1, q_blocks), width, dtype=torch.int32, device=pages.device),
                torch.arange(width, dtype=torch.int32, device=pages.device).expand(1, 1, q_blocks, width).contiguous(),
                BLOCK_SIZE=(qb, ps), mask_mod=mask_mod, seq_lengths=(group * tokens, width * ps),
                compute_q_blocks=False)
            kwargs = dict(self._kwargs(), enable_gqa=False)
            out = _flex_untraced(flex_attention, folded, keys, values, block_mask=mask, **kwargs)
        output[start:stop].copy_(out.reshape(hq, tokens, d).permute(1, 0, 2))
        self.calls += 1


def _compile_cache_counts() -> tuple[int, int]:
    """Graphs torch's on-disk compile caches (AOTAutograd's and Inductor's FX graph cache) have so far
    loaded, and compiled afresh, in this process."""
    from torch._dynamo.utils import counters

    aot, inductor = counters["aot_autograd"], counters["inductor"]
    return (aot["autograd_cache_hit"] + inductor["fxgraph_cache_hit"],
            aot["autograd_cache_miss"] + inductor["fxgraph_cache_miss"])


def _compile_cache_note(loaded: int, compiled: int) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    where = f"torch's on-disk compile cache ({cache_dir()}; TORCHINDUCTOR_CACHE_DIR moves it)"
    if compiled == 0:
        return f"compiled graph loaded from {where}: no Inductor compile in this run"
    return f"{compiled} graph(s) compiled and stored in {where} for later runs; {loaded} loaded from it"


def _flex_untraced(flex_attention: Callable, *args, **kwargs):
    """Eager flex_attention without the Dynamo trace torch wraps around it.

    Called outside ``torch.compile``, flex_attention traces its higher-order op
    with Dynamo's eager backend on every new shape (~0.5-1.5 s a shape on CPU)
    and then runs the op's unfused implementation. Torch's own switch
    ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` calls that implementation directly:
    same op, same arithmetic, no trace. Its caveats concern autograd and
    Python-side effects in score/mask functions, neither of which a replay has
    (forward only, pure index arithmetic). Output stays within a few ulps of the
    traced call (tests/test_flex.py checks it).

    With the switch on, the call still enters ``setup_compilation_env``, whose
    only use there is a backend that the untraced branch never calls, and which
    imports Dynamo's debugging backends for it (AOTAutograd, Inductor's caches,
    networkx: ~0.5 s, a sixth of a small replay). :func:`_untraced_env` stands
    in for it while no torch function mode is active (the other thing it
    handles; a replay sets none).
    """
    import torch.nn.attention.flex_attention as flex_module

    before = getattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    with warnings.catch_warnings():
        # torch warns that eager flex is unfused; RunInfo already says it ran eager.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if before is None:  # a torch without the switch: the traced eager call
            return flex_attention(*args, **kwargs)
        env = getattr(flex_module, "setup_compilation_env", None)
        light = env is not None and torch._C._len_torch_function_stack() == 0
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        if light:
            flex_module.setup_compilation_env = _untraced_env
        try:
            return flex_attention(*args, **kwargs)
        finally:
            flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before
            if light:
                flex_module.setup_compilation_env = env


@contextlib.contextmanager
def _untraced_env():
    """What flex_attention's untraced branch takes from ``setup_compilation_env``: a backend it does not use.

    Torch's context also sets Dynamo's config for a trace and lifts torch function
    modes off the stack; with no trace and no mode (checked by the caller) both
    are no-ops."""
    yield None


def eager_math(query, key, value, mask_mod: Callable, scale: float):
    """flex_attention's unfused eager arithmetic, evaluated here: no flex_attention call, no Dynamo.

    ``query`` [1, H, L, D], ``key``/``value`` [1, H, S, D] (heads already
    matched: the caller folds GQA into the query axis). The operations are the
    ones torch's eager flex_attention runs, in its order and precisions::

        scores = (q.float() @ k.float()^T) * scale          fp32 (fp64 for an fp64 query)
        scores[~mask_mod(b, h, q_idx, kv_idx)] = -inf
        P      = safe_softmax(scores)                       a row that keeps no key: all zeros
        out    = P.to(q.dtype) @ v.to(q.dtype)              probabilities rounded to the model dtype

    Torch evaluates the mask_mod under vmap with Dynamo's index transform; a
    mask_mod written with tensor indexing (kvdbg's are) gives the same mask
    evaluated once over broadcast index grids ``q_idx`` [L, 1], ``kv_idx``
    [1, S]. tests/test_flex.py checks the result against torch's eager call.
    """
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = query.to(work) @ key.to(work).transpose(-2, -1)
    scores = (scores * scale).to(work)
    rows, cols = scores.shape[-2:]
    device = scores.device
    zero = torch.zeros((), dtype=torch.int64, device=device)  # batch and head: the mask does not use them
    keep = mask_mod(zero, zero, torch.arange(rows, device=device).unsqueeze(1),
                    torch.arange(cols, device=device).unsqueeze(0))
    scores = torch.where(keep, scores, torch.tensor(float("-inf"), dtype=work, device=device))
    return _safe_softmax(scores).to(query.dtype) @ value.to(query.dtype)


def _safe_softmax(scores):
    """Softmax over the last axis with rows of only -inf giving zeros (torch's ``_safe_softmax``)."""
    op = getattr(torch, "_safe_softmax", None)
    if op is not None:
        return op(scores, dim=-1)
    empty = (scores == float("-inf")).all(dim=-1, keepdim=True)
    return torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)


def _resolve_eager(options: ReplayOptions) -> str:
    """Who evaluates eager steps: KVDBG_FLEX_EAGER when set, else kvdbg on CUDA and torch on CPU."""
    forced = os.environ.get(FLEX_EAGER_ENV, "").strip().lower()
    if forced:
        if forced not in EAGER_IMPLS:
            raise OptionError(f"{FLEX_EAGER_ENV}={forced!r}: choose {' or '.join(EAGER_IMPLS)}")
        return forced
    return "kvdbg" if options.device.startswith("cuda") else "torch"


def _resolve_compile(options: ReplayOptions) -> bool | None:
    """True/False when asked; on CPU eager (compiled CPU flex costs more than it saves on one step);
    on CUDA None: each step picks by size (FlexImpl.forward)."""
    if options.compile is not None:
        return bool(options.compile)
    return None if options.device.startswith("cuda") else False


class FlexInstance:
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions):
        self.meta = meta
        self.options = options
        self.output_dtype = getattr(torch, meta.layer.dtype)
        self.builder = FlexBuilder(meta, options.flex_q_block or Q_BLOCK_SIZE)
        self.impl = FlexImpl(meta, options, _resolve_compile(options), _resolve_eager(options))

    @property
    def compiled(self) -> bool:
        return self.impl.compiled

    def reset(self) -> None:
        """Before a replay of another snapshot: the builder keeps nothing between builds, the impl forgets."""
        self.impl.reset()

    def describe(self) -> RunInfo:
        layer = self.meta.layer
        mode = "compiled" if self.compiled else "eager"
        notes = [f"BlockMask built directly from the page table (BlockMask.from_kv_blocks), "
                 f"blocks {self.builder.q_block_size} query tokens x {self.meta.backend.page_size} (one page)"]
        if self.impl.requested is None:
            size = f"{self.impl.scores:,} eager score elements" if self.impl.scores else "the step's size"
            notes.append(f"{mode} chosen by size ({size}; compiled above {COMPILE_ABOVE_SCORES:,}); "
                         f"--compile or --no-compile decides instead")
        if self.compiled and self.impl.compile_cache is not None:
            notes.append(_compile_cache_note(*self.impl.compile_cache))
        pages = ("each call over a compact cache of only the pages its query blocks' BlockMask rows list "
                 "(the pages the compiled kernel reads)")
        kernel = f"flex_attention ({mode})"
        if not self.compiled and self.impl.eager_impl == "kvdbg":
            kernel = EAGER_MATH_KERNEL
            notes.append(f"eager: torch's flex_attention not called; kvdbg runs the operations of its unfused "
                         f"implementation (fp32 scores x scale, the mask_mod over index grids, safe softmax, "
                         f"probabilities in {layer.dtype} @ V), which need no Dynamo import, {pages}; "
                         f"{FLEX_EAGER_ENV}=torch calls torch's instead")
        elif not self.compiled:
            notes.append(f"eager flex_attention (torch's unfused implementation, called without a Dynamo trace), "
                         f"{pages}")
        if not self.compiled and self.impl.calls > 1:
            notes.append(f"{self.impl.calls} eager calls (request chunks) to bound memory")
        if layer.is_fp8:
            notes.append(f"FP8 KV cache: vLLM's FLEX_ATTENTION rejects quantized caches; kvdbg dequantises "
                         f"query/K/V with the q/k/v scales to {layer.dtype} and runs flex on that")
        return RunInfo(backend="flex", kernel=kernel, device=self.options.device,
                       dtype=layer.dtype, emulated=False, compiled=self.compiled, notes=notes)

    def findings(self, common: CommonMetadata, md: FlexMetadata) -> list[Finding]:
        out: list[Finding] = []
        ps = common.page_size
        engine = common.block_table_engine.to(torch.int64)
        live = live_mask(engine, common.seq_lens, ps)
        engine_cpu, live_cpu = engine.cpu(), live.cpu()
        seq_lens = common.seq_lens.cpu().tolist()
        query_lens = common.query_lens.cpu().tolist()
        for r in range(common.num_reqs):
            live_ids = engine_cpu[r][live_cpu[r]].tolist()
            for h in paging_hazards(live_ids, seq_lens[r], query_lens[r], ps, common.sliding_window):
                out.append(hazard_finding(r, h, ps, seq_lens[r], backend="flex", step=common.step))
        if common.page_size % VLLM_KERNEL_BLOCK_MULTIPLE:
            out.append(Finding(
                backend="flex", code="page_size_unsupported", context="flex", step=common.step,
                message=(f"page_size {common.page_size} is not a multiple of {VLLM_KERNEL_BLOCK_MULTIPLE}, "
                         f"which vLLM's FLEX_ATTENTION requires; torch flex runs it here anyway")))
        if self.meta.layer.is_fp8:
            out.append(Finding(
                backend="flex", code="fp8_dequantised", step=common.step,
                message="FP8 KV cache: vLLM's FLEX_ATTENTION refuses quantized caches; replayed on dequantised "
                        "values, so this column shows what flex would compute, not what vLLM runs"))
        return out

    def explain(self, common: CommonMetadata, md: FlexMetadata) -> list[dict[str, Any]]:
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
        return rows


def _cols(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _environment(meta: "SnapshotMeta") -> str | None:
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
    # vLLM 0.33's FLEX_ATTENTION refuses sinks, ALiBi, soft cap and KV sharing; FP8 is dequantised by kvdbg.
    # This column re-implements its paged decoder path: vLLM runs encoder-only layers through another one, on
    # the step's own Q/K/V without the cache, so they are not replayed here (the reference replays them).
    capabilities=Capabilities(who="vLLM's FLEX_ATTENTION", soft_cap=False),
    environment_reason=_environment,
    create=lambda meta, options: FlexInstance(meta, options),
)
