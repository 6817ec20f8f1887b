"""The emulated prims_ts contract against an independent exact attention written here."""

from __future__ import annotations

import pytest
import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.backends import flashinfer_ts as ts
from kvdbg.snapshot.cache import working_cache
from kvdbg.snapshot.layout import split_kv
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.ts.window import exact_visible_range, visibility_table
from kvdbg.replayer.runner import common_metadata
from kvdbg.moves.synth import SynthSpec, synth_snapshot


def exact_attention(snap, cache) -> torch.Tensor:
    """fp64 SDPA with an explicit mask per request, over K/V gathered through the engine's block table."""
    layer, ps = snap.meta.layer, snap.page_size
    step = snap.steps[0]
    k_pages, v_pages = snap.kv_views(cache)
    table = snap.stored_block_table(0)
    query = step.query.view(torch.float8_e4m3fn) if step.query.dtype == torch.uint8 else step.query
    qs, ks, vs = (layer.q_scale, layer.k_scale, layer.v_scale) if layer.is_fp8 else (1.0, 1.0, 1.0)
    group = layer.num_heads // layer.num_kv_heads
    starts = step.query_start_loc.tolist()
    out = torch.zeros(step.num_tokens, layer.num_heads, layer.head_size, dtype=torch.float64)
    for r, length in enumerate(step.seq_lens.tolist()):
        q_len = starts[r + 1] - starts[r]
        pages = table[r, : -(-length // ps)]
        k = k_pages[pages].double().permute(1, 0, 2, 3).reshape(layer.num_kv_heads, -1, layer.head_size)[:, :length] * ks
        v = v_pages[pages].double().permute(1, 0, 2, 3).reshape(layer.num_kv_heads, -1, layer.head_size)[:, :length] * vs
        for i in range(q_len):
            lo, hi = exact_visible_range(length, q_len, i, layer.sliding_window, layer.causal)
            mask = torch.zeros(length, dtype=torch.bool)
            mask[lo:hi] = True
            qt = query[starts[r] + i].double() * qs  # [Hq, D]
            for h in range(layer.num_heads):
                kv = h // group
                s = (k[kv] @ qt[h]) * layer.scale
                p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=0)
                out[starts[r] + i, h] = p @ v[kv]
    return out


def emulated_output(snap):
    inst = ts.create(snap.meta, ReplayOptions(force_emulation=True))
    common = common_metadata(snap, 0)
    md = inst.builder.build(common)
    layer = snap.meta.layer
    out = torch.full((common.num_actual_tokens, layer.num_heads, layer.head_size), float("nan"),
                     dtype=inst.output_dtype)
    cache = working_cache(snap)
    inst.impl.forward(snap.steps[0].query, cache, md, out)
    return inst, md, cache, out


@pytest.mark.parametrize("kw", [
    dict(seq_lens=(9, 77, 200, 333), causal=True),
    dict(seq_lens=(30, 64, 80), causal=True, sliding_window=64),  # every L <= max_kv_len 81
    dict(seq_lens=(30, 64, 79), causal=True, sliding_window=64, query_len=3),
    dict(seq_lens=(9, 77, 200), causal=False, query_len=4),
    dict(seq_lens=(40, 150), causal=False, query_len=2, dtype="float16"),
    dict(seq_lens=(40, 150), fp8=True, q_scale=0.5, k_scale=0.25, v_scale=2.0),
])
def test_emulation_matches_exact_where_nothing_is_restricted(kw):
    snap = synth_snapshot(SynthSpec(head_size=64, num_heads=4, num_kv_heads=2, **kw))
    inst, md, cache, out = emulated_output(snap)
    assert not md.restricted
    assert not torch.isnan(out.float()).any()
    assert out.dtype == getattr(torch, kw.get("dtype", "bfloat16"))
    exact = exact_attention(snap, cache)
    # bf16/fp16 output rounding (and fp16 staging for FP8) is all that separates them.
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=2e-2)
    assert [f.code for f in inst.findings(common_metadata(snap, 0), md) if f.severity == "error"] == []


def test_fp8_scales_are_folded_as_the_kernel_does():
    snap = synth_snapshot(SynthSpec(seq_lens=(60,), head_size=64, num_heads=2, num_kv_heads=1, fp8=True,
                                    q_scale=0.5, k_scale=0.25, v_scale=2.0))
    inst, md, cache, out = emulated_output(snap)
    assert inst.impl.bmm1_scale == pytest.approx(snap.meta.layer.scale * 0.5 * 0.25)
    assert inst.impl.bmm2_scale == 2.0 and md.plan.o_data_type == torch.float16
    unscaled = ts.create(snap.meta, ReplayOptions(force_emulation=True))
    unscaled.impl.bmm2_scale = 1.0
    md2 = unscaled.builder.build(common_metadata(snap, 0))
    out2 = torch.full_like(out, float("nan"))
    unscaled.impl.forward(snap.steps[0].query, cache, md2, out2)
    torch.testing.assert_close(out.float(), 2.0 * out2.float(), atol=1e-2, rtol=1e-2)


def test_dense_window_differs_from_exact_only_by_the_predicted_extra_keys():
    lens, window, q, ps = (9000, 100), 4096, 8, 16
    snap = synth_snapshot(SynthSpec(seq_lens=lens, query_len=q, causal=False, sliding_window=window, page_size=ps,
                                    num_heads=2, num_kv_heads=1, head_size=64))
    inst, md, cache, out = emulated_output(snap)
    assert md.restricted and int(md.start_page[0]) > 0
    exact = exact_attention(snap, cache)
    k_cache, v_cache = split_kv(cache, LAYOUT_VLLM, 64, fp8=False)
    query = snap.steps[0].query.reshape(2, q, 2, 64)
    plan = md.plan

    def run(key_mask=None):
        result = torch.full((2, q, 2, 64), float("nan"), dtype=torch.float32)
        ts.emulate_decode(query, k_cache, v_cache, md.seq_lens, md.block_table, mask_type=plan.mask_type,
                          window_left=plan.window_left, bmm1_scale=inst.impl.bmm1_scale,
                          bmm2_scale=inst.impl.bmm2_scale, out=result, key_mask=key_mask)
        return result.reshape(2 * q, 2, 64).double()

    plain = run()
    # The backend's own output is this emulation, rounded to the model dtype.
    torch.testing.assert_close(out.float(), plain.float().to(out.dtype).float())

    # The paging math predicts how many keys at the front of the kernel's range each token should not see.
    extras = {r: [t.extra for t in visibility_table(n, window, q, ps, causal=False).tokens] for r, n in enumerate(lens)}
    first_kept = [int(s) * ps for s in md.start_page]
    for r, n in enumerate(lens):
        for i in range(q):
            lo, _ = exact_visible_range(n, q, i, window, causal=False)
            assert extras[r][i] == max(0, lo - first_kept[r])
    assert extras[0] == [1 + i for i in range(q)] and extras[1] == [0] * q

    def hide_extras(b):
        keys = torch.arange(int(md.seq_lens[b])).unsqueeze(0)
        return keys >= torch.tensor(extras[b]).unsqueeze(1)

    masked = run(hide_extras)
    torch.testing.assert_close(masked, exact, atol=2e-5, rtol=1e-4)
    # Without the mask the long request is off by the extra keys; the short one was never restricted.
    gap = (plain - exact).abs()
    assert gap[:q].max() > 1e-4
    torch.testing.assert_close(plain[q:], exact[q:], atol=2e-5, rtol=1e-4)


def test_causal_bottom_right_alignment_and_window_left_directly():
    # One page, four keys with distinct values: which keys a row averages shows the mask.
    k = torch.zeros(1, 1, 4, 1)
    v = torch.tensor([1.0, 10.0, 100.0, 1000.0]).view(1, 1, 4, 1)
    q = torch.zeros(1, 2, 1, 1)  # equal logits: each row is the mean of what it sees
    table = torch.tensor([[0]], dtype=torch.int32)
    lens = torch.tensor([4], dtype=torch.int32)

    def run(mask_type, window_left):
        out = torch.full((1, 2, 1, 1), float("nan"))
        ts.emulate_decode(q, k, v, lens, table, mask_type=mask_type, window_left=window_left, bmm1_scale=1.0,
                          bmm2_scale=1.0, out=out)
        return out.flatten().tolist()

    assert run("dense", -1) == pytest.approx([277.75, 277.75])
    assert run("causal", -1) == pytest.approx([111 / 3, 277.75])  # rows see keys [0, 2] and [0, 3]
    assert run("causal", 1) == pytest.approx([55.0, 550.0])  # the last window_left + 1 keys up to p
