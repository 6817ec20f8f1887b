"""Stand-in for vllm.model_executor.layers.attention.attention: the Attention layer's call path.

Kept: the attributes backends and kvdbg read, and the order of the two ops on
the direct-call path (the K/V cache update, then the attention forward), both
fetching their inputs from the forward context by layer name.
"""

from __future__ import annotations

import torch

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import AttentionType


class Attention:
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, cache_config=None,
                 logits_soft_cap=None, per_layer_sliding_window=None, prefix="", attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, attn_backend=None):
        kv_cache_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
        num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.layer_name = prefix
        self.num_heads = num_heads
        self.head_size = head_size
        self.head_size_v = head_size
        self.num_kv_heads = num_kv_heads
        self.sliding_window = per_layer_sliding_window
        self.has_sink = False
        self.attn_backend = attn_backend
        impl_cls = attn_backend.get_impl_cls()
        self.impl = impl_cls(num_heads, head_size, scale, num_kv_heads, alibi_slopes, per_layer_sliding_window,
                             kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name)
        self.dtype = torch.get_default_dtype()
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache = torch.tensor([])
        self._q_scale = torch.tensor(1.0)
        self._k_scale = torch.tensor(1.0)
        self._v_scale = torch.tensor(1.0)
        self._q_scale_float = 1.0
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0

    def set_kv_scales(self, q_scale: float, k_scale: float, v_scale: float) -> None:
        """What loading a checkpoint with FP8 scales leaves on the layer."""
        self._q_scale, self._k_scale, self._v_scale = (torch.tensor(q_scale), torch.tensor(k_scale),
                                                       torch.tensor(v_scale))
        self._q_scale_float, self._k_scale_float, self._v_scale_float = q_scale, k_scale, v_scale

    def forward(self, query, key, value, output_shape=None):
        output_dtype = query.dtype
        if output_shape is None:
            output_shape = torch.Size((query.shape[0], self.num_heads * self.head_size_v))
        output = torch.empty(output_shape, dtype=output_dtype, device=query.device)
        hidden_size = output_shape[-1]
        query = query.view(-1, self.num_heads, self.head_size)
        output = output.view(-1, self.num_heads, self.head_size_v)
        if key is not None:
            key = key.view(-1, self.num_kv_heads, self.head_size)
        if value is not None:
            value = value.view(-1, self.num_kv_heads, self.head_size_v)
        if (not self.attn_backend.forward_includes_kv_cache_update and self.kv_sharing_target_layer_name is None
                and key is not None and value is not None):
            unified_kv_cache_update(key, value, self.layer_name)
        unified_attention_with_output(query, key, value, output, self.layer_name)
        return output.view(-1, hidden_size)


def get_attention_context(layer_name):
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata[layer_name]
    attn_layer = forward_context.no_compile_layers[layer_name]
    return attn_metadata, attn_layer, attn_layer.kv_cache, forward_context.slot_mapping.get(layer_name)


def unified_kv_cache_update(key, value, layer_name):
    _, attn_layer, kv_cache, layer_slot_mapping = get_attention_context(layer_name)
    if layer_slot_mapping is not None:
        attn_layer.impl.do_kv_cache_update(attn_layer, key, value, kv_cache, layer_slot_mapping)
    return torch.empty(0, device=kv_cache.device, dtype=kv_cache.dtype)


def unified_attention_with_output(query, key, value, output, layer_name, output_scale=None,
                                  output_block_scale=None, kv_cache_dummy_dep=None):
    attn_metadata, self, kv_cache, _ = get_attention_context(layer_name)
    self.impl.forward(self, query, key, value, kv_cache, attn_metadata, output=output, output_scale=output_scale,
                      output_block_scale=output_block_scale)
