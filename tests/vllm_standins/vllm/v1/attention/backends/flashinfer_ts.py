"""Stand-in for vllm.v1.attention.backends.flashinfer_ts (FLASHINFER_TS), after the behaviour of its specification.

The real module's backend descriptor class was not in the sources read for
kvdbg, so none is defined here; the impl and builder carry the real names. The
prims_ts kernel is replaced by a plain-torch plan object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm._standin_math import paged_attention, write_cache
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_decode_query_len(vllm_config) -> int:
    spec = vllm_config.speculative_config
    if spec is None or not spec.num_speculative_tokens:
        return 1
    return 1 + spec.num_speculative_tokens


@dataclass
class _StandinPlan:
    """What BatchDecodePagedTSWrapper.plan fixes: the mask and the causal window."""

    causal: bool
    window_left: int


@dataclass
class FlashInferTSMetadata:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    query_len: int
    wrapper: Any


class FlashInferTSMetadataBuilder(AttentionMetadataBuilder[FlashInferTSMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        self.sliding_window = getattr(kv_cache_spec, "sliding_window", None)
        self.query_len = max_decode_query_len(vllm_config)
        self._plans: dict[tuple[int, int, bool], _StandinPlan] = {}
        sched = vllm_config.scheduler_config
        max_reqs = max(sched.max_num_seqs, sched.max_num_batched_tokens // max(self.query_len, 1))
        # Reused in place by every build, as the CUDA-graph-safe buffers of the real builder are.
        self._buf_seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self._buf_block_table = torch.zeros((max_reqs, self._window_pages(self.query_len)), dtype=torch.int32,
                                            device=device)

    def _window_pages(self, query_len: int) -> int:
        if self.sliding_window is None:
            return _cdiv(self.vllm_config.model_config.max_model_len, self.page_size)
        return _cdiv(self.sliding_window + query_len - 1, self.page_size) + 1

    def _get_plan(self, num_reqs: int, query_len: int, causal: bool) -> _StandinPlan:
        key = (num_reqs, query_len, causal)
        if key not in self._plans:
            window = self.sliding_window
            self._plans[key] = _StandinPlan(causal, window - 1 if (causal and window is not None) else -1)
        return self._plans[key]

    def _restrict_to_window(self, seq_lens, block_table, query_len):
        span = self.sliding_window + query_len - 1
        width = self._buf_block_table.shape[1]
        num_reqs = seq_lens.shape[0]
        start_page = torch.clamp_min(torch.div(seq_lens - span, self.page_size, rounding_mode="floor"), 0)
        cols = torch.arange(width, device=block_table.device)
        idx = (start_page.unsqueeze(1).to(torch.int64) + cols.unsqueeze(0)).clamp_max(block_table.shape[1] - 1)
        out_lens = self._buf_seq_lens[:num_reqs]
        out_table = self._buf_block_table[:num_reqs]
        out_lens.copy_(seq_lens - start_page.to(seq_lens.dtype) * self.page_size)
        out_table.copy_(block_table.gather(1, idx))
        return out_lens, out_table

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashInferTSMetadata:
        num_reqs = common_attn_metadata.num_reqs
        causal = common_attn_metadata.causal
        if isinstance(causal, torch.Tensor):
            raise NotImplementedError("FLASHINFER_TS has no per-sequence causality")
        query_len = common_attn_metadata.num_actual_tokens // num_reqs if num_reqs else 0
        if query_len > self.query_len:
            query_len = 0
        seq_lens = common_attn_metadata.seq_lens[:num_reqs]
        block_table = common_attn_metadata.block_table_tensor[:num_reqs]
        if self.sliding_window is not None and not causal:
            seq_lens, block_table = self._restrict_to_window(seq_lens, block_table, query_len)
        else:
            width = min(block_table.shape[1], self._buf_block_table.shape[1])
            out_lens = self._buf_seq_lens[:num_reqs]
            out_table = self._buf_block_table[:num_reqs, :width]
            out_lens.copy_(seq_lens)
            out_table.copy_(block_table[:, :width])
            seq_lens, block_table = out_lens, out_table
        if query_len == 0:
            return FlashInferTSMetadata(common_attn_metadata.seq_lens[:num_reqs],
                                        common_attn_metadata.block_table_tensor[:num_reqs], num_reqs, 0, 0, None)
        return FlashInferTSMetadata(seq_lens, block_table, num_reqs, num_reqs * query_len, query_len,
                                    self._get_plan(num_reqs, query_len, causal))


class FlashInferTSImpl(AttentionImpl[FlashInferTSMetadata]):
    forward_includes_kv_cache_update: bool = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        if sinks is not None:
            raise NotImplementedError("FLASHINFER_TS does not support attention sinks.")
        if alibi_slopes is not None:
            raise NotImplementedError("FLASHINFER_TS does not support alibi.")
        if logits_soft_cap:
            raise NotImplementedError("FLASHINFER_TS does not support softcap.")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("FLASHINFER_TS does not support KV sharing.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"FLASHINFER_TS does not support attention type {attn_type}.")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.supports_quant_query_input = kv_cache_dtype.startswith("fp8")

    def _kv_views(self, kv_cache):
        if self.kv_cache_dtype.startswith("fp8"):
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        return kv_cache[..., : self.head_size], kv_cache[..., self.head_size :]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = self._kv_views(kv_cache)
        write_cache(key, value, key_cache, value_cache, slot_mapping, fp8=self.kv_cache_dtype.startswith("fp8"),
                    k_scale=float(layer._k_scale), v_scale=float(layer._v_scale))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:
            return output
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("FLASHINFER_TS does not support fused output quantization.")
        n = attn_metadata.num_actual_tokens
        if n == 0:
            return output
        b, sq = attn_metadata.num_reqs, attn_metadata.query_len
        plan = attn_metadata.wrapper
        k_cache, v_cache = self._kv_views(kv_cache)
        qsl = torch.arange(b + 1, dtype=torch.int32) * sq
        fp8_query = query.dtype == torch.float8_e4m3fn
        out = paged_attention(query[:n], k_cache, v_cache, attn_metadata.block_table, attn_metadata.seq_lens, qsl,
                              scale=self.scale, causal=plan.causal,
                              window=plan.window_left + 1 if plan.window_left >= 0 else None,
                              q_scale=layer._q_scale_float if fp8_query else 1.0,
                              k_scale=layer._k_scale_float if self.kv_cache_dtype.startswith("fp8") else 1.0,
                              v_scale=layer._v_scale_float if self.kv_cache_dtype.startswith("fp8") else 1.0)
        output[:n].copy_(out)
        return output
