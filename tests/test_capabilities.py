"""Backend capabilities: declared on each backend, checked in one place (kvdbg.backends.base.unsupported_by)."""

from __future__ import annotations

import dataclasses

import pytest

from kvdbg.backends.base import Capabilities, unsupported_by
from kvdbg.backends import backend_names, get_backend
from kvdbg.snapshot.format import LAYOUT_KV_PLANES
from kvdbg.moves.synth import SynthSpec, synth_snapshot

SNAP = synth_snapshot(SynthSpec(query_len=2))


def _with_layer(**changes):
    meta = SNAP.meta
    return dataclasses.replace(meta, layer=dataclasses.replace(meta.layer, **changes))


@pytest.mark.parametrize("changes, caps, words", [
    (dict(has_sinks=True), Capabilities(who="X"), "X does not support attention sinks"),
    (dict(has_alibi=True), Capabilities(who="X"), "ALiBi"),
    (dict(logits_soft_cap=30.0), Capabilities(who="X", soft_cap=False), "soft-capping (layer.logits_soft_cap = 30.0)"),
    (dict(kv_sharing_target="l0"), Capabilities(who="X"), "KV sharing"),
    (dict(attn_type="encoder"), Capabilities(who="X"), "attn_type 'encoder'"),
    (dict(has_alibi=True, alibi_sqrt=True), Capabilities(who="X", alibi=True), "square-root ALiBi (layer.alibi_sqrt)"),
    (dict(sliding_window=64, chunk_lookback=1), Capabilities(who="X"), "layer.chunk_lookback = 1"),
    (dict(mm_prefix=True), Capabilities(who="X"), "PrefixLM multimodal attention (layer.mm_prefix"),
    (dict(rswa_window=128), Capabilities(who="X"), "layer.rswa_window = 128"),
    (dict(kv_cache_dtype="fp8_e4m3"), Capabilities(who="X", fp8_kv_cache=False), "FP8 KV cache"),
    (dict(dtype="float32"), Capabilities(who="X", model_dtypes=("bfloat16",)), "model dtype float32"),
    (dict(head_size=96), Capabilities(who="X", head_sizes=(64, 128)), "head size 96"),
])
def test_each_declared_limit_is_refused_in_one_line_naming_the_field(changes, caps, words):
    reason = unsupported_by(caps, _with_layer(**changes))
    assert words in reason and "\n" not in reason
    assert unsupported_by(caps, SNAP.meta) is None


def test_devices_and_layouts_and_the_then_clause():
    caps = Capabilities(who="X", devices=("cuda",), then="vLLM would not pick it")
    assert unsupported_by(caps, SNAP.meta, "cpu") == "X does not support device cpu (it runs on cuda); vLLM would not pick it"
    assert unsupported_by(caps, SNAP.meta, "cuda:1") is None
    planes = dataclasses.replace(SNAP.meta, kv_layout=LAYOUT_KV_PLANES)
    assert "kv_layout" in unsupported_by(Capabilities(who="X", kv_layouts=(SNAP.meta.kv_layout,)), planes)


@pytest.mark.parametrize("name", backend_names())
def test_every_backend_declares_its_capabilities(name):
    spec = get_backend(name)
    assert isinstance(spec.capabilities, Capabilities)
    # Only the reference models sinks; PrefixLM ranges are in no snapshot, so nothing replays them.
    assert (spec.unsupported_reason(_with_layer(has_sinks=True)) is None) == (name == "reference")
    assert "PrefixLM" in spec.unsupported_reason(_with_layer(mm_prefix=True))


def test_what_the_backends_declare_matches_vllm():
    assert get_backend("flex").unsupported_reason(_with_layer(logits_soft_cap=30.0)).startswith(
        "vLLM's FLEX_ATTENTION does not support logits soft-capping")
    assert "vLLM would not pick it" in get_backend("flashinfer_ts").unsupported_reason(_with_layer(has_alibi=True))
    assert get_backend("reference").unsupported_reason(_with_layer(logits_soft_cap=30.0)) is None
