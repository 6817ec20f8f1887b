"""Shared test helpers: synthetic snapshots on disk and a raw writer that bypasses validation."""

from __future__ import annotations

import json

import pytest
import torch

from kvdbg.snapshot.store import save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot

from tests.helpers import FIXTURES, ROOT, run_python, write_raw  # noqa: F401  (re-exported)


@pytest.fixture
def make_snapshot(tmp_path):
    """make_snapshot(**SynthSpec fields) -> (path, Snapshot)."""
    counter = [0]

    def make(**kwargs):
        counter[0] += 1
        snap = synth_snapshot(SynthSpec(**kwargs))
        path = save_snapshot(snap, tmp_path / f"snap{counter[0]}.safetensors")
        return path, snap

    return make


@pytest.fixture
def small_parts():
    """A small valid snapshot as (tensors dict, meta dict) to corrupt one piece at a time."""
    snap = synth_snapshot(SynthSpec(seq_lens=(20, 40), num_heads=4, num_kv_heads=2, head_size=16))
    meta = json.loads(snap.meta.to_json())
    return dict(snap.tensors()), meta


@pytest.fixture(autouse=True)
def _wide_output(monkeypatch):
    """Tests read CLI output at 120 columns unless they set COLUMNS themselves.

    Piped output is laid out for 80 columns (kvdbg.cli.common.PIPED_WIDTH); most
    tests assert phrases that 120 columns keep on one line. The layout at 60, 80
    and 120 columns is tested in test_render_width.py.
    """
    monkeypatch.setenv("COLUMNS", "120")


@pytest.fixture(scope="session")
def nan_k_snapshot(tmp_path_factory):
    """fixtures/prefix_page0 with one NaN in a live K slot (key 53 of request 0, KV head 0): made once per
    session (tests/nan_snapshot.py says where and why)."""
    from tests.nan_snapshot import nan_in_live_k

    return nan_in_live_k(tmp_path_factory.mktemp("nan_k") / "nan_k.safetensors")
