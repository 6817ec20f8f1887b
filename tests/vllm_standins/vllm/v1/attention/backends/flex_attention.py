"""Stand-in for vllm.v1.attention.backends.flex_attention (vLLM 0.33 class names, signatures, cache layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm._standin_math import paged_attention, write_cache
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)


class FlexAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "FLEX_ATTENTION"

    @staticmethod
    def get_impl_cls() -> type["FlexAttentionImpl"]:
        return FlexAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["FlexAttentionMetadataBuilder"]:
        return FlexAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)


@dataclass
class FlexAttentionMetadata:
    causal: bool
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    num_reqs: int
    total_cache_tokens: int
    sliding_window: int | None = None


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder[FlexAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlexAttentionMetadata:
        if common_prefix_len > 0:
            raise NotImplementedError("Cascade prefix attention is not yet implemented for FlexAttention backend")
        num_gpu_blocks = self.cache_config.num_gpu_blocks
        assert num_gpu_blocks is not None, "FlexAttention requires num_gpu_blocks to be set"
        return FlexAttentionMetadata(
            causal=common_attn_metadata.causal,
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            max_query_len=common_attn_metadata.max_query_len,
            query_start_loc=common_attn_metadata.query_start_loc,
            query_start_loc_cpu=common_attn_metadata.query_start_loc_cpu,
            max_seq_len=common_attn_metadata.max_seq_len,
            seq_lens=common_attn_metadata.seq_lens,
            block_table=common_attn_metadata.block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping,
            block_size=self.kv_cache_spec.block_size,
            num_reqs=common_attn_metadata.num_reqs,
            total_cache_tokens=num_gpu_blocks * self.kv_cache_spec.block_size,
        )


class FlexAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 block_m=None, block_n=None, **kwargs) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.attn_type = attn_type
        if alibi_slopes is not None:
            raise NotImplementedError("FlexAttention does not support alibi slopes yet.")
        self.alibi_slopes = None
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        if logits_soft_cap is not None:
            raise NotImplementedError("FlexAttention does not support logits soft cap yet.")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("FlexAttention does not support kv sharing yet.")
        if kv_cache_dtype.startswith("fp8"):
            raise NotImplementedError("FlexAttention does not support quantized kv-cache. Yet")
        self.num_queries_per_kv = num_heads // num_kv_heads

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache[..., : self.head_size], kv_cache[..., self.head_size :]
        write_cache(key, value, key_cache, value_cache, slot_mapping, fp8=False, k_scale=1.0, v_scale=1.0)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not yet supported for FlexAttentionImpl")
        if attn_metadata is None:
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        hs = self.head_size
        out = paged_attention(query[:n], kv_cache[..., :hs], kv_cache[..., hs:], attn_metadata.block_table,
                              attn_metadata.seq_lens, attn_metadata.query_start_loc, scale=self.scale,
                              causal=bool(attn_metadata.causal), window=self.sliding_window)
        output[:n].copy_(out)
        return output
