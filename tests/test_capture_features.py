"""Capturing layer features: CaptureLayer takes the values, the snapshot stores them, and the vLLM plugin reads every
feature from where vLLM 0.33 keeps it (impl.sinks, impl.alibi_slopes, the layer's own window, ...)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kvdbg.capture.build import complete_capture
from kvdbg.capture.prepare import CaptureInputError, CaptureLayer, prepare_capture
from kvdbg.replayer.runner import replay
from kvdbg.moves.shrinker import select_kv_heads
from kvdbg.snapshot.store import load_snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from kvdbg.vllm_plugin.state import _PluginState
from tests.test_capture import Engine


def test_captured_sinks_and_slopes_reach_the_file_and_the_reference(tmp_path):
    engine = Engine()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16)  # a model parameter, bf16
    layer = dataclasses.replace(engine.layer, sinks=sinks, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    assert layer.has_sinks and layer.has_alibi and layer.sinks == (0.5, -1.0, 2.0, 0.0)
    args = list(engine.args())
    args[0] = layer
    snap = complete_capture(prepare_capture(*args), engine.output)
    back = load_snapshot(save_snapshot(snap, tmp_path / "c.safetensors"))
    assert back.sinks.tolist() == [0.5, -1.0, 2.0, 0.0] and back.alibi_slopes.tolist()[0] == 0.5
    run = replay(back, ["reference"]).steps[0].runs["reference"]
    assert not run.output.isnan().any()


@pytest.mark.parametrize("changes, says", [
    (dict(has_sinks=True), "layer has_sinks is true but no sinks were given"),
    (dict(sinks=[1.0, 2.0]), "layer sinks holds 2 values for 4 query heads"),
    (dict(alibi_slopes=[1.0, float("inf"), 1.0, 1.0]), "layer alibi_slopes holds a value that is not finite"),
    (dict(alibi_slopes="steep"), "layer alibi_slopes must be one number per query head"),
    (dict(head_size_v=8), "layer head_size_v 8 differs from head_size 16"),
    (dict(chunk_lookback=1), "layer.chunk_lookback needs layer.sliding_window"),
    (dict(alibi_sqrt=True), "layer.alibi_sqrt is true but layer.has_alibi is false"),
])
def test_unusable_features_are_refused_at_capture_naming_the_field(changes, says):
    with pytest.raises(CaptureInputError, match=says.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(Engine().layer, **changes)


# --------------------------------------------------------------------------- the plugin's reading of vLLM 0.33


def _layer(name, window=None, **extra):
    return SimpleNamespace(layer_name=name, sliding_window=window, _q_scale_float=1.0, _k_scale_float=1.0,
                           _v_scale_float=1.0, attn_type="decoder", kv_sharing_target_layer_name=None,
                           head_size_v=64, **extra)


def _impl(window=None, **extra):
    # vLLM's FlashAttention/Triton impls keep the window as (left, right); the layer keeps the int.
    fields = dict(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125, kv_cache_dtype="auto", logits_soft_cap=0,
                  sinks=None, alibi_slopes=None, chunk_lookback=-1,
                  sliding_window=(-1, -1) if window is None else (window - 1, 0))
    fields.update(extra)
    return SimpleNamespace(**fields)


def _capture(impl, layer):
    return _PluginState(capturer=None).capture_layer(impl, layer, "pages,heads,tokens,2*dim", torch.bfloat16)


def test_interleaved_windows_are_read_per_layer():
    """A Gemma-2-like model: even layers slide over 4096 tokens, odd layers are global (vLLM 0.33 gives each layer
    its own window from config.layer_types and leaves cache_config.sliding_window unset for such models)."""
    state = _PluginState(capturer=None)
    got = []
    for i in range(4):
        window = 4096 if i % 2 == 0 else None
        layer = _layer(f"model.layers.{i}.self_attn.attn", window)
        got.append(state.capture_layer(_impl(window), layer, "pages,heads,tokens,2*dim", torch.bfloat16)
                   .sliding_window)
    assert got == [4096, None, 4096, None]


def test_every_feature_is_read_from_where_vllm_keeps_it():
    sinks = torch.tensor([0.1, 0.2, 0.3, 0.4])  # GPT-OSS: impl.sinks, one logit per query head
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)  # impl.alibi_slopes
    built = _capture(_impl(128, sinks=sinks, alibi_slopes=slopes, logits_soft_cap=30.0, chunk_lookback=3),
                     _layer("l", 128, use_alibi_sqrt=True, use_mm_prefix=True, _rswa_window=256))
    assert built.sinks == tuple(sinks.tolist()) and built.has_sinks
    assert built.alibi_slopes == (0.5, 0.25, 0.125, 0.0625) and built.has_alibi and built.alibi_sqrt
    assert (built.logits_soft_cap, built.sliding_window, built.chunk_lookback) == (30.0, 128, 3)
    assert built.mm_prefix and built.rswa_window == 256
    meta = built.meta(causal=True)
    assert meta.has_sinks and meta.alibi_sqrt and meta.chunk_lookback == 3 and meta.mm_prefix


def test_features_vllm_leaves_off_are_recorded_off():
    built = _capture(_impl(None, chunk_lookback=2), _layer("l", None))  # no window: TRITON_ATTN ignores lookback
    assert built.chunk_lookback is None and not built.has_sinks and not built.has_alibi
    assert built.logits_soft_cap is None and not built.mm_prefix and built.rswa_window is None


def test_a_kv_sharing_layer_and_an_encoder_layer():
    sharing = _layer("l1")
    sharing.kv_sharing_target_layer_name = "l0"
    built = _capture(_impl(), sharing)
    assert built.kv_sharing_target == "l0"
    layer = _layer("e", 32)
    layer.attn_type = "encoder_only"
    encoder = _capture(_impl(32), layer)
    assert encoder.attn_type == "encoder_only" and encoder.meta(causal=False).attn_type == "encoder_only"


def test_the_head_pass_of_shrink_keeps_each_heads_values():
    snap = synth_snapshot(SynthSpec(num_heads=8, num_kv_heads=4, sinks="auto", alibi_slopes="auto"))
    small = select_kv_heads(snap, [1, 3])
    assert small.sinks.tolist() == snap.sinks[[2, 3, 6, 7]].tolist()
    assert small.alibi_slopes.tolist() == snap.alibi_slopes[[2, 3, 6, 7]].tolist()


def test_an_impls_own_no_window_forms_are_read_as_none():
    """CPU_ATTN's impl keeps -1 and FLASH_ATTN/TRITON_ATTN's (-1, -1) for "no window"; the layer's None wins."""
    layer = _layer("l", None)
    assert _capture(_impl(None, sliding_window=-1), layer).sliding_window is None
    bare = _layer("l", None)
    del bare.sliding_window  # a layer without the attribute: the impl's form is read
    assert _capture(_impl(None, sliding_window=-1), bare).sliding_window is None
    assert _capture(_impl(None, sliding_window=(127, 0)), bare).sliding_window == 128
