"""Per request × head diffs: errors, worst token, non-finite counts, tolerances, captured output."""

from __future__ import annotations

import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.judge.compare import DEFAULT_TOLERANCES, compare, compare_step, default_tolerance
from kvdbg.replayer.runner import replay
from kvdbg.moves.synth import SynthSpec, synth_snapshot

QSL = torch.tensor([0, 2, 5, 6])  # three requests with 2, 3 and 1 query tokens
SEQ_LENS = torch.tensor([10, 40, 7])


def _expected():
    return torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_identical_outputs_pass_everywhere():
    e = _expected()
    comp = compare(e.clone(), e, QSL, SEQ_LENS, default_tolerance("float32"))
    assert comp.passed and len(comp.heads) == 12
    assert all(h.max_abs == 0 and abs(h.cosine - 1) < 1e-12 for h in comp.heads)


def test_one_bad_element_fails_exactly_its_head_with_the_worst_token():
    e = _expected()
    a = e.clone()
    a[3, 2, 5] += 0.5  # request 1 (tokens 2..4), head 2, its second query token
    comp = compare(a, e, QSL, SEQ_LENS, default_tolerance("bfloat16"))
    (bad,) = comp.failed
    assert (bad.request, bad.head) == (1, 2)
    assert bad.worst_token == 3 and bad.worst_position == 40 - 3 + 1
    assert abs(bad.max_abs - 0.5) < 1e-12 and bad.failing == 1
    assert abs(bad.mean_abs - 0.5 / (3 * 8)) < 1e-12
    assert bad.cosine < 1


def test_tolerance_rule_is_atol_plus_rtol_times_expected():
    e = torch.full((6, 1, 1), 2.0, dtype=torch.float64)
    tol = default_tolerance("float32", atol=0.1, rtol=0.05)  # limit 0.2
    assert tol.source == "--atol/--rtol"
    assert compare(e + 0.199, e, QSL, SEQ_LENS, tol).passed
    assert not compare(e + 0.201, e, QSL, SEQ_LENS, tol).passed


def test_non_finite_outputs_are_counted_not_raised():
    e = _expected()
    a = e.clone()
    a[5] = float("nan")  # request 2 produced NaN
    a[0, 1, 0] = float("inf")
    comp = compare(a, e, QSL, SEQ_LENS, default_tolerance("float32"))
    by_key = {(h.request, h.head): h for h in comp.failed}
    assert set(by_key) == {(0, 1)} | {(2, h) for h in range(4)}
    # NaN the backend wrote is its own output, never "unwritten".
    assert by_key[(2, 0)].actual_nonfinite == 8 and by_key[(2, 0)].unwritten == 0
    assert by_key[(0, 1)].actual_nonfinite == 1 and by_key[(0, 1)].expected_nonfinite == 0
    assert comp.nonfinite == 33 and comp.counts()["actual_nonfinite"] == 33
    # A head with any non-finite element never reports cosine 1.0.
    assert by_key[(0, 1)].cosine != by_key[(0, 1)].cosine


def test_tokens_the_backend_did_not_write_are_unwritten_not_nan():
    e = _expected()
    a = e.clone()
    a[5] = float("nan")
    written = torch.tensor([True] * 5 + [False])
    comp = compare(a, e, QSL, SEQ_LENS, default_tolerance("float32"), written=written)
    heads = [h for h in comp.heads if h.request == 2]
    assert all(not h.passed and h.unwritten == 8 and h.actual_nonfinite == 0 for h in heads)
    assert comp.counts() == {"actual_nonfinite": 0, "unwritten": 32, "expected_nonfinite": 0}


def test_non_finite_expected_side_never_passes():
    """Both sides NaN: nothing can be verified, so nothing passes, and no statistic claims agreement."""
    e = torch.full((6, 4, 8), float("nan"), dtype=torch.float64)
    comp = compare(e.clone(), e, QSL, SEQ_LENS, default_tolerance("float32"))
    assert not comp.passed and len(comp.failed) == 12
    for h in comp.heads:
        assert h.compared == 0 and h.expected_nonfinite == h.num_tokens * 8 and h.actual_nonfinite == h.expected_nonfinite
        assert h.max_abs != h.max_abs and h.cosine != h.cosine  # NaN (null in JSON), never 0 / 1.0
    record = comp.to_json()
    assert record["passed"] is False and record["max_abs"] is None and record["expected_nonfinite"] == 6 * 4 * 8
    assert record["heads"][0]["cosine"] is None


def test_a_comparison_of_no_heads_does_not_pass():
    e = _expected()
    comp = compare(e, e, QSL, SEQ_LENS, default_tolerance("float32"), heads=[])
    assert comp.heads == [] and not comp.passed


def test_request_and_head_filters():
    e = _expected()
    comp = compare(e, e, QSL, SEQ_LENS, default_tolerance("float32"), requests=[1], heads=[0, 3])
    assert [(h.request, h.head) for h in comp.heads] == [(1, 0), (1, 3)]


def test_default_tolerances_by_dtype():
    assert default_tolerance("float32").atol == DEFAULT_TOLERANCES["float32"][0] == 1e-5
    assert default_tolerance("bfloat16").rtol == 1.6e-2
    assert default_tolerance("float16").atol == 2e-3
    assert default_tolerance("bfloat16", fp8=True).atol == 3e-2
    assert default_tolerance("float16", atol=1.0).source == "default for float16 with --atol/--rtol"


def test_captured_output_is_compared_both_ways():
    snap = synth_snapshot(SynthSpec(query_len=2))
    ref = replay(snap, ["reference"], ReplayOptions()).steps[0].runs["reference"].output
    captured = ref.to(torch.bfloat16)
    captured[1, 3] += 1.0  # the engine got token 1 / head 3 wrong
    snap.steps[0].output = captured
    result = replay(snap, ["reference", "flex"], ReplayOptions())
    comps = {(c.actual, c.expected): c for c in compare_step(result.steps[0], snap.meta)}
    assert set(comps) == {("flex", "reference"), ("captured", "reference"), ("flex", "captured")}
    assert comps[("flex", "reference")].passed
    assert [(h.request, h.head) for h in comps[("captured", "reference")].failed] == [(0, 3)]
    assert [(h.request, h.head) for h in comps[("flex", "captured")].failed] == [(0, 3)]
