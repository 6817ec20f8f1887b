"""FLASHINFER_TS held to FlashInfer 0.7.1-0.7.4's own rules (issue 14): each test states the rule it checks."""

from __future__ import annotations

import math

import pytest
import torch

from kvdbg.ts import contract
from kvdbg.backends.base import ReplayOptions
from kvdbg.backends import flashinfer_ts as ts
from kvdbg.backends.flashinfer_ts import gate as ts_gate
from kvdbg.snapshot.cache import working_cache
from kvdbg.snapshot.layout import split_kv
from kvdbg.judge.compare import default_tolerance
from kvdbg.errors import BackendUnavailable
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.replayer.runner import common_metadata, replay
from kvdbg.moves.synth import SynthSpec, synth_snapshot

from tests.helpers import assert_close_ulps


def _emulated(snap, step=0):
    inst = ts.create(snap.meta, ReplayOptions(force_emulation=True))
    common = common_metadata(snap, step)
    md = inst.builder.build(common)
    layer = snap.meta.layer
    out = torch.full((common.num_actual_tokens, layer.num_heads, layer.head_size), float("nan"),
                     dtype=inst.output_dtype)
    cache = working_cache(snap)
    inst.impl.forward(snap.steps[step].query, cache, md, out)
    return inst, common, md, cache, out


# --------------------------------------------------------------------------- 1. dense rows with seq_len < block


def test_dense_request_shorter_than_its_block_is_computed_over_all_its_keys():
    """run(validate=True) bounds query_len <= seq_len only for causal; a dense row sees every key < seq_len.

    Ragged blocks 1 and 7 make a uniform block of 4; request 0 has seq_len 2 < 4.
    """
    snap = synth_snapshot(SynthSpec(query_lens=(1, 7), seq_lens=(2, 40), causal=False, num_heads=4,
                                    num_kv_heads=2, head_size=64, backend="FLASHINFER_TS",
                                    engine_output="reference"))
    inst, common, md, cache, out = _emulated(snap)
    assert md.query_len == 4 and md.seq_lens.tolist() == [2, 40]
    codes = {(f.code, f.request) for f in inst.findings(common, md)}
    assert not any(code in ("seq_len_below_query_len", "seq_len_not_positive") for code, _ in codes)
    assert inst.written_tokens(common, md).all()
    assert not torch.isnan(out.float()).any()

    # What the kernel computes for block 0 (flat tokens 0..3, as it views the query): every row over keys 0 and 1.
    k, v = split_kv(cache, LAYOUT_VLLM, 64, fp8=False)
    pages = md.block_table[0, :1].long()
    keys = k[pages].float().permute(1, 0, 2, 3).reshape(2, -1, 64)[:, :2]
    values = v[pages].float().permute(1, 0, 2, 3).reshape(2, -1, 64)[:, :2]
    query = snap.steps[0].query[:4].float()  # [4, Hq, D]
    expected = torch.empty(4, 4, 64)
    for h in range(4):
        weights = torch.softmax(query[:, h] @ keys[h // 2].T * snap.meta.layer.scale, dim=-1)
        expected[:, h] = weights @ values[h // 2]
    assert_close_ulps(out[:4].float(), expected.to(out.dtype).float(), ulps=2)


def test_causal_request_shorter_than_its_block_stays_undefined():
    snap = synth_snapshot(SynthSpec(query_lens=(1, 7), seq_lens=(2, 40), causal=True, num_heads=4,
                                    num_kv_heads=2, head_size=64, backend="FLASHINFER_TS",
                                    engine_output="reference"))
    inst, common, md, _, out = _emulated(snap)
    assert ("seq_len_below_query_len", 0) in {(f.code, f.request) for f in inst.findings(common, md)}
    written = inst.written_tokens(common, md)
    assert not written[:4].any() and written[4:].all()
    assert torch.isnan(out[:4].float()).all()


def test_contract_bounds_query_len_only_for_causal():
    common = dict(request=0, seq_len=2, query_len=4, max_kv_len=100, table_width=1, page_size=16)
    assert contract.check_request(**common, mask_type="dense") == []
    assert [v.code for v in contract.check_request(**common, mask_type="causal")] == ["seq_len_below_query_len"]


def test_nonpositive_seq_len_is_an_error_before_0_7_4_and_inactive_after():
    common = dict(request=1, seq_len=0, query_len=1, max_kv_len=100, table_width=1, page_size=16,
                  mask_type="dense")
    assert [v.code for v in contract.check_request(**common, api=contract.API_0_7_1)] == ["seq_len_not_positive"]
    assert contract.check_request(**common, api=contract.API_0_7_4) == []


# --------------------------------------------------------------------------- 2. FP8 P rounding


def _fp8_model(q, k_cache, v_cache, seq_lens, table, *, mask_type, window_left, bmm1_scale, bmm2_scale,
               instances=2, tokens_per_cta=1):
    """Independent model of prims_ts's FP8 path at split count 1, written as the kernel streams it.

    Per query row and head: 128-key tiles; the kernel skips whole tiles before the window of the row's CTA (whose
    first token is the row's token rounded down to a multiple of ``tokens_per_cta``) and deals the rest in turn
    to ``instances`` K/V instances, each with its own running max m, sum l and accumulator; each tile's
    P = 448 * exp(s - m_new) is rounded to e4m3 for P.V while l adds the unrounded P; the instances are merged
    at the end.
    """
    batch, sq, hq, d = q.shape
    hkv, ps = k_cache.shape[1], k_cache.shape[2]
    out = torch.full((batch, sq, hq, d), float("nan"))
    for b in range(batch):
        length = int(seq_lens[b])
        pages = table[b, : -(-length // ps)].long()
        keys = k_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        values = v_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        for i in range(sq):
            end = length if mask_type == "dense" else length - sq + i + 1
            begin = 0 if window_left < 0 else max(0, end - window_left - 1)
            cta_token = i // tokens_per_cta * tokens_per_cta
            skip = 0 if window_left < 0 or mask_type == "dense" else \
                max(0, length - sq + cta_token - window_left) // 128
            for h in range(hq):
                s = (keys[h // (hq // hkv)] @ q[b, i, h].float()) * bmm1_scale
                s[:begin] = float("-inf")
                s[end:] = float("-inf")
                state = [[float("-inf"), 0.0, torch.zeros(d)] for _ in range(instances)]
                for t in range(skip, -(-length // 128)):
                    m, l, acc = state[(t - skip) % instances]
                    tile = s[t * 128:(t + 1) * 128]
                    m_new = max(m, float(tile.max()))
                    if m_new == float("-inf"):
                        continue
                    p = torch.exp(tile - m_new) * 448.0
                    p8 = p.to(torch.float8_e4m3fn).float()
                    scale = math.exp(m - m_new) if m != float("-inf") else 0.0
                    state[(t - skip) % instances] = [m_new, l * scale + float(p.sum()),
                                                     acc * scale + p8 @ values[h // (hq // hkv), t * 128:(t + 1) * 128]]
                top = max(st[0] for st in state)
                if top == float("-inf"):
                    continue
                total = sum(st[1] * math.exp(st[0] - top) for st in state if st[0] != float("-inf"))
                acc = sum(st[2] * math.exp(st[0] - top) for st in state if st[0] != float("-inf"))
                out[b, i, h] = acc / total * bmm2_scale
    return out


def _fp8_case(seed, lens, sq, hq, hkv, d=64, ps=16):
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // ps) for n in lens) + 2
    cache = (torch.randn(pages, hkv, ps, 2 * d, generator=gen) * 3).to(torch.float8_e4m3fn)
    q = (torch.randn(len(lens), sq, hq, d, generator=gen) * 3).to(torch.float8_e4m3fn)
    perm = torch.randperm(pages, generator=gen)
    width = max(-(-n // ps) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // ps)
        table[b, :need] = perm[used:used + need].to(torch.int32)
        used += need
    k, v = split_kv(cache, LAYOUT_VLLM, d, fp8=True)
    return q, k, v, torch.tensor(lens, dtype=torch.int32), table


# FlashInfer's own decode test holds FP8 Q/K/V -> fp16 output to its P-rounding model at this tolerance.
FP8_FP16_RTOL, FP8_FP16_ATOL = 1e-3, 2.5e-4


@pytest.mark.parametrize("seed,lens,sq,hq,hkv,mask_type,window_left", [
    (1, (40, 300), 1, 4, 2, "dense", -1),
    (2, (129, 600, 257), 4, 8, 2, "dense", -1),
    (3, (300, 513), 4, 4, 1, "causal", -1),
    (4, (700, 90), 2, 8, 8, "causal", 200),
])
def test_fp8_emulation_is_the_p_rounding_model_within_flashinfer_tolerance(seed, lens, sq, hq, hkv, mask_type,
                                                                            window_left):
    q, k, v, seq_lens, table = _fp8_case(seed, lens, sq, hq, hkv)
    scales = dict(bmm1_scale=0.02, bmm2_scale=0.7)
    out = torch.full(q.shape, float("nan"), dtype=torch.float16)
    ts.emulate_decode(q, k, v, seq_lens, table, mask_type=mask_type, window_left=window_left, out=out, **scales)
    model = _fp8_model(q, k, v, seq_lens, table, mask_type=mask_type, window_left=window_left, **scales)
    torch.testing.assert_close(out.float(), model, rtol=FP8_FP16_RTOL, atol=FP8_FP16_ATOL)
    # Unrounded P is measurably elsewhere: the rounding is what the model is about.
    exact = torch.full(q.shape, float("nan"), dtype=torch.float32)
    ts.emulate_decode(q, k, v, seq_lens, table, mask_type=mask_type, window_left=window_left, out=exact,
                      fp8_p=False, **scales)
    assert (exact - model).abs().max() > 10 * FP8_FP16_ATOL


@pytest.mark.parametrize("seed,lens,sq,hq,hkv,mask_type,window_left,instances,tokens_per_cta", [
    # head_dim 256, a Keeps tile: one K/V instance, so every tile is rounded against one running max.
    (5, (500, 90), 1, 64, 1, "dense", -1, 1, 1),
    (6, (600, 130), 8, 16, 2, "causal", -1, 1, 8),
    # A Swaps profile at head_dim 256 keeps two instances; with a window they are dealt from its first tile.
    (7, (900, 300), 1, 8, 2, "causal", 300, 2, 1),
    (8, (1000, 640), 4, 8, 2, "causal", 260, 2, 2),
])
def test_fp8_head_dim_256_is_the_p_rounding_model_of_its_profile(seed, lens, sq, hq, hkv, mask_type, window_left,
                                                                 instances, tokens_per_cta):
    from kvdbg.ts.planner import DecodeProfile

    q, k, v, seq_lens, table = _fp8_case(seed, lens, sq, hq, hkv, d=256)
    scales = dict(bmm1_scale=0.006, bmm2_scale=0.7)
    profile = DecodeProfile(keeps=instances == 1, tile_q=64 if instances == 1 else 8,
                            q_tokens_per_cta=tokens_per_cta, kv_instances=instances, why="test")
    out = torch.full(q.shape, float("nan"), dtype=torch.float16)
    ts.emulate_decode(q, k, v, seq_lens, table, mask_type=mask_type, window_left=window_left, out=out,
                      fp8_profile=profile, **scales)
    args = dict(mask_type=mask_type, window_left=window_left, **scales)
    model = _fp8_model(q, k, v, seq_lens, table, instances=instances, tokens_per_cta=tokens_per_cta, **args)
    torch.testing.assert_close(out.float(), model, rtol=FP8_FP16_RTOL, atol=FP8_FP16_ATOL)
    # The other instance count rounds P against other maxima: measurably elsewhere, so the profile matters.
    other = _fp8_model(q, k, v, seq_lens, table, instances=3 - instances, tokens_per_cta=tokens_per_cta, **args)
    assert (other - model).abs().max() > 10 * FP8_FP16_ATOL


def test_the_replay_rounds_p_with_the_profile_the_planner_picks():
    """Through the builder: head_dim 256 with 64 query heads per KV head plans a Keeps tile (one instance)."""
    from kvdbg.ts.planner import fp8_decode_profile

    snap = synth_snapshot(SynthSpec(seq_lens=(700, 300), num_heads=64, num_kv_heads=1, head_size=256, fp8=True,
                                    causal=False, q_scale=0.05, k_scale=0.03, v_scale=0.04))
    inst, common, md, cache, out = _emulated(snap)
    assert md.fp8_profile == fp8_decode_profile(head_dim=256, query_len=1, heads_per_kv=64, batch_size=2,
                                                num_kv_heads=1, max_kv_len=md.max_kv_len, window_left=-1)
    assert md.fp8_profile.kv_instances == 1
    k, v = split_kv(cache, LAYOUT_VLLM, 256, fp8=True)
    q = inst.impl.kernel_query(snap.steps[0].query).reshape(2, 1, 64, 256)
    model = _fp8_model(q, k, v, md.seq_lens, md.block_table, mask_type="dense", window_left=-1,
                       bmm1_scale=inst.impl.bmm1_scale, bmm2_scale=inst.impl.bmm2_scale, instances=1)
    torch.testing.assert_close(out.float().view(2, 1, 64, 256), model.to(torch.float16).to(out.dtype).float(),
                               rtol=FP8_FP16_RTOL, atol=FP8_FP16_ATOL)
    notes = " ".join(inst.describe().notes)
    assert "Keeps Q64 profile, one K/V instance" in notes


def test_fp8_fixture_emulation_is_the_p_rounding_model():
    from kvdbg.util.fixtures_path import fixture_path
    from kvdbg.snapshot.store import load_snapshot

    snap = load_snapshot(fixture_path("fp8_dense"))
    inst = ts.create(snap.meta, ReplayOptions(force_emulation=True))
    md = inst.builder.build(common_metadata(snap, 0))
    k, v = split_kv(working_cache(snap), LAYOUT_VLLM, snap.meta.layer.head_size, fp8=True)
    hq, d = snap.meta.layer.num_heads, snap.meta.layer.head_size
    q = inst.impl.kernel_query(snap.steps[0].query[: md.num_actual_tokens]).reshape(md.num_reqs, md.query_len, hq, d)
    args = dict(mask_type=md.plan.mask_type, window_left=md.plan.window_left, bmm1_scale=inst.impl.bmm1_scale,
                bmm2_scale=inst.impl.bmm2_scale)
    out = torch.full(q.shape, float("nan"), dtype=md.plan.o_data_type)
    ts.emulate_decode(q, k, v, md.seq_lens, md.block_table, out=out, **args)
    model = _fp8_model(q, k, v, md.seq_lens, md.block_table, **args)
    torch.testing.assert_close(out.float(), model, rtol=FP8_FP16_RTOL, atol=FP8_FP16_ATOL)


def test_fp8_column_and_tolerance_state_the_split_count_caveat():
    snap = synth_snapshot(SynthSpec(seq_lens=(40,), fp8=True, head_size=64, num_heads=2, num_kv_heads=1))
    notes = " ".join(ts.create(snap.meta, ReplayOptions(force_emulation=True)).describe().notes)
    assert "e4m3" in notes and "split count 1" in notes and "order 1e-2" not in notes
    source = default_tolerance("bfloat16", fp8=True).source
    assert "e4m3" in source and "split" in source


# --------------------------------------------------------------------------- 3. GQA geometry


def test_head_ratio_above_128_and_indivisible_heads_are_plan_rejections():
    snap = synth_snapshot(SynthSpec(seq_lens=(20,), num_heads=256, num_kv_heads=1, head_size=64))
    reason = ts.BACKEND.unsupported_reason(snap.meta)
    assert reason is not None and "256" in reason and "128" in reason and "_validate_head_geometry" in reason
    with pytest.raises(BackendUnavailable):
        ts.create(snap.meta, ReplayOptions(force_emulation=True))
    result = replay(snap, ["reference", "flashinfer_ts"])
    assert not {s.name: s for s in result.backends}["flashinfer_ts"].available
    assert contract.check_heads(128, 1) == [] and contract.check_heads(256, 2) == []
    assert [v.code for v in contract.check_heads(256, 1)] == ["head_ratio_unsupported"]
    assert [v.code for v in contract.check_heads(12, 8)] == ["heads_not_divisible"]


# --------------------------------------------------------------------------- 4. K/V view strides


def test_k_and_v_may_have_different_strides():
    k = torch.zeros(3, 2, 16, 64, dtype=torch.bfloat16)  # compact
    v = split_kv(torch.zeros(3, 2, 16, 128, dtype=torch.bfloat16), LAYOUT_VLLM, 64, fp8=False)[1]  # token stride 2*D
    assert k.stride() != v.stride()
    assert ts.view_violations(k, v, 64) == []


def test_page_and_head_strides_must_be_16_byte_multiples():
    flat = torch.zeros(4 * 3000, dtype=torch.bfloat16)
    odd_page = flat.as_strided((3, 2, 16, 64), (2 * 16 * 64 + 4, 16 * 64, 64, 1))  # 4104-byte page stride
    assert [x.code for x in ts.view_violations(odd_page, odd_page, 64)] == ["kv_stride_misaligned"] * 2
    odd_head = flat.as_strided((3, 2, 16, 64), (4096, 16 * 64 + 4, 64, 1))
    assert "kv_stride_misaligned" in [x.code for x in ts.view_violations(odd_head, odd_head, 64)]


def test_overlapping_dimensions_are_refused():
    flat = torch.zeros(4 * 3000, dtype=torch.bfloat16)
    # Heads 512 elements apart while one head's 16 tokens of 64 span 1024: head 1 overwrites head 0's tokens.
    overlap = flat.as_strided((3, 2, 16, 64), (4096, 512, 64, 1))
    assert "kv_dims_overlap" in [x.code for x in ts.view_violations(overlap, overlap, 64)]
    # The rule sorts dimensions by stride: a page stride smaller than the head stride is fine if it clears it.
    assert contract.check_kv_view("K", (3, 2, 16, 64), (1024, 3072, 64, 1), 2, 0) == []


def test_base_address_is_checked_relative_to_the_page_tensor():
    full = torch.zeros(3, 2, 16, 2 * 64 + 8, dtype=torch.bfloat16)  # 272-byte tokens: strides stay aligned
    page = full[..., 4:]  # K starts 8 bytes into each engine page
    codes = [x.code for x in ts.view_violations(page[..., :64], page[..., 64:128], 64, base=full)]
    assert codes == ["kv_base_misaligned", "kv_base_misaligned"]
    vllm_page = torch.zeros(3, 2, 16, 128, dtype=torch.bfloat16)
    assert ts.view_violations(*split_kv(vllm_page, LAYOUT_VLLM, 64, fp8=False), 64, base=vllm_page) == []


# --------------------------------------------------------------------------- 5. q/out rank for query length 1


def test_length_1_query_rank_is_flagged_unverified_in_findings_and_explain():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 77), head_size=64, num_heads=4, num_kv_heads=2))
    inst, common, md, _, _ = _emulated(snap)
    found = {f.code: f for f in inst.findings(common, md)}
    assert found["q_rank_sq1_unverified"].severity == "info"
    assert "_validate_q" in found["q_rank_sq1_unverified"].message and "unverified" in found[
        "q_rank_sq1_unverified"].message
    rows = inst.explain(common, md)
    assert all("_validate_q" in row["preconditions"] and "unverified" in row["preconditions"] for row in rows)
    longer = synth_snapshot(SynthSpec(seq_lens=(40, 77), query_len=2, head_size=64, num_heads=4, num_kv_heads=2))
    inst, common, md, _, _ = _emulated(longer)
    assert "q_rank_sq1_unverified" not in {f.code for f in inst.findings(common, md)}


def test_explain_names_the_flashinfer_path_and_each_precondition_source():
    snap = synth_snapshot(SynthSpec(seq_lens=(300, 50), causal=True, sliding_window=64, query_len=2,
                                    head_size=64, num_heads=4, num_kv_heads=2))
    inst, common, md, _, _ = _emulated(snap)
    rows = inst.explain(common, md)
    assert all("flashinfer_path" in row for row in rows)
    assert "_validate_decode_run_metadata_values" in rows[0]["preconditions"]
    assert "BROKEN" in rows[0]["preconditions"] and "BROKEN" not in rows[1]["preconditions"]
    for source in ("_validate_head_geometry", "_validate_head_dim", "_validate_native_hnd_tma_strides"):
        assert source in rows[0]["layer_preconditions"]
    assert "BROKEN" not in rows[0]["layer_preconditions"]


# --------------------------------------------------------------------------- 6. API drift


class _Wrapper071:
    """BatchDecodePagedTSWrapper's 0.7.1-0.7.2 keywords (signatures only, no computation)."""

    def __init__(self, kv_layout="HND"):
        self.kv_layout, self.plans, self.runs = kv_layout, [], []

    def plan(self, device, batch_size, num_qo_heads, num_kv_heads, head_dim, page_size, max_kv_len, *,
             max_seq_len_q=1, packed_query=False, q_data_type=torch.float16, k_data_type=None, v_data_type=None,
             kv_data_type=None, o_data_type=None, mask_type="dense", window_left=-1, seq_lens=None,
             workspace_buffer=None, storage_page_size=None, split_kv=True, validate=True,
             initialize_workspace=True):
        self.plans.append(dict(locals()))

    def run(self, q, paged_kv_cache, seq_lens, block_tables, *, kv_scale_factors=None, qo_indptr=None,
            bmm1_scale=None, bmm2_scale=1.0, out=None, validate=True):
        self.runs.append(dict(locals()))
        out.fill_(0.25)
        return out


class _Wrapper074(_Wrapper071):
    """0.7.4's renamed keywords, with no aliases for the old ones."""

    def plan(self, device, batch_size, num_qo_heads, num_kv_heads, head_dim, page_size, max_kv_len, *,
             max_q_len=None, packed_query=False, q_dtype=torch.float16, k_dtype=None, v_dtype=None, kv_dtype=None,
             out_dtype=None, mask_type="dense", lse_mode="none", use_attention_sinks=False, window_left=-1,
             seq_lens_kv=None, workspace_buffer=None, storage_page_size=None, split_kv=True, validate=True,
             initialize_workspace=True):
        self.plans.append(dict(locals()))

    def run(self, q, paged_kv_cache, seq_lens_kv, block_tables, *, kv_scale_factors=None, qo_indptr=None,
            softmax_scale=None, output_scale=1.0, max_q_len=None, max_kv_len=None, out=None, lse=None,
            return_lse=False, attention_sinks=None, validate=True):
        self.runs.append(dict(locals()))
        out.fill_(0.25)
        return out


def _run_real(monkeypatch, version, wrapper_cls):
    """Replay through the real-kernel path with ``wrapper_cls`` standing in for flashinfer ``version`` on a B200."""
    made = []

    def factory(kv_layout):
        made.append(wrapper_cls(kv_layout))
        return made[-1]

    monkeypatch.setattr(ts_gate, "_import_prims_ts", lambda: (factory, version))
    monkeypatch.setattr(ts_gate, "_probe_device", lambda device: ((10, 0), None))
    gate = ts.kernel_gate("cuda")
    assert gate.available
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 77), query_len=2, causal=False, num_heads=4, num_kv_heads=2,
                                    head_size=64, fp8=True, q_scale=0.5, k_scale=0.25, v_scale=2.0))
    inst = ts.create(snap.meta, ReplayOptions(), gate=gate)
    md = inst.builder.build(common_metadata(snap, 0))
    out = torch.full((4, 4, 64), float("nan"), dtype=torch.bfloat16)
    inst.impl.forward(snap.steps[0].query, working_cache(snap), md, out)
    assert torch.all(out == 0.25)
    return inst, made[0]


@pytest.mark.parametrize("version", ["0.7.1", "0.7.2"])
def test_0_7_1_generation_is_called_with_the_seed_keywords(monkeypatch, version):
    inst, wrapper = _run_real(monkeypatch, version, _Wrapper071)
    plan, run = wrapper.plans[0], wrapper.runs[0]
    assert plan["max_seq_len_q"] == 2 and plan["q_data_type"] == torch.float8_e4m3fn
    assert plan["o_data_type"] == torch.float16 and plan["mask_type"] == "dense"
    assert run["bmm2_scale"] == 2.0 and run["validate"] is False and run["seq_lens"].tolist() == [40, 77]
    assert "0.7.1-0.7.2 API" in inst.describe().notes[0]


@pytest.mark.parametrize("version", ["0.7.4", "0.7.4.post1"])
def test_0_7_4_generation_is_called_with_the_renamed_keywords(monkeypatch, version):
    inst, wrapper = _run_real(monkeypatch, version, _Wrapper074)
    plan, run = wrapper.plans[0], wrapper.runs[0]
    assert plan["max_q_len"] == 2 and plan["q_dtype"] == plan["kv_dtype"] == torch.float8_e4m3fn
    assert plan["out_dtype"] == torch.float16
    assert run["seq_lens_kv"].tolist() == [40, 77] and run["output_scale"] == 2.0
    assert run["softmax_scale"] == pytest.approx(inst.impl.bmm1_scale)
    assert "0.7.4+ API" in inst.describe().notes[0] and "newer" not in inst.describe().notes[0]


def test_old_keywords_on_0_7_4_raise_as_flashinfer_would():
    with pytest.raises(TypeError):
        _Wrapper074().plan("cuda", 1, 4, 2, 64, 16, 100, max_seq_len_q=1)


def test_unknown_newer_version_uses_the_newest_mapping_and_says_so(monkeypatch):
    inst, wrapper = _run_real(monkeypatch, "0.8.0", _Wrapper074)
    assert "max_q_len" in wrapper.plans[0] and "seq_lens_kv" in wrapper.runs[0]
    note = inst.describe().notes[0]
    assert "0.8.0 is newer than 0.7.4" in note and "not verified" in note


def test_0_7_0_post1_refusal_names_its_compact_stride_requirement(monkeypatch):
    monkeypatch.setattr(ts_gate, "_import_prims_ts", lambda: (object, "0.7.0.post1"))
    gate = ts.kernel_gate("cpu")
    assert not gate.available and "0.7.0.post1 is too old" in gate.reason
    assert "compact" in gate.reason and "2*D" in gate.reason
