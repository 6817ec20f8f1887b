"""The replay's working cache: a second private mapping of the file, never a write to the file or the Snapshot."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.snapshot.cache import working_cache
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.replayer.runner import replay
from kvdbg.snapshot.store import load_snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot

BACKENDS = ["reference", "flashinfer_ts"]


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _outputs(result):
    return [{name: run.output for name, run in step.runs.items()} for step in result.steps]


@pytest.mark.parametrize("layout", [LAYOUT_VLLM, LAYOUT_KV_PLANES])
def test_multistep_replay_from_the_mapping_leaves_file_and_snapshot_unchanged(layout, tmp_path):
    spec = SynthSpec(seq_lens=(40, 77, 19), query_len=2, steps=3, layout=layout, dtype="float32")
    path = tmp_path / "snap.safetensors"
    save_snapshot(synth_snapshot(spec), path)
    digest = _sha256(path)
    snap = load_snapshot(path)
    before = snap.kv_cache.clone()

    cache = working_cache(snap)
    assert cache.data_ptr() != snap.kv_cache.data_ptr()
    assert torch.equal(cache, before)

    mapped = replay(snap, BACKENDS, ReplayOptions(exact=True))
    assert torch.equal(snap.kv_cache, before)
    assert _sha256(path) == digest
    # The same replay from an in-memory snapshot (copied working cache) gives the same bits.
    in_memory = dataclasses.replace(snap, kv_cache=before.clone(), kv_source=None)
    copied = replay(in_memory, BACKENDS, ReplayOptions(exact=True))
    for got, want in zip(_outputs(mapped), _outputs(copied)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, equal_nan=True)


def test_writes_to_the_working_cache_stay_private(tmp_path):
    path = tmp_path / "snap.safetensors"
    save_snapshot(synth_snapshot(SynthSpec(dtype="float32")), path)
    digest = _sha256(path)
    snap = load_snapshot(path)
    before = snap.kv_cache.clone()
    first, second = working_cache(snap), working_cache(snap)
    first.fill_(3.0)
    assert torch.equal(snap.kv_cache, before)
    assert torch.equal(second, before)
    assert _sha256(path) == digest


def test_a_snapshot_written_in_place_is_copied_not_remapped(tmp_path):
    path = tmp_path / "snap.safetensors"
    save_snapshot(synth_snapshot(SynthSpec(dtype="float32")), path)
    snap = load_snapshot(path)
    k, _ = snap.kv_views()
    k[0].fill_(5.0)  # through a view: the tensor no longer holds the file's bytes
    assert snap.remap_kv_cache() is None
    assert torch.equal(working_cache(snap), snap.kv_cache)


def test_a_changed_file_is_not_remapped(tmp_path):
    path = tmp_path / "snap.safetensors"
    save_snapshot(synth_snapshot(SynthSpec(dtype="float32")), path)
    snap = load_snapshot(path)
    kept = snap.kv_cache.clone()
    save_snapshot(synth_snapshot(SynthSpec(dtype="float32", seed=1)), path, overwrite=True)
    assert snap.remap_kv_cache() is None
    assert torch.equal(working_cache(snap), kept)


def test_a_replaced_cache_tensor_is_copied(tmp_path):
    path = tmp_path / "snap.safetensors"
    save_snapshot(synth_snapshot(SynthSpec(dtype="float32")), path)
    snap = load_snapshot(path)
    other = dataclasses.replace(snap, kv_cache=torch.zeros_like(snap.kv_cache))
    assert other.remap_kv_cache() is None
    assert torch.equal(working_cache(other), torch.zeros_like(snap.kv_cache))
