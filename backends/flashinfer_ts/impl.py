"""vLLM's FlashInferTSImpl: the real kernel's run(), or its contract emulated in torch (or Triton), and the
K/V view and per-request rules that decide what the kernel computes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from kvdbg.backends.base import Finding
from kvdbg.snapshot.layout import FP8_MAX, as_fp8, quantize_fp8, split_kv
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.ts.window import cdiv
from kvdbg.ts.planner import DecodeProfile, window_first_tiles
from kvdbg.ts.contract import FP8_P_STREAMS, FP8_P_TILE, STRICTEST, ApiGeneration, check_kv_views
from kvdbg.backends.flashinfer_ts.builder import FlashInferTSBuilder, FlashInferTSMetadata

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

# On CUDA the Triton emulation runs a step that may read more K/V than this, or has more requests than
# TRITON_ABOVE_REQUESTS; a smaller one runs the torch loop (FlashInferTSImpl._emulator says why).
TRITON_ABOVE_BYTES = 64 << 20
TRITON_ABOVE_REQUESTS = 256
# The FP8 kernel scales unnormalised probabilities by 448 (e4m3's largest finite value) and rounds them to
# e4m3 before the P.V product (fmha_decode helpers_softmax). It streams keys in tiles of FP8_P_TILE through
# one or two K/V instances, each with its own running max, merged at the end; how many depends on the
# profile the planner picks (kvdbg.ts.planner). kvdbg models that at split count 1.
FP8_P_SCALE = FP8_MAX
FP8_P_CAVEAT = ("P rounded to e4m3 at 448x per 128-key tile against its K/V instance's running max, with the "
                "planner's profile (one instance for a Keeps tile at head_dim 192/256, else two, tiles dealt in "
                "turn from the first one the window keeps), modelled at split count 1 for a B200; the real "
                "planner may split the keys further (its choice depends on batch and GPU), which moves where P "
                "is rounded: each P stays within half an e4m3 step (1/16 relative) of exact either way")


# --------------------------------------------------------------------------- the kernel contract in torch


def emulate_decode(
    q: "torch.Tensor",
    k_cache: "torch.Tensor",
    v_cache: "torch.Tensor",
    seq_lens: "torch.Tensor",
    block_tables: "torch.Tensor",
    *,
    mask_type: str,
    window_left: int,
    bmm1_scale: float,
    bmm2_scale: float,
    out: "torch.Tensor",
    requests: list[int] | None = None,
    key_mask: Callable[[int], "torch.Tensor"] | None = None,
    fp8_p: bool | None = None,
    fp8_profile: DecodeProfile | None = None,
) -> "torch.Tensor":
    """prims_ts paged decode by its documented contract, in fp32.

    ``q`` [B, SQ, Hq, D]; K/V caches [pages, Hkv, page_size, D] (any strides);
    ``out`` [B, SQ, Hq, D] in the kernel's output dtype. Request ``b`` gathers
    ``cdiv(seq_lens[b], page_size)`` pages through ``block_tables[b]``. "dense"
    sees every key below seq_len; "causal" is bottom-right aligned (row i sees
    keys ``[0, L - SQ + i]``) and ``window_left >= 0`` keeps only the last
    ``window_left + 1`` of those. Logits are scaled by ``bmm1_scale`` and the
    normalised output by ``bmm2_scale``. Only ``requests`` are written (default
    all); a row that sees no key is left as it was. ``key_mask(b)`` -> [SQ, L]
    bool can hide further keys (tests use it to take out the restriction's extras).
    A dense row sees all ``seq_len`` keys even when ``seq_len < SQ``.

    ``fp8_p`` (default: when q and K are FP8) models the FP8 kernel's P
    rounding, see :func:`fp8_rounded_attention`, with the K/V instances and
    query tokens per CTA of ``fp8_profile`` (default: two instances, one token);
    otherwise P stays fp32.
    """
    if fp8_p is None:
        fp8_p = q.dtype == torch.float8_e4m3fn and k_cache.dtype == torch.float8_e4m3fn
    instances = fp8_profile.kv_instances if fp8_profile is not None else FP8_P_STREAMS
    tokens_per_cta = fp8_profile.q_tokens_per_cta if fp8_profile is not None else 1

    batch, sq, hq, d = q.shape
    hkv, page_size = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    for b in (range(batch) if requests is None else requests):
        length = int(seq_lens[b])
        if length <= 0:
            continue
        pages = block_tables[b, : cdiv(length, page_size)].to(torch.int64)
        keys = k_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        values = v_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        query = q[b].float().reshape(sq, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, SQ, D]
        scores = torch.matmul(query, keys.unsqueeze(1).transpose(-1, -2)) * bmm1_scale  # [Hkv, G, SQ, L]
        key_pos = torch.arange(length, device=q.device).unsqueeze(0)
        if mask_type == "causal":
            last = (length - sq + torch.arange(sq, device=q.device)).unsqueeze(1)
            allowed = key_pos <= last
            if window_left >= 0:
                allowed = allowed & (key_pos >= last - window_left)
        else:
            allowed = torch.ones(sq, length, dtype=torch.bool, device=q.device)
        if key_mask is not None:
            allowed = allowed & key_mask(b).to(q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if fp8_p:
            first = window_first_tiles(seq_len=length, query_len=sq, q_tokens_per_cta=tokens_per_cta,
                                       window_left=window_left if mask_type == "causal" else -1)
            result = fp8_rounded_attention(scores, values.unsqueeze(1), instances=instances,
                                           first_tile=torch.tensor(first, device=q.device)) * bmm2_scale
        else:
            probs = torch.softmax(scores, dim=-1)
            result = torch.matmul(probs, values.unsqueeze(1)) * bmm2_scale  # [Hkv, G, SQ, D]
        result = result.permute(2, 0, 1, 3).reshape(sq, hq, d)
        seen = allowed.any(dim=1)
        out[b, seen] = result[seen].to(out.dtype)
    return out


def fp8_rounded_attention(scores: "torch.Tensor", values: "torch.Tensor", *, instances: int = FP8_P_STREAMS,
                          first_tile: "torch.Tensor | None" = None) -> "torch.Tensor":
    """softmax(scores) @ values with P rounded as prims_ts's FP8 path rounds it, at split count 1.

    ``scores`` [..., SQ, L] fp32, already scaled, -inf where masked; ``values``
    [..., L, D]. Keys go in tiles of 128. The kernel skips whole tiles before a
    CTA's window and deals the rest in turn to its ``instances`` K/V instances:
    for query row ``i``, tile ``t`` belongs to instance ``(t - first_tile[i]) %
    instances`` (``first_tile`` [SQ], default 0) and is exponentiated against
    ``m_t``, that instance's running max after it. Its unnormalised P, times
    448, is rounded to e4m3 for the P.V product, while the softmax sum adds the
    unrounded values. Rescaling every tile to the overall max ``M`` is exactly
    what the online merge does::

        out = sum_t e^(m_t - M) * e4m3(448 e^(s_t - m_t)) @ V_t
              / sum_t e^(m_t - M) * sum(448 e^(s_t - m_t))

    Rows that see no key come back NaN.
    """
    length, sq = scores.shape[-1], scores.shape[-2]
    tiles = -(-length // FP8_P_TILE)
    padded = torch.nn.functional.pad(scores, (0, tiles * FP8_P_TILE - length), value=float("-inf"))
    tiled = padded.unflatten(-1, (tiles, FP8_P_TILE))  # [..., SQ, T, 128]
    tile_max = tiled.amax(-1)  # [..., SQ, T]
    first = torch.zeros(sq, dtype=torch.int64, device=scores.device) if first_tile is None else first_tile
    # Tiles before a row's first tile are masked for it: whichever instance they fall to, they stay -inf.
    owner = torch.remainder(torch.arange(tiles, device=scores.device).unsqueeze(0) - first.view(sq, 1), instances)
    running = torch.full_like(tile_max, float("-inf"))
    for instance in range(instances):
        own = owner == instance  # [SQ, T]
        mine = torch.cummax(tile_max.masked_fill(~own, float("-inf")), dim=-1).values
        running = torch.where(own, mine, running)
    empty = running == float("-inf")
    anchor = running.masked_fill(empty, 0.0)
    probs = torch.exp(tiled - anchor.unsqueeze(-1)) * FP8_P_SCALE
    rounded = probs.to(torch.float8_e4m3fn).float()
    overall = running.amax(-1, keepdim=True)
    weight = torch.exp(running - overall.masked_fill(overall == float("-inf"), 0.0)).masked_fill(empty, 0.0)
    denom = (probs.sum(-1) * weight).sum(-1, keepdim=True)  # [..., SQ, 1]
    weighted = (rounded * weight.unsqueeze(-1)).flatten(-2)[..., :length]
    return torch.matmul(weighted, values) / denom


def _view_record(t: "torch.Tensor", base: "torch.Tensor | None") -> dict[str, Any]:
    if base is not None:
        # The address that matters is the engine's, not that of kvdbg's copy (a memory-mapped file can start
        # anywhere): take the engine's page tensor as 16-byte aligned -- allocators align far more -- and
        # check where in it the view starts (V starts D elements in).
        ptr = (t.storage_offset() - base.storage_offset()) * t.element_size()
    else:
        ptr = None if t.device.type == "meta" else int(t.data_ptr())
    return {"shape": tuple(t.shape), "strides": tuple(t.stride()), "element_size": t.element_size(), "data_ptr": ptr}


def view_violations(k: "torch.Tensor", v: "torch.Tensor", head_size: int,
                    base: "torch.Tensor | None" = None) -> list[Finding]:
    """What ``_validate_native_hnd_tma_strides`` checks of the K/V views (see ``ts_contract.check_kv_view``).

    ``base``: the page tensor the views were cut from; addresses are then taken relative to it.
    """
    return check_kv_views(_view_record(k, base), _view_record(v, base), head_size)


class FlashInferTSImpl:
    """vLLM's FlashInferTSImpl.forward: real ``wrapper.run(validate=False)`` or the emulated contract."""

    def __init__(self, meta: "SnapshotMeta", builder: FlashInferTSBuilder):
        layer = meta.layer
        self.meta = meta
        self.builder = builder
        self.num_heads = layer.num_heads
        self.head_size = layer.head_size
        self.fp8 = layer.is_fp8
        # vLLM's layer keeps q/k/v scales even without FP8 (1.0 by default) and the backend folds them all.
        self.bmm1_scale = float(layer.scale) * float(layer.q_scale) * float(layer.k_scale)
        self.bmm2_scale = float(layer.v_scale)
        self.q_scale = float(layer.q_scale)
        self.reset()

    def reset(self) -> None:
        """Forget the last forward: its cache views (findings must never judge another cache's views, and
        holding them would keep that cache alive) and the emulator it chose (describe() reports it)."""
        self.last_views: tuple[Any, Any, Any] | None = None  # K view, V view, the page tensor
        self.emulator, self.emulator_note = "torch", None

    def kernel_query(self, query: "torch.Tensor") -> "torch.Tensor":
        """The query in the plan's dtype: FP8 bytes viewed as e4m3; a model-dtype query on an FP8 cache is
        quantised with q_scale, as vLLM's attention layer does before calling this backend."""
        if not self.fp8:
            return query
        query = as_fp8(query)
        return query if query.dtype == torch.float8_e4m3fn else quantize_fp8(query, self.q_scale)

    def _emulator(self, q: "torch.Tensor", k_cache: "torch.Tensor", md: FlashInferTSMetadata) -> Callable:
        """The Triton kernel of the same contract on CUDA for a large step, else the torch loop.

        Triton's first launch in a process costs ~0.5-1 s (import, cache lookup
        or compile); the torch loop costs ~0.1 ms a request. A step that may read
        more than TRITON_ABOVE_BYTES of K/V, or holds more than
        TRITON_ABOVE_REQUESTS requests, goes to Triton. ``KVDBG_EMULATION=torch``
        or ``=triton`` decides instead.
        """
        import os

        self.emulator, self.emulator_note = "torch", None
        forced = os.environ.get("KVDBG_EMULATION", "").lower()
        if not q.is_cuda or forced == "torch":
            return emulate_decode
        readable = md.num_reqs * md.block_table.shape[1] * self.builder.page_size
        kv_bytes = 2 * readable * k_cache.shape[1] * self.head_size * k_cache.element_size()
        if forced != "triton" and kv_bytes <= TRITON_ABOVE_BYTES and md.num_reqs <= TRITON_ABOVE_REQUESTS:
            self.emulator_note = (f"torch loop chosen by size (at most {kv_bytes / 2**20:.1f} MiB of K/V, "
                                  f"{md.num_reqs} requests; Triton above {TRITON_ABOVE_BYTES >> 20} MiB or "
                                  f"{TRITON_ABOVE_REQUESTS} requests); KVDBG_EMULATION=triton decides instead")
            return emulate_decode
        try:
            from kvdbg.backends.flashinfer_ts import triton_decode as _triton_decode
        except Exception as exc:  # triton missing or broken: say so, run the torch definition
            self.emulator_note = f"Triton emulation unavailable ({type(exc).__name__}: {exc}); torch loop used"
            return emulate_decode
        reason = _triton_decode.supported(q, k_cache)
        if reason is not None:
            self.emulator_note = f"Triton emulation not used: {reason}; torch loop used"
            return emulate_decode
        self.emulator = "triton"
        return _triton_decode.triton_decode

    def forward(self, query, kv_cache, md: FlashInferTSMetadata, output):
        if md.overflow is not None or md.num_actual_tokens == 0:
            return output
        if md.build_id != self.builder.build_count:
            raise RuntimeError(f"FLASHINFER_TS metadata of build {md.build_id} was overwritten by build "
                               f"{self.builder.build_count}: its buffers are persistent, run each build before the next")
        n, b, sq = md.num_actual_tokens, md.num_reqs, md.query_len
        k_cache, v_cache = split_kv(kv_cache, LAYOUT_VLLM, self.head_size, fp8=self.fp8)
        self.last_views = (k_cache, v_cache, kv_cache)
        # The flat view assigns token t to request t // sq whatever query_start_loc says (see findings).
        q = self.kernel_query(query[:n]).reshape(b, sq, self.num_heads, self.head_size)
        plan = md.plan
        model_dtype = self.builder.out_dtype
        if md.wrapper is not None:
            kernel_out = torch.empty((b, sq, self.num_heads, self.head_size), dtype=plan.o_data_type,
                                     device=query.device)
            md.wrapper.run(**self.builder.gate.api.run_kwargs(dict(
                q=q, paged_kv_cache=(k_cache, v_cache), seq_lens=md.seq_lens, block_tables=md.block_table,
                bmm1_scale=self.bmm1_scale, bmm2_scale=self.bmm2_scale, out=kernel_out, validate=False)))
        else:
            if view_violations(k_cache, v_cache, self.head_size, kv_cache):
                return output  # the kernel's TMA descriptors would be wrong: nothing to predict (see findings)
            # As the backend does, the kernel writes straight into the output unless a cast is needed. Rows the
            # emulation cannot predict (undefined on the real kernel) are left as they were: the replay core's
            # NaN, or NaN in the staging buffer, so they show as "not written".
            direct = output[:n]
            if plan.o_data_type == output.dtype == model_dtype and direct.is_contiguous():
                kernel_out = direct.view(b, sq, self.num_heads, self.head_size)
            else:
                kernel_out = torch.full((b, sq, self.num_heads, self.head_size), float("nan"),
                                        dtype=plan.o_data_type, device=query.device)
            emulate = self._emulator(q, k_cache, md)
            if emulate is emulate_decode:
                codes = undefined_codes(md, int(k_cache.shape[0]), self.builder.page_size,
                                        self.builder.gate.contract)
                defined = [r for r, code in enumerate(codes.tolist()) if not code]
                emulate_decode(q, k_cache, v_cache, md.seq_lens, md.block_table, mask_type=plan.mask_type,
                               window_left=plan.window_left, bmm1_scale=self.bmm1_scale,
                               bmm2_scale=self.bmm2_scale, out=kernel_out, requests=defined,
                               fp8_profile=md.fp8_profile)
            else:  # the kernel checks the same preconditions itself: no host round trip, no extra launch
                emulate(q, k_cache, v_cache, md.seq_lens, md.block_table, mask_type=plan.mask_type,
                        window_left=plan.window_left, bmm1_scale=self.bmm1_scale, bmm2_scale=self.bmm2_scale,
                        out=kernel_out, max_kv_len=md.max_kv_len, fp8_profile=md.fp8_profile)
        # The engine converts the kernel's dtype (fp16 for an FP8 query) to the model dtype.
        if kernel_out.data_ptr() != output.data_ptr():
            output[:n] = kernel_out.reshape(n, self.num_heads, self.head_size).to(model_dtype).to(output.dtype)
        return output


UNDEFINED_CODES = ("seq_len_not_positive", "seq_len_below_query_len", "seq_len_over_max_kv_len",
                   "table_too_narrow", "page_outside_cache", "inactive_request")


def undefined_codes(md: FlashInferTSMetadata, num_pages: int, page_size: int,
                    api: ApiGeneration = STRICTEST) -> "torch.Tensor":
    """Per request, 1 + the index in UNDEFINED_CODES of the first reason it is not computed, 0 when it is.

    The same rules as ``ts_contract.check_request``, on the metadata's device
    without a host round trip, so the CUDA emulation can skip those requests
    inside the kernel. A dense mask has no ``query_len <= seq_len`` rule;
    ``inactive_request`` (0.7.4+, ``seq_len <= 0``) is defined -- its output is
    left untouched -- but nothing is computed for it either.
    """
    lens = md.seq_lens.to(torch.int64)
    table = md.block_table
    width = table.shape[1]
    active = lens > 0
    pages = (lens.clamp_min(0) + page_size - 1) // page_size
    live = torch.arange(width, device=lens.device).unsqueeze(0) < pages.clamp_max(width).unsqueeze(1)
    outside = (live & ((table < 0) | (table >= num_pages))).any(1)
    causal = md.plan.mask_type == "causal" if md.plan is not None else md.causal
    inactive = ~active if api.nonpositive_is_inactive else torch.zeros_like(active)
    checks = (~active & ~inactive,  # precedence order
              active & (lens < md.query_len) & causal,
              active & (lens > md.max_kv_len),
              active & (pages > width),
              active & outside,
              inactive)
    codes = torch.zeros_like(lens)
    for index in reversed(range(len(checks))):
        codes = torch.where(checks[index], index + 1, codes)
    return codes


def undefined_requests(md: FlashInferTSMetadata, num_pages: int, page_size: int,
                       api: ApiGeneration = STRICTEST) -> dict[int, str]:
    """Requests the kernel does not compute (a broken precondition, or inactive), with the first reason."""
    if md.query_len == 0 or md.overflow is not None:
        return {}
    codes = undefined_codes(md, num_pages, page_size, api).tolist()
    return {r: UNDEFINED_CODES[c - 1] for r, c in enumerate(codes) if c}
