"""Round trips synth -> save -> load, compaction, atomic no-clobber writes."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvdbg.errors import OptionError
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.snapshot.store import load_snapshot, referenced_pages, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from tests.helpers import FIXTURES, asdict_meta_json


def _assert_same(a, b):
    assert a.meta == b.meta
    ta, tb = a.tensors(), b.tensors()
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
@pytest.mark.parametrize(
    "dtype,fp8,storage",
    [("bfloat16", False, "uint8"), ("float16", False, "uint8"), ("float32", False, "uint8"),
     ("bfloat16", True, "uint8"), ("float16", True, "float8_e4m3fn")],
)
def test_roundtrip_every_layout_and_dtype(tmp_path, layout, dtype, fp8, storage):
    spec = SynthSpec(seq_lens=(5, 33, 64), query_len=2, num_heads=4, num_kv_heads=2, head_size=16, layout=layout,
                     dtype=dtype, fp8=fp8, fp8_storage=storage, steps=2, k_scale=0.5 if fp8 else 1.0)
    snap = synth_snapshot(spec)
    path = save_snapshot(snap, tmp_path / "s.safetensors")
    loaded = load_snapshot(path)
    _assert_same(snap, loaded)
    assert loaded.meta.num_steps == 2
    # K/V views are views of the stored cache in [pages, Hkv, page_size, D] for both layouts.
    k, v = loaded.kv_views()
    assert k.shape == v.shape == (loaded.num_pages, 2, 16, 16)
    assert k.untyped_storage().data_ptr() == loaded.kv_cache.untyped_storage().data_ptr()
    if layout == LAYOUT_VLLM:
        assert k.stride(2) == 2 * 16  # token stride 2*D: the two halves of one page row


def test_compaction_keeps_exactly_the_referenced_pages():
    spec = SynthSpec(seq_lens=(17, 50), page_size=16, shuffle=True, stale_tail=3, steps=2, query_len=16,
                     num_heads=2, num_kv_heads=1, head_size=8)
    snap = synth_snapshot(spec)
    stored = sorted(snap.page_ids.tolist())
    live = set()
    for step in snap.steps:
        for row, length in zip(step.block_table.tolist(), step.seq_lens.tolist()):
            live.update(row[: -(-length // 16)])
        live.update(s // 16 for s in step.slot_mapping.tolist())
    assert stored == sorted(live)
    assert referenced_pages(snap.steps, 16).tolist() == stored
    # stale tails reference pages that are not stored, and that is allowed
    tails = {x for step in snap.steps for row in step.block_table.tolist() for x in row[-3:]}
    assert tails - set(stored)


def test_kv_views_match_the_true_values_in_both_layouts():
    a = synth_snapshot(SynthSpec(layout=LAYOUT_VLLM, seed=5, num_heads=2, num_kv_heads=1, head_size=8))
    b = synth_snapshot(SynthSpec(layout=LAYOUT_KV_PLANES, seed=5, num_heads=2, num_kv_heads=1, head_size=8))
    for x, y in zip(a.kv_views(), b.kv_views()):
        assert torch.equal(x, y)


def test_save_refuses_to_clobber_and_is_atomic(tmp_path):
    snap = synth_snapshot(SynthSpec(num_heads=2, num_kv_heads=1, head_size=8))
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"precious")
    with pytest.raises(OptionError, match="already exists"):
        save_snapshot(snap, path)
    assert path.read_bytes() == b"precious"
    save_snapshot(snap, path, overwrite=True)
    assert load_snapshot(path).meta == snap.meta
    assert [p for p in os.listdir(tmp_path) if p.startswith(".kvdbg-")] == []


def test_loaded_tensors_are_private_mappings(tmp_path):
    snap = synth_snapshot(SynthSpec(num_heads=2, num_kv_heads=1, head_size=8))
    path = save_snapshot(snap, tmp_path / "s.safetensors")
    before = open(path, "rb").read()
    loaded = load_snapshot(path)
    loaded.kv_cache.zero_()  # writing to the loaded cache must never reach the file
    assert open(path, "rb").read() == before


def test_synth_is_deterministic():
    a = synth_snapshot(SynthSpec(seed=7, num_heads=2, num_kv_heads=1, head_size=8, use_page_zero=True))
    b = synth_snapshot(SynthSpec(seed=7, num_heads=2, num_kv_heads=1, head_size=8, use_page_zero=True))
    c = synth_snapshot(SynthSpec(seed=8, num_heads=2, num_kv_heads=1, head_size=8, use_page_zero=True))
    _assert_same(a, b)
    assert not torch.equal(a.kv_cache, c.kv_cache)


def test_synth_options_shape_the_snapshot():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 50, 60), shared_prefix_pages=2, use_page_zero=True,
                                    page_zero_request=2, num_heads=2, num_kv_heads=1, head_size=8))
    tables = snap.steps[0].block_table.tolist()
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # shared prefix
    assert tables[2][2] == 0 and 0 in snap.page_ids.tolist()  # page 0 live in request 2
    assert snap.steps[0].query_lens == [1, 1, 1]
    fp8 = synth_snapshot(SynthSpec(fp8=True, k_scale=0.03, num_heads=2, num_kv_heads=1, head_size=8))
    assert fp8.kv_cache.dtype == torch.uint8 and fp8.meta.layer.kv_cache_dtype == "fp8_e4m3"


def test_atomic_write_leaves_nothing_behind_on_failure(tmp_path):
    from kvdbg.util.atomic import atomic_write

    target = tmp_path / "out.bin"
    target.write_bytes(b"keep me")

    def broken(fh):
        fh.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OptionError, match="No space left on device"):
        atomic_write(target, broken, overwrite=True)
    assert target.read_bytes() == b"keep me"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]
    with pytest.raises(OptionError, match="is a directory"):
        atomic_write(tmp_path, lambda fh: None)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(FIXTURES) if n.endswith(".safetensors")))
def test_metadata_json_is_the_same_bytes_as_asdict_gives(name):
    meta = load_snapshot(os.path.join(FIXTURES, name)).meta
    assert meta.to_json() == asdict_meta_json(meta)
    # Nested provenance, tuples and features set: the same too.
    richer = dataclasses.replace(
        meta, capture={**meta.capture, "nested": {"list": [1, 2.5, None], "tuple": (3, "x"), "flag": True}},
        layer=dataclasses.replace(meta.layer, chunk_lookback=64, mm_prefix=True))
    assert richer.to_json() == asdict_meta_json(richer)
