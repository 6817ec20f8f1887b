"""`kvdbg shrink`: the failure kept (same backend, same renumbered heads), each reduction sound, refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from kvdbg.backend_api import ReplayOptions
from kvdbg.cli import cli
from kvdbg.runner import replay
from kvdbg.shrinker import (bake_step, ddmin, drop_pages, droppable_pages, observe, same_failure, select_kv_heads,
                          select_requests)
from kvdbg.snapshot import load_snapshot, validate
from kvdbg.synth import SynthSpec, synth_snapshot


def invoke(*args):
    return CliRunner().invoke(cli, ["shrink", *args], catch_exceptions=False)


def reference_output(snap, step=0):
    """fp64: shrunk snapshots batch requests differently, so outputs agree to round-off, not bit for bit."""
    return replay(snap, ["reference"], ReplayOptions(exact=True), steps=[step]).steps[0].runs["reference"].output


def test_shrink_keeps_flex_failure_on_the_same_renumbered_heads(make_snapshot, tmp_path):
    path, snap = make_snapshot(seq_lens=(40, 70, 100, 55, 90, 33), steps=3, num_heads=8, num_kv_heads=4,
                               use_page_zero=True, page_zero_request=3)
    out = tmp_path / "small.safetensors"
    res = invoke(path, "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["backend"] == "flex"
    sig = {tuple(p) for p in data["signature"]["failing_heads"]}
    assert sig == {(3, h) for h in range(8)}  # page 0 hides 16 of request 3's keys from every head
    assert data["signature"]["error_findings"] == [{"code": "live_page_zero", "request": 3}]
    assert data["kept_requests"] == [3]
    assert data["kept_heads"] == list(range(8))  # --same-heads (default): every failing head stays
    assert data["output_bytes"] < data["input_bytes"] / 10
    assert [p["name"] for p in data["passes"]] == ["steps", "requests", "heads", "sequences", "table width"]

    small = load_snapshot(out)
    assert len(small.steps) == 1 and small.steps[0].num_reqs == 1
    assert (small.meta.layer.num_heads, small.meta.layer.num_kv_heads) == (8, 4)
    assert 0 in small.page_ids.tolist()
    # Independent replay of the written file, mapped back to the input's numbering.
    obs = observe(small, "flex", 0)
    mapped = {(data["kept_requests"][r], data["kept_heads"][h]) for r, h in obs.failing_heads}
    assert mapped and mapped == {p for p in sig if p[1] in data["kept_heads"]}
    assert {tuple(p) for p in data["failing_heads_after"]} == set(obs.failing_heads)
    assert obs.error_findings == {("live_page_zero", 0)}
    res = CliRunner().invoke(cli, ["replay", str(out), "--backend", "flex"])
    assert res.exit_code == 1

    # --any-heads lets the head pass drop failing heads too: one KV group (2 query heads) is enough.
    smaller = tmp_path / "smaller.safetensors"
    res = invoke(path, "-o", str(smaller), "--json", "--any-heads")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert len(data["kept_kv_heads"]) == 1 and len(data["kept_heads"]) == 2
    assert data["output_bytes"] < os.path.getsize(out)


def test_refuses_clean_input_and_existing_output(make_snapshot, tmp_path):
    clean, _ = make_snapshot(seq_lens=(30, 50))
    out = tmp_path / "out.safetensors"
    res = invoke(clean, "-o", str(out))
    assert res.exit_code == 2
    assert res.output.startswith("Error: ") and "passes against the reference" in res.output
    assert "nothing to shrink" in res.output and len(res.output.strip().splitlines()) == 1
    assert not out.exists()

    failing, _ = make_snapshot(seq_lens=(30, 50), use_page_zero=True, page_zero_request=0)
    res = invoke(failing, "-o", str(out), "--backend", "flashinfer_ts")  # page 0 is no bug for flashinfer_ts
    assert res.exit_code == 2 and "backend flashinfer_ts passes against the reference" in res.output
    out.write_bytes(b"keep me")
    res = invoke(failing, "-o", str(out))
    assert res.exit_code == 2 and "already exists; pass --force" in res.output
    assert out.read_bytes() == b"keep me"
    assert invoke(failing, "-o", str(out), "--force").exit_code == 0
    assert load_snapshot(out).steps[0].num_reqs == 1


def test_ddmin_finds_the_minimal_subset():
    calls = []

    def needs(subset):
        calls.append(tuple(subset))
        return {3, 11} <= set(subset)

    assert ddmin(range(20), needs) == [3, 11]
    assert ddmin(range(5), lambda s: True, allow_empty=True) == []
    assert ddmin([7], lambda s: bool(s)) == [7]
    assert len(set(calls)) < 60


def test_same_failure_rule():
    want = frozenset({(1, 0), (1, 2)})
    finds = frozenset({("live_page_zero", 1)})
    assert same_failure(want, finds, want, finds)
    assert same_failure(want | {(1, 3)}, finds, want, finds)  # the same request's other heads may join
    assert not same_failure(want | {(0, 0)}, finds, want, finds)  # a passing request must not start failing
    assert not same_failure(frozenset({(1, 0)}), finds, want, finds)  # a kept failing head stopped failing
    assert not same_failure(want, finds | {("x", None)}, want, finds)  # a new error finding: another bug
    assert not same_failure(frozenset(), frozenset(), frozenset(), frozenset())


@pytest.fixture(scope="module")
def multi_step():
    return synth_snapshot(SynthSpec(seq_lens=(40, 90, 65), steps=3, num_heads=8, num_kv_heads=4, seed=3))


def test_bake_step_equals_replaying_earlier_steps(multi_step):
    baked = bake_step(multi_step, 2)
    validate(baked)
    assert len(baked.steps) == 1 and baked.num_pages <= multi_step.num_pages
    torch.testing.assert_close(reference_output(baked), reference_output(multi_step, 2), rtol=1e-12, atol=1e-12)


def test_select_requests_and_heads_keep_their_exact_outputs(multi_step):
    baked = bake_step(multi_step, 1)
    full = reference_output(baked)
    qsl = baked.steps[0].query_start_loc.tolist()
    some = select_requests(baked, [2, 0])
    validate(some)
    rows = list(range(qsl[2], qsl[3])) + list(range(qsl[0], qsl[1]))
    torch.testing.assert_close(reference_output(some), full[rows], rtol=1e-12, atol=1e-12)
    heads = select_kv_heads(baked, [1, 3])  # group size 2: query heads 2, 3, 6, 7
    validate(heads)
    torch.testing.assert_close(reference_output(heads), full[:, [2, 3, 6, 7]], rtol=1e-12, atol=1e-12)


def test_dropping_pages_before_a_causal_window_keeps_the_output():
    snap = synth_snapshot(SynthSpec(seq_lens=(200, 37), sliding_window=32, num_heads=4, num_kv_heads=2, seed=5))
    baked = bake_step(snap, 0)
    assert droppable_pages(baked, 0) == list(range(12))  # token 199 is on page 12
    shorter = drop_pages(baked, 0, range(10))  # keys 0..159 lie before the window 168..199
    validate(shorter)
    assert shorter.steps[0].seq_lens.tolist() == [40, 37]
    assert shorter.num_pages == baked.num_pages - 10
    torch.testing.assert_close(reference_output(shorter), reference_output(baked), rtol=1e-12, atol=1e-12)
    inside = drop_pages(baked, 0, [11])  # keys 176..191 are inside the window: the output must change
    assert not torch.allclose(reference_output(inside)[0], reference_output(baked)[0])
