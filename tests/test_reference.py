"""The exact reference against an independent per-request SDPA with explicit boolean masks; multi-step replay."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvdbg.backends.reference as reference_module
from kvdbg.backends.base import ReplayOptions
from kvdbg.snapshot.cache import apply_step_update
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.replayer.runner import replay
from kvdbg.snapshot.store import Snapshot, load_snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from tests.helpers import assert_close_ulps


def _page_tensors(snap: Snapshot):
    """K and V per stored page as [pages, ps, Hkv, D] float64, dequantised, from the raw layout."""
    kv = snap.kv_cache
    if snap.meta.layer.is_fp8:
        kv = kv.view(torch.float8_e4m3fn)
    kv = kv.to(torch.float64)
    d = snap.meta.layer.head_size
    if snap.meta.kv_layout == LAYOUT_VLLM:  # [pages, Hkv, ps, 2D]
        k, v = kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)
    else:  # [2, pages, ps, Hkv, D]
        k, v = kv[0], kv[1]
    layer = snap.meta.layer
    if layer.is_fp8:
        k, v = k * layer.k_scale, v * layer.v_scale
    return k, v


def independent_attention(snap: Snapshot, step: int = 0) -> torch.Tensor:
    """Per request: logical K/V by walking the block table, the step's new tokens at their positions, SDPA."""
    layer, ps = snap.meta.layer, snap.page_size
    k_pages, v_pages = _page_tensors(snap)
    index_of = {int(e): i for i, e in enumerate(snap.page_ids.tolist())}
    s = snap.steps[step]
    qsl = s.query_start_loc.tolist()
    query = s.query
    if layer.is_fp8:
        query = query.view(torch.float8_e4m3fn).to(torch.float64) * layer.q_scale
    query = query.to(torch.float64)
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = layer.num_heads // layer.num_kv_heads
    for r, length in enumerate(s.seq_lens.tolist()):
        q_len = qsl[r + 1] - qsl[r]
        pages = [index_of[int(p)] for p in s.block_table[r, : math.ceil(length / ps)].tolist()]
        keys = torch.cat([k_pages[i] for i in pages])[:length].clone()  # [L, Hkv, D]
        values = torch.cat([v_pages[i] for i in pages])[:length].clone()
        if s.key is not None:
            new_k, new_v = s.key[qsl[r]:qsl[r + 1]].to(torch.float64), s.value[qsl[r]:qsl[r + 1]].to(torch.float64)
            if layer.is_fp8:
                new_k = (new_k / layer.k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64) * layer.k_scale
                new_v = (new_v / layer.v_scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64) * layer.v_scale
            keys[length - q_len:], values[length - q_len:] = new_k, new_v
        mask = torch.zeros(q_len, length, dtype=torch.bool)
        w = layer.sliding_window
        for i in range(q_len):
            p = length - q_len + i
            for k in range(length):
                if layer.causal:
                    ok = k <= p and (w is None or p - w < k)
                else:  # vLLM's bidirectional window: symmetric around the token
                    ok = w is None or abs(p - k) < w
                mask[i, k] = ok
        q = query[qsl[r]:qsl[r + 1]].transpose(0, 1)  # [Hq, q, D]
        kk = keys.transpose(0, 1).repeat_interleave(group, 0)
        vv = values.transpose(0, 1).repeat_interleave(group, 0)
        if layer.logits_soft_cap:
            cap = layer.logits_soft_cap
            scores = (q @ kk.transpose(-1, -2)) * layer.scale
            scores = (cap * torch.tanh(scores / cap)).masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ vv
        else:
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=layer.scale)
        out[qsl[r]:qsl[r + 1]] = o.transpose(0, 1)
    return out


def reference_output(snap: Snapshot, exact: bool = True) -> torch.Tensor:
    return replay(snap, ["reference"], ReplayOptions(exact=exact)).steps[0].runs["reference"].output


CASES = {
    "causal": dict(),
    "causal_window": dict(sliding_window=37, query_len=4),
    "dense": dict(causal=False, query_len=3),
    "dense_window": dict(causal=False, sliding_window=50, query_len=5),
    # A window narrower than the query block: vLLM's |p - k| < w ends before L for the first tokens.
    "dense_window_narrower_than_block": dict(causal=False, sliding_window=3, query_len=8),
    "soft_cap": dict(query_len=3, extra_layer={"logits_soft_cap": 2.5}),
    "soft_cap_dense_window": dict(causal=False, sliding_window=40, query_len=4, extra_layer={"logits_soft_cap": 1.5}),
    "kv_planes_window": dict(layout=LAYOUT_KV_PLANES, sliding_window=20, query_len=2),
    "ragged": dict(query_lens=(1, 6, 2, 9)),
    "fp8_dense": dict(fp8=True, causal=False, query_len=2, q_scale=0.05, k_scale=0.03, v_scale=0.04),
    "fp8_kv_planes": dict(fp8=True, layout=LAYOUT_KV_PLANES, fp8_storage="float8_e4m3fn", k_scale=0.5, v_scale=0.25),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_independent_sdpa(case):
    snap = synth_snapshot(SynthSpec(dtype="float32", num_heads=6, num_kv_heads=2, head_size=32, **CASES[case]))
    got = reference_output(snap)
    want = independent_attention(snap)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_reference_fp32_default_is_close_but_not_exact_dtype():
    snap = synth_snapshot(SynthSpec(dtype="bfloat16", sliding_window=30, query_len=2))
    got = reference_output(snap, exact=False)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), independent_attention(snap), atol=2e-5, rtol=2e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_reference_random_small_cases(data):
    page_size = data.draw(st.sampled_from([4, 8, 16]))
    num_reqs = data.draw(st.integers(1, 4))
    query_len = data.draw(st.integers(1, 4))
    seq_lens = tuple(data.draw(st.integers(query_len, 40)) for _ in range(num_reqs))
    kv_heads = data.draw(st.integers(1, 2))
    spec = SynthSpec(
        seq_lens=seq_lens, query_len=query_len, page_size=page_size, num_kv_heads=kv_heads,
        num_heads=kv_heads * data.draw(st.integers(1, 3)), head_size=data.draw(st.sampled_from([8, 16])),
        causal=data.draw(st.booleans()), sliding_window=data.draw(st.one_of(st.none(), st.integers(1, 24))),
        layout=data.draw(st.sampled_from([LAYOUT_VLLM, LAYOUT_KV_PLANES])), dtype="float32",
        shuffle=data.draw(st.booleans()), seed=data.draw(st.integers(0, 1000)),
    )
    snap = synth_snapshot(spec)
    torch.testing.assert_close(reference_output(snap), independent_attention(snap), atol=1e-10, rtol=1e-10)


def test_reference_chunking_does_not_change_results(monkeypatch):
    snap = synth_snapshot(SynthSpec(seq_lens=tuple(range(20, 340, 20)), query_len=2, dtype="float32"))
    whole = reference_output(snap)
    # Room for the longest request alone: requests are grouped, none is cut along its KV length.
    monkeypatch.setattr(reference_module, "CHUNK_BUDGET_BYTES", 2 * 1024 * 1024)
    md = _reference_metadata(snap)
    assert len(md.chunks) > 3
    assert md.block_pages == md.page_counts
    assert sorted(torch.cat(md.chunks).tolist()) == list(range(len(snap.steps[0].seq_lens)))
    # Other chunks, other reduction shapes: equal to fp64 round-off, not bit for bit.
    torch.testing.assert_close(reference_output(snap), whole, atol=1e-12, rtol=1e-12)


def _reference_metadata(snap: Snapshot, exact: bool = True):
    from kvdbg.replayer.runner import common_metadata

    inst = reference_module.BACKEND.create(snap.meta, ReplayOptions(exact=exact))
    return inst.builder.build(common_metadata(snap, 0))


KV_BLOCK_CASES = {
    "causal": dict(seq_lens=(333, 17, 200), query_len=2),
    # Early KV blocks lie wholly outside the window: rows start with no visible key.
    "causal_window": dict(seq_lens=(333, 90, 200), sliding_window=37, query_len=4),
    "dense_window": dict(seq_lens=(300, 250), causal=False, sliding_window=50, query_len=5),
    "ragged_kv_planes": dict(seq_lens=(300, 41, 129), query_lens=(1, 6, 3), layout=LAYOUT_KV_PLANES),
    "fp8_dense": dict(seq_lens=(280, 33), fp8=True, causal=False, query_len=2, k_scale=0.03, v_scale=0.04),
}


@pytest.mark.parametrize("exact", [True, False], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", sorted(KV_BLOCK_CASES))
def test_reference_kv_length_blocks_equal_one_softmax(case, exact, monkeypatch):
    snap = synth_snapshot(SynthSpec(dtype="float32", num_heads=6, num_kv_heads=2, head_size=32,
                                    **KV_BLOCK_CASES[case]))
    whole = reference_output(snap, exact=exact)
    monkeypatch.setattr(reference_module, "CHUNK_BUDGET_BYTES", 16 * 1024)
    md = _reference_metadata(snap, exact)
    assert any(b < p for b, p in zip(md.block_pages, md.page_counts)), "the budget must cut a request"
    blocked = reference_output(snap, exact=exact)
    tol = 1e-12 if exact else 2e-6
    torch.testing.assert_close(blocked, whole, atol=tol, rtol=tol)
    if exact:
        torch.testing.assert_close(blocked, independent_attention(snap), atol=1e-10, rtol=1e-10)


def test_reference_repeated_page_table_stays_within_budget(monkeypatch):
    """A small file whose table repeats one page: the gather is bounded by the budget, not by seq_len."""
    snap = synth_snapshot(SynthSpec(seq_lens=(4000,), query_len=1, dtype="float32", num_heads=4, num_kv_heads=2,
                                    head_size=16, page_size=16, new_kv=False))
    step = snap.steps[0]
    first = step.block_table[0, 0].item()
    step.block_table[0, :] = first  # every logical page is the same stored page
    keep = snap.page_ids == first
    snap = dataclasses.replace(snap, page_ids=snap.page_ids[keep].clone(),
                               kv_cache=snap.kv_cache[keep].clone())
    whole = reference_output(snap)
    monkeypatch.setattr(reference_module, "CHUNK_BUDGET_BYTES", 32 * 1024)
    md = _reference_metadata(snap)
    per_token_bytes = 8 * (2 * 2 * 16 + 2 * 4 * 1)
    assert md.block_pages[0] * 16 * per_token_bytes <= 32 * 1024 < md.page_counts[0] * 16 * per_token_bytes
    torch.testing.assert_close(reference_output(snap), whole, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(whole, independent_attention(snap), atol=1e-10, rtol=1e-10)


def test_reference_writes_every_query_token_and_only_those():
    snap = synth_snapshot(SynthSpec(query_lens=(0, 3, 1, 2), seq_lens=(5, 30, 17, 40)))
    out = reference_output(snap)
    assert out.shape[0] == 6 and torch.isfinite(out).all()


def _advance(snap: Snapshot, step: int) -> Snapshot:
    """The snapshot an engine would capture right before ``step``: earlier updates applied to the pages."""
    cache = snap.kv_cache.clone()
    for s in range(step):
        apply_step_update(snap, cache, s)
    meta = dataclasses.replace(snap.meta, num_steps=1)
    return Snapshot(meta=meta, kv_cache=cache, page_ids=snap.page_ids.clone(), steps=[snap.steps[step]])


@pytest.mark.parametrize("spec", [
    dict(steps=3, query_len=2, sliding_window=20),
    dict(steps=3, query_lens=(1, 4, 2, 3), causal=False, layout=LAYOUT_KV_PLANES),
    dict(steps=2, fp8=True, query_len=2, k_scale=0.05, v_scale=0.07),
], ids=["causal_window", "dense_seed_ragged", "fp8"])
def test_multistep_replay_equals_replaying_each_captured_step(spec, tmp_path):
    snap = synth_snapshot(SynthSpec(**spec))
    path = save_snapshot(snap, tmp_path / "multi.safetensors")
    loaded = load_snapshot(path)
    before = loaded.kv_cache.clone()
    full = replay(loaded, ["reference", "flex"], ReplayOptions(exact=True))
    assert torch.equal(loaded.kv_cache, before), "replay must not modify the caller's snapshot"
    assert torch.equal(load_snapshot(path).kv_cache, before), "replay must not modify the file"
    for step in range(spec["steps"]):
        single_path = save_snapshot(_advance(loaded, step), tmp_path / f"after{step}.safetensors")
        single = replay(load_snapshot(single_path), ["reference", "flex"], ReplayOptions(exact=True))
        for name in ("reference", "flex"):
            assert_close_ulps(full.steps[step].runs[name].output, single.steps[0].runs[name].output)
        # and the reference of step N is exact against the independent computation of that captured state
        torch.testing.assert_close(single.steps[0].runs["reference"].output, independent_attention(_advance(loaded, step)),
                                   atol=1e-10, rtol=1e-10)


def test_step_selection_still_applies_earlier_updates():
    snap = synth_snapshot(SynthSpec(steps=3, query_len=2, dtype="float32"))
    everything = replay(snap, ["reference"], ReplayOptions(exact=True))
    last_only = replay(snap, ["reference"], ReplayOptions(exact=True), steps=[2])
    assert [s.step for s in last_only.steps] == [2]
    assert_close_ulps(last_only.steps[0].runs["reference"].output, everything.steps[2].runs["reference"].output)
    # without the earlier updates the answer differs: the check above is not vacuous
    stale = _advance(snap, 0)
    stale.steps = [snap.steps[2]]
    assert not torch.allclose(reference_output(stale), everything.steps[2].runs["reference"].output)
