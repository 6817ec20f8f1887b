"""A step whose query is FP8: the tolerance allows the kernel's e4m3 rounding of P before P·V, and no more.

The "engine" here is a test-local emulation of TRITON_ATTN's FP8 path (P·256 rounded to float8_e4m3fn,
divided by 256, then @ V in float32; the denominator from the unrounded P), over values of magnitude ~3.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvdbg.judge.compare import (FP8_P_RELATIVE, FP8_P_UNDERFLOW, compare, compare_step, default_tolerance,
                                 fp8_query_allowance)
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from kvdbg.replayer.runner import replay
from kvdbg.sentinel.checker import StepInputs, check_step
from kvdbg.capture.prepare import CaptureLayer
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.snapshot.layout import as_fp8, quantize_fp8

HQ, HKV, D, PS = 4, 2, 16, 16
V_SCALE, K_SCALE, Q_SCALE = 0.02, 0.05, 0.05


def _values(snap, seed=1):
    """Put values of magnitude 2.5-3, random signs, into the snapshot's cache (in place)."""
    g = torch.Generator().manual_seed(seed)
    _, v_view = snap.kv_views()
    sign = torch.randint(0, 2, v_view.shape, generator=g) * 2 - 1
    v_view.copy_(quantize_fp8(sign * (2.5 + torch.rand(v_view.shape, generator=g) * 0.5), V_SCALE))


def _logical(snap, step, r, table=None):
    """Request ``r``'s keys and values [Hkv, L, D], dequantised to float32."""
    k_view, v_view = snap.kv_views()
    s = snap.steps[step]
    length = int(s.seq_lens[r])
    rows = snap.stored_block_table(step) if table is None else table
    pages = rows[r, :-(-length // PS)].long()
    keys = as_fp8(k_view[pages]).float() * K_SCALE  # [n, Hkv, ps, D]
    values = as_fp8(v_view[pages]).float() * V_SCALE
    return (keys.transpose(0, 1).reshape(HKV, -1, D)[:, :length],
            values.transpose(0, 1).reshape(HKV, -1, D)[:, :length])


def kernel_output(snap, step=0, *, table=None, round_p=True):
    """The emulated kernel's output [T, Hq, D] (float32): decode rows (query_len 1), every key visible."""
    s = snap.steps[step]
    query = as_fp8(s.query).float() * Q_SCALE
    out = torch.empty(query.shape, dtype=torch.float32)
    qsl = s.query_start_loc.tolist()
    for r in range(len(qsl) - 1):
        keys, values = _logical(snap, step, r, table)
        for h in range(HQ):
            rows = query[qsl[r]:qsl[r + 1], h]
            logits = (rows @ keys[h // (HQ // HKV)].T) * snap.meta.layer.scale
            p = torch.exp(logits - logits.amax(-1, keepdim=True))
            denominator = p.sum(-1, keepdim=True)
            if round_p:
                p = (p * 256).to(torch.float8_e4m3fn).float() / 256
            out[qsl[r]:qsl[r + 1], h] = (p @ values[h // (HQ // HKV)]) / denominator
    return out


@pytest.fixture(scope="module")
def fp8_snap():
    """An FP8 snapshot with an FP8 query (as vLLM 0.33 stores it on CUDA) and sharp logits, values ~3."""
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 70, 33, 90, 57, 21), num_heads=HQ, num_kv_heads=HKV,
                                    head_size=D, page_size=PS, fp8=True, q_scale=Q_SCALE, k_scale=K_SCALE,
                                    v_scale=V_SCALE, dtype="float16", new_kv=False, seed=3))
    _values(snap)
    # Sharpen the logits (|q·k|·scale of a few units): few keys carry the weight, so P's rounding shows.
    g = torch.Generator().manual_seed(5)
    query = torch.randn(snap.steps[0].query.shape, generator=g) * 2
    snap.steps[0].query = quantize_fp8(query, Q_SCALE).view(torch.uint8)
    snap.steps[0].output = kernel_output(snap).to(torch.float16)
    return snap


def _captured_vs_reference(snap, **judge):
    result = replay(snap, ["reference"])
    comparisons = result.judge(**judge).comparisons
    (captured,) = [c for c in comparisons if c.actual == "captured"]
    return result, captured


def test_the_old_rule_fails_a_correct_engine_and_the_new_one_passes(fp8_snap):
    result, captured = _captured_vs_reference(fp8_snap)
    step = result.steps[0]
    old = compare(step.captured_output, step.runs["reference"].output, step.common.query_start_loc,
                  step.common.seq_lens, default_tolerance("float16", fp8=True))
    assert not old.passed and old.max_abs > 3e-2  # the P rounding alone leaves the FP8 default
    assert captured.passed, captured.to_json()["heads"]
    # Without the rounding the emulated engine is within the old rule: the widening is for P alone.
    exact = kernel_output(fp8_snap, round_p=False).to(torch.float16)
    assert compare(exact, step.runs["reference"].output, step.common.query_start_loc, step.common.seq_lens,
                   default_tolerance("float16", fp8=True)).passed


def test_the_allowance_comes_from_the_values_read_and_is_said(fp8_snap):
    result, captured = _captured_vs_reference(fp8_snap)
    read = torch.cat([_logical(fp8_snap, 0, r)[1].abs().amax(dim=(1, 2)).max().view(1)
                      for r in range(len(fp8_snap.steps[0].seq_lens))])
    lens = fp8_snap.steps[0].seq_lens.double()
    expected = float(((FP8_P_RELATIVE + lens * FP8_P_UNDERFLOW) * read.double()).max())
    allowance = result.steps[0].fp8_query_allowance
    assert math.isclose(allowance, expected, rel_tol=1e-6)
    assert 0.15 < expected < 0.2  # 2^-4 · ~3
    tol = captured.tolerance
    assert tol.atol == 3e-2 + allowance and tol.rtol == 3e-2
    assert "FP8 query: the kernel's P·V on FP8 operands, P rounded to e4m3: + 2^-4·max|v|" in tol.source
    assert f"= {allowance:.4g}" in tol.source
    shown = captured.to_json()["tolerance"]
    assert shown["source"] == tol.source and shown["atol"] == tol.atol
    # An explicit --atol stays as given.
    _, given = _captured_vs_reference(fp8_snap, atol=1e-3, rtol=1e-3)
    assert given.tolerance.atol == 1e-3 and given.tolerance.source == "--atol/--rtol"


def test_a_real_fault_still_fails(fp8_snap):
    faulty = synth_snapshot(SynthSpec(seq_lens=(40, 70, 33, 90, 57, 21), num_heads=HQ, num_kv_heads=HKV,
                                      head_size=D, page_size=PS, fp8=True, q_scale=Q_SCALE, k_scale=K_SCALE,
                                      v_scale=V_SCALE, dtype="float16", new_kv=False, seed=3))
    faulty.kv_cache.copy_(fp8_snap.kv_cache)
    faulty.steps[0].query = fp8_snap.steps[0].query
    out = fp8_snap.steps[0].output.clone()
    out[2, 1] += 0.5  # request 2, head 1
    faulty.steps[0].output = out
    _, captured = _captured_vs_reference(faulty)
    assert [(h.request, h.head) for h in captured.failed] == [(2, 1)]
    # A wrong page: the kernel read request 3 with its second page swapped for request 0's first.
    table = fp8_snap.stored_block_table(0).clone()
    table[3, 1] = table[0, 0]
    faulty.steps[0].output = kernel_output(fp8_snap, table=table).to(torch.float16)
    _, captured = _captured_vs_reference(faulty)
    assert captured.failed and {h.request for h in captured.failed} == {3}


def test_a_model_dtype_query_is_judged_as_before():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 70), num_heads=HQ, num_kv_heads=HKV, head_size=D, page_size=PS,
                                    fp8=True, dtype="float16", engine_output="reference", new_kv=False))
    snap.steps[0].query = as_fp8(snap.steps[0].query).float().to(torch.float16)  # the engine did not quantise it
    result = replay(snap, ["reference"])
    assert result.steps[0].fp8_query_allowance is None
    (captured,) = [c for c in compare_step(result.steps[0], snap.meta) if c.actual == "captured"]
    assert captured.tolerance == default_tolerance("float16", fp8=True)
    assert "FP8 query" not in json.dumps(captured.to_json())


def test_the_allowance_formula():
    # Per request: (2^-4 + n·2^-18)·max|v|, the largest over requests; non-finite values count as 0.
    values = torch.tensor([[1.0, 3.0], [2.0, float("nan")]])
    assert fp8_query_allowance(values, torch.tensor([100, 10_000])) == pytest.approx(
        max((2 ** -4 + 100 * 2 ** -18) * 3, (2 ** -4 + 10_000 * 2 ** -18) * 2))
    assert fp8_query_allowance(torch.zeros(0, 2), torch.zeros(0)) == 0.0
    # The bound holds: the emulated rounding of one softmax row never moves the output past it.
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(300, generator=g) * 6
        v = torch.rand(300, 8, generator=g) * 6 - 3
        p = torch.exp(logits - logits.max())
        rounded = (p * 256).to(torch.float8_e4m3fn).float() / 256
        err = ((rounded - p) @ v / p.sum()).abs().max()
        assert err <= fp8_query_allowance(v.abs().max(), 300)


def test_the_sentinel_allows_it_for_an_fp8_engine_query(fp8_snap):
    layer = CaptureLayer(name="model.layers.0.self_attn.attn", num_heads=HQ, num_kv_heads=HKV, head_size=D,
                         scale=fp8_snap.meta.layer.scale, dtype="float16", kv_layout=LAYOUT_VLLM,
                         kv_cache_dtype="fp8", q_scale=Q_SCALE, k_scale=K_SCALE, v_scale=V_SCALE)
    s = fp8_snap.steps[0]
    engine_table = s.block_table.clone()
    cache = torch.zeros((int(fp8_snap.page_ids.max()) + 1,) + tuple(fp8_snap.kv_cache.shape[1:]), dtype=torch.uint8)
    cache[fp8_snap.page_ids.long()] = fp8_snap.kv_cache.view(torch.uint8)
    pairs = [(r, h) for r in range(len(s.seq_lens)) for h in range(HQ)]

    def inputs(output, query):
        return StepInputs(query=query, kv_cache=cache, block_table=engine_table, seq_lens=s.seq_lens,
                          query_start_loc=s.query_start_loc, causal=True, output=output, max_model_len=512)

    fp8_query = as_fp8(s.query)
    result = check_step(layer, inputs(s.output.clone(), fp8_query), pairs=pairs)
    assert result.passed, [p.diff for p in result.failed_pairs]
    assert "FP8 query" in result.tolerance.source
    # The same output against a query the engine left in the model dtype: the FP8 default alone, which fails.
    plain = check_step(layer, inputs(s.output.clone(), fp8_query.float().mul(Q_SCALE).to(torch.float16)),
                       pairs=pairs)
    assert "FP8 query" not in plain.tolerance.source and not plain.passed
    bad = s.output.clone()
    bad[2, 1] += 0.5
    assert [(p.request, p.head) for p in check_step(layer, inputs(bad, fp8_query), pairs=pairs).failed_pairs] \
        == [(2, 1)]


def test_kvdbg_own_columns_keep_their_tolerance_on_an_fp8_query_step(fp8_snap):
    """Only comparisons with the engine's kernels on one side are widened: kvdbg's columns against the reference
    do not take P·V on FP8 operands, and keep the FP8 default; against the captured output they are widened."""
    result = replay(fp8_snap, ["reference", "flex"])
    comparisons = {(c.actual, c.expected): c for c in result.judge().comparisons}
    own = comparisons[("flex", "reference")].tolerance
    assert own.atol == 3e-2 and "FP8 query" not in own.source
    against_engine = comparisons[("flex", "captured")].tolerance
    assert against_engine.atol == 3e-2 + result.steps[0].fp8_query_allowance
    assert "FP8 query" in against_engine.source
