"""The layer-feature part of the format: the sinks / alibi_slopes tensors and the feature fields, validated on
load with one line naming the field (exit 2), and written so that files without them keep their old bytes."""

from __future__ import annotations

import json

import pytest
import torch

from kvdbg.snapshot.store import load_snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from tests.helpers import write_raw
from tests.test_snapshot_errors import assert_bad, run_info


def _parts(**spec):
    snap = synth_snapshot(SynthSpec(seq_lens=(20, 40), num_heads=4, num_kv_heads=2, head_size=16, **spec))
    return dict(snap.tensors()), json.loads(snap.meta.to_json())


def test_values_round_trip_bit_for_bit(tmp_path):
    snap = synth_snapshot(SynthSpec(sinks=(0.5, -1.25, 3.0, 0.0, 1.0, 2.0, -2.0, 0.25), alibi_slopes="auto",
                                    alibi_sqrt=True))
    back = load_snapshot(save_snapshot(snap, tmp_path / "s.safetensors"))
    assert torch.equal(back.sinks, snap.sinks) and back.sinks.dtype == torch.float32
    assert torch.equal(back.alibi_slopes, snap.alibi_slopes)
    assert back.meta.layer.has_sinks and back.meta.layer.has_alibi and back.meta.layer.alibi_sqrt


def test_a_snapshot_without_features_writes_no_new_key():
    layer = json.loads(synth_snapshot(SynthSpec()).meta.to_json())["layer"]
    assert not {"alibi_sqrt", "chunk_lookback", "mm_prefix", "rswa_window"} & set(layer)
    layer = json.loads(synth_snapshot(SynthSpec(alibi_slopes="auto", alibi_sqrt=True)).meta.to_json())["layer"]
    assert layer["alibi_sqrt"] is True


@pytest.mark.parametrize("change, fragments", [
    (lambda t, m: t.__setitem__("sinks", t["sinks"].half()), ("tensor 'sinks' has dtype float16, expected float32",)),
    (lambda t, m: t.__setitem__("sinks", t["sinks"][:3]), ("tensor 'sinks' has shape [3], expected [4]",
                                                          "one value per query head")),
    (lambda t, m: m["layer"].__setitem__("has_sinks", False),
     ("tensor 'sinks' is present but meta field layer.has_sinks is false",)),
    (lambda t, m: t.__setitem__("alibi_slopes", torch.ones(4, 1)), ("tensor 'alibi_slopes' has rank 2",)),
])
def test_malformed_value_tensors(tmp_path, change, fragments):
    tensors, meta = _parts(sinks="auto", alibi_slopes="auto")
    change(tensors, meta)
    assert_bad(run_info(write_raw(tmp_path / "s.safetensors", tensors, meta)), *fragments)


def test_values_that_are_not_finite(tmp_path):
    tensors, meta = _parts(sinks="auto")
    tensors["sinks"] = tensors["sinks"].clone()
    tensors["sinks"][2] = float("nan")
    path = write_raw(tmp_path / "s.safetensors", tensors, meta)
    assert_bad(run_info(path, "--check"), "tensor 'sinks'[2] = nan is not finite", "layer.has_sinks")


@pytest.mark.parametrize("layer_changes, fragments", [
    (dict(alibi_sqrt=True), ("layer.alibi_sqrt is true but layer.has_alibi is false",)),
    (dict(chunk_lookback=1), ("layer.chunk_lookback needs layer.sliding_window",)),
    (dict(chunk_lookback=10, sliding_window=8), ("leaves chunks of 0 tokens",)),
    (dict(chunk_lookback=-1, sliding_window=8), ("layer.chunk_lookback must be a non-negative integer",)),
    (dict(rswa_window=0), ("layer.rswa_window must be a positive integer",)),
    (dict(mm_prefix="yes"), ("layer.mm_prefix must be true or false",)),
    (dict(attn_type="encoder_only"), ("layer.causal is true but layer.attn_type 'encoder_only'",)),
])
def test_inconsistent_feature_fields(tmp_path, layer_changes, fragments):
    tensors, meta = _parts()
    meta["layer"].update(layer_changes)
    assert_bad(run_info(write_raw(tmp_path / "s.safetensors", tensors, meta)), *fragments)


def test_encoder_self_attention_attends_over_the_step_only(tmp_path):
    tensors, meta = _parts(causal=False, query_len=3)
    meta["layer"]["attn_type"] = "encoder"
    assert_bad(run_info(write_raw(tmp_path / "e.safetensors", tensors, meta), "--check"),
               "seq_lens[0] = 20 but the request has 3 query tokens", "layer.attn_type 'encoder'")


def test_cross_attention_may_have_more_queries_than_keys(tmp_path):
    snap = synth_snapshot(SynthSpec(seq_lens=(3, 40), query_len=8, causal=False, attn_type="encoder_decoder",
                                    new_kv=False))
    back = load_snapshot(save_snapshot(snap, tmp_path / "x.safetensors"))
    assert back.steps[0].seq_lens.tolist() == [3, 40]
    # A decoder layer may not.
    tensors, meta = dict(snap.tensors()), json.loads(snap.meta.to_json())
    meta["layer"]["attn_type"] = "decoder"
    assert_bad(run_info(write_raw(tmp_path / "d.safetensors", tensors, meta), "--check"),
               "seq_lens[0] = 3 is shorter than the request's 8 query tokens")


def test_a_kv_sharing_layer_writes_no_kv(tmp_path):
    tensors, meta = _parts()
    meta["layer"]["kv_sharing_target"] = "model.layers.0.self_attn.attn"
    assert_bad(run_info(write_raw(tmp_path / "k.safetensors", tensors, meta)),
               "tensor 'slot_mapping' writes new K/V, but layer.kv_sharing_target is set")


def test_a_flag_without_its_values_loads_but_cannot_be_replayed(tmp_path):
    """What kvdbg wrote before the values were stored: readable, and refused by name at replay."""
    tensors, meta = _parts()
    meta["layer"]["has_alibi"] = True
    path = write_raw(tmp_path / "old.safetensors", tensors, meta)
    assert run_info(path, "--check").exit_code == 0
    assert "ALiBi (flag only: values not stored)" in run_info(path).output
    from click.testing import CliRunner

    from kvdbg.cli import cli

    result = CliRunner().invoke(cli, ["replay", str(path)])
    assert result.exit_code == 2 and "no 'alibi_slopes' tensor" in result.output


def test_a_mask_an_older_reader_would_misread_raises_the_format_to_1_1(tmp_path):
    """chunk_lookback, mm_prefix and rswa_window change which keys a token sees: a reader of format "1" would
    ignore them, so such a file says "1.1", which that reader refuses; this reader reads both."""
    from kvdbg.snapshot.format import read_header

    plain = save_snapshot(synth_snapshot(SynthSpec(sliding_window=64)), tmp_path / "plain.safetensors")
    chunked = save_snapshot(synth_snapshot(SynthSpec(sliding_window=64, chunk_lookback=1)),
                            tmp_path / "chunked.safetensors")
    assert read_header(plain).metadata["kvdbg.format"] == "1"
    assert read_header(chunked).metadata["kvdbg.format"] == "1.1"
    assert load_snapshot(chunked).meta.layer.chunk_lookback == 1
    tensors, meta = _parts()
    assert_bad(run_info(write_raw(tmp_path / "v.safetensors", tensors, meta, fmt="1.2")),
               "unknown kvdbg.format '1.2'", "reads format 1 and 1.1")


def test_diff_names_the_heads_whose_values_differ(tmp_path):
    from kvdbg.moves.snapdiff import diff_snapshots

    a = synth_snapshot(SynthSpec(sinks="auto"))
    b = synth_snapshot(SynthSpec(sinks="auto"))
    b.sinks = b.sinks.clone()
    b.sinks[5] += 1.0
    result = diff_snapshots(save_snapshot(a, tmp_path / "a.safetensors"), save_snapshot(b, tmp_path / "b.safetensors"))
    (field,) = [f for f in result.meta if f.name == "sinks"]
    assert "head 5" in str(field.a) and "1 of 8 heads differ" in str(field.b)
