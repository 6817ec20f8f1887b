"""The plugin reads each layer feature from vLLM 0.33's own TritonAttentionImpl, built on CPU as vLLM builds it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvdbg.vllm_plugin.state import _PluginState

LAYOUT = "pages,heads,tokens,2*dim"


def _layer(name, window, **extra):
    # The attribute names of vLLM's Attention layer (model_executor/layers/attention/attention.py).
    return SimpleNamespace(layer_name=name, sliding_window=window, _q_scale_float=1.0, _k_scale_float=1.0,
                           _v_scale_float=1.0, kv_sharing_target_layer_name=None, head_size_v=64,
                           use_mm_prefix=False, **extra)


def test_triton_impl_sinks_alibi_sqrt_soft_cap_and_chunk_lookback():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    sinks = torch.linspace(-1.0, 2.0, 8).to(torch.bfloat16)  # GPT-OSS keeps its sinks as a bf16 parameter
    slopes = [2.0 ** -(i + 1) for i in range(8)]
    impl = TritonAttentionImpl(8, 64, 0.125, 2, slopes, 256, "auto", 30.0, "decoder", None, sinks=sinks,
                               use_alibi_sqrt=True, chunk_lookback=1)
    layer = _layer("model.layers.3.self_attn.attn", 256, attn_type="decoder", use_alibi_sqrt=True)
    built = _PluginState(capturer=None).capture_layer(impl, layer, LAYOUT, torch.bfloat16)
    assert built.sinks == tuple(sinks.float().tolist())
    assert built.alibi_slopes == tuple(slopes) and built.alibi_sqrt
    assert (built.logits_soft_cap, built.sliding_window, built.chunk_lookback) == (30.0, 256, 1)


def test_triton_impl_without_features_and_an_encoder_layer():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    plain = TritonAttentionImpl(8, 64, 0.125, 2, None, None, "auto", None, "decoder", None)
    built = _PluginState(capturer=None).capture_layer(plain, _layer("l0", None, attn_type="decoder"), LAYOUT,
                                                      torch.bfloat16)
    assert not built.has_sinks and not built.has_alibi and built.logits_soft_cap is None  # vLLM stores 0
    assert built.chunk_lookback is None  # vLLM's default -1 is off
    # An encoder-only layer: the impl keeps a symmetric (w - 1, w - 1) window; the layer keeps w.
    encoder = TritonAttentionImpl(8, 64, 0.125, 2, None, 64, "auto", None, "encoder_only", None)
    assert encoder.sliding_window == (63, 63)
    built = _PluginState(capturer=None).capture_layer(
        encoder, _layer("e0", 64, attn_type=encoder.attn_type), LAYOUT, torch.bfloat16)
    assert built.sliding_window == 64 and built.attn_type == "encoder_only"
