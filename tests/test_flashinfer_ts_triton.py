"""The Triton emulation of the prims_ts contract equals the torch definition (CUDA only)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kvdbg.backends import flashinfer_ts as ts  # noqa: E402
from kvdbg.backends.flashinfer_ts.triton_decode import triton_decode  # noqa: E402
from kvdbg.snapshot.layout import split_kv  # noqa: E402
from kvdbg.snapshot.format import LAYOUT_VLLM  # noqa: E402


def _case(batch, sq, hq, hkv, d, ps, lens, fp8, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages = sum(-(-n // ps) for n in lens) + 3
    page = torch.randn(pages, hkv, ps, 2 * d, generator=gen)
    q = torch.randn(batch, sq, hq, d, generator=gen)
    if fp8:
        page, q = (page * 8).to(torch.float8_e4m3fn), (q * 8).to(torch.float8_e4m3fn)
    else:
        page, q = page.to(torch.bfloat16), q.to(torch.bfloat16)
    page, q = page.cuda(), q.cuda()
    k, v = page[..., :d], page[..., d:]  # token stride 2*D, as vLLM's page
    perm = torch.randperm(pages, generator=gen).tolist()
    width = max(-(-n // ps) for n in lens) + 2
    table = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // ps)
        table[b, :need] = torch.tensor(perm[used:used + need], dtype=torch.int32)
        used += need
    return q, k, v, torch.tensor(lens, dtype=torch.int32).cuda(), table.cuda()


@pytest.mark.parametrize("mask_type,window_left", [("dense", -1), ("causal", -1), ("causal", 40)])
@pytest.mark.parametrize("sq,hq,hkv,d,ps,fp8", [
    (1, 8, 2, 64, 16, False), (8, 4, 1, 64, 16, False), (8, 32, 8, 128, 64, False), (4, 8, 2, 64, 16, True),
    (3, 16, 2, 256, 32, False), (2, 2, 2, 128, 4, False),
])
def test_triton_matches_torch_emulation(mask_type, window_left, sq, hq, hkv, d, ps, fp8):
    lens = [sq, 37, 300, 129, 1000][:4]
    lens[0] = max(lens[0], sq)
    q, k, v, seq_lens, table = _case(4, sq, hq, hkv, d, ps, lens, fp8, seed=sq * 31 + d)
    out_dtype = torch.float16 if fp8 else torch.bfloat16
    a = torch.full((4, sq, hq, d), float("nan"), dtype=out_dtype, device="cuda")
    b = a.clone()
    kwargs = dict(mask_type=mask_type, window_left=window_left, bmm1_scale=0.11, bmm2_scale=0.7,
                  requests=[0, 2, 3])
    ts.emulate_decode(q, k, v, seq_lens, table, out=a, **kwargs)
    triton_decode(q, k, v, seq_lens, table, out=b, **kwargs)
    assert torch.equal(a.isnan(), b.isnan())  # the same rows written (request 1 skipped, empty rows left)
    assert a[~a.isnan()].numel() > 0
    if fp8:
        _assert_fp8_close(b, a, v, bmm2_scale=0.7)
    else:  # one 16-bit rounding step of the output apart at most
        torch.testing.assert_close(b, a, atol=2e-3, rtol=8e-3, equal_nan=True)


@pytest.mark.parametrize("mask_type,window_left", [("dense", -1), ("causal", -1), ("causal", 300)])
@pytest.mark.parametrize("instances,tokens_per_cta,sq,hq,hkv", [(1, 2, 2, 8, 1), (1, 1, 1, 16, 1), (2, 2, 4, 8, 2)])
def test_triton_fp8_follows_the_planners_profile(mask_type, window_left, instances, tokens_per_cta, sq, hq, hkv):
    """head_dim 256: a Keeps profile (one K/V instance) and a Swaps one (two, dealt from the window's first tile)."""
    from kvdbg.ts.planner import DecodeProfile

    profile = DecodeProfile(keeps=instances == 1, tile_q=64 if instances == 1 else 8,
                            q_tokens_per_cta=tokens_per_cta, kv_instances=instances, why="test")
    lens = [max(sq, 700), 37, 400, 1030]
    q, k, v, seq_lens, table = _case(4, sq, hq, hkv, 256, 16, lens, True, seed=instances * 7 + sq)
    a = torch.full((4, sq, hq, 256), float("nan"), dtype=torch.float16, device="cuda")
    b = a.clone()
    kwargs = dict(mask_type=mask_type, window_left=window_left, bmm1_scale=0.006, bmm2_scale=0.7,
                  fp8_profile=profile)
    ts.emulate_decode(q, k, v, seq_lens, table, out=a, **kwargs)
    triton_decode(q, k, v, seq_lens, table, out=b, **kwargs)
    assert torch.equal(a.isnan(), b.isnan()) and a[~a.isnan()].numel() > 0
    _assert_fp8_close(b, a, v, bmm2_scale=0.7)


def _assert_fp8_close(actual, expected, v, *, bmm2_scale):
    """Both emulations round P to e4m3 the same way, from exp() of different libraries: where a probability
    sits on an e4m3 rounding boundary the two may round it apart, moving that output by at most half an e4m3
    step (1/16) of the largest |V|. Such elements must be rare; every other one agrees to output rounding."""
    keep = ~expected.isnan()
    gap = (actual[keep].float() - expected[keep].float()).abs()
    tight = 2e-3 + 8e-3 * expected[keep].float().abs()
    bound = v.float().abs().max() * bmm2_scale / 16 + 2e-3
    assert (gap <= bound).all()
    assert (gap > tight).float().mean() <= 1e-3


def test_replay_on_cuda_says_triton_and_matches_torch(monkeypatch):
    from kvdbg.util.fixtures_path import fixture_path
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.replayer.runner import replay
    from kvdbg.snapshot.store import load_snapshot

    snap = load_snapshot(fixture_path("dflash"))
    by_size = replay(snap, ["flashinfer_ts"], ReplayOptions(device="cuda")).steps[0].runs["flashinfer_ts"]
    assert by_size.info.kernel == ts.EMULATED_KERNEL  # a few MB: the torch loop, and the column says why
    assert any("chosen by size" in note for note in by_size.info.notes)
    monkeypatch.setenv("KVDBG_EMULATION", "triton")
    fast = replay(snap, ["flashinfer_ts"], ReplayOptions(device="cuda")).steps[0].runs["flashinfer_ts"]
    assert fast.info.kernel == ts.EMULATED_KERNEL_TRITON and fast.info.emulated
    monkeypatch.setenv("KVDBG_EMULATION", "torch")
    slow = replay(snap, ["flashinfer_ts"], ReplayOptions(device="cuda")).steps[0].runs["flashinfer_ts"]
    assert slow.info.kernel == ts.EMULATED_KERNEL
    torch.testing.assert_close(fast.output.float(), slow.output.float(), atol=8e-3, rtol=8e-3)


def test_device_mask_selects_the_same_requests_as_a_host_list():
    q, k, v, seq_lens, table = _case(4, 2, 8, 2, 64, 16, [5, 37, 300, 129], False, seed=3)
    kwargs = dict(mask_type="dense", window_left=-1, bmm1_scale=0.1, bmm2_scale=1.0)
    a = torch.full((4, 2, 8, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = a.clone()
    triton_decode(q, k, v, seq_lens, table, out=a, requests=[0, 3], **kwargs)
    triton_decode(q, k, v, seq_lens, table, out=b, valid=torch.tensor([True, False, False, True], device="cuda"),
                  **kwargs)
    assert torch.equal(a.isnan(), b.isnan()) and a[1].isnan().all() and not a[0].isnan().any()
    torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)


def test_dense_request_shorter_than_its_block_is_written_like_the_torch_emulation():
    # seq_len 2 against a block of 4: a dense row sees both keys (FlashInfer bounds query_len only for causal).
    q, k, v, seq_lens, table = _case(3, 4, 8, 2, 64, 16, [2, 37, 300], False, seed=5)
    kwargs = dict(mask_type="dense", window_left=-1, bmm1_scale=0.1, bmm2_scale=1.0)
    a = torch.full((3, 4, 8, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = a.clone()
    ts.emulate_decode(q, k, v, seq_lens, table, out=a, **kwargs)
    triton_decode(q, k, v, seq_lens, table, out=b, **kwargs)
    assert not a.isnan().any() and not b.isnan().any()
    torch.testing.assert_close(b, a, atol=2e-3, rtol=8e-3)


def test_fp8_replay_on_cuda_rounds_p_like_the_torch_emulation(monkeypatch):
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.util.fixtures_path import fixture_path
    from kvdbg.replayer.runner import replay
    from kvdbg.snapshot.store import load_snapshot

    snap = load_snapshot(fixture_path("fp8_dense"))
    monkeypatch.setenv("KVDBG_EMULATION", "triton")
    fast = replay(snap, ["flashinfer_ts"], ReplayOptions(device="cuda")).steps[0].runs["flashinfer_ts"]
    assert fast.info.kernel == ts.EMULATED_KERNEL_TRITON
    monkeypatch.setenv("KVDBG_EMULATION", "torch")
    slow = replay(snap, ["flashinfer_ts"], ReplayOptions(device="cuda")).steps[0].runs["flashinfer_ts"]
    assert slow.info.kernel == ts.EMULATED_KERNEL
    cpu = replay(snap, ["flashinfer_ts"], ReplayOptions()).steps[0].runs["flashinfer_ts"]
    torch.testing.assert_close(slow.output.float().cpu(), cpu.output.float(), atol=8e-3, rtol=8e-3)
    k, v = split_kv(snap.kv_cache, LAYOUT_VLLM, snap.meta.layer.head_size, fp8=True)
    _assert_fp8_close(fast.output.float(), slow.output.float(), v.float() * snap.meta.layer.v_scale,
                      bmm2_scale=1.0)


@pytest.mark.parametrize("lens,sq,mask_type,window_left", [
    ((40, 300, 129), 1, "dense", -1), ((600, 257, 1000), 4, "causal", -1), ((700, 300, 90), 2, "causal", 200),
])
def test_triton_fp8_matches_the_fp8_model_at_flashinfer_tolerance(lens, sq, mask_type, window_left):
    q, k, v, seq_lens, table = _case(3, sq, 8, 2, 64, 16, list(lens), True, seed=sum(lens))
    kwargs = dict(mask_type=mask_type, window_left=window_left, bmm1_scale=0.01, bmm2_scale=0.7)
    a = torch.full((3, sq, 8, 64), float("nan"), dtype=torch.float16, device="cuda")
    b = a.clone()
    ts.emulate_decode(q, k, v, seq_lens, table, out=a, **kwargs)
    triton_decode(q, k, v, seq_lens, table, out=b, **kwargs)
    assert not a.isnan().any()
    _assert_fp8_close(b, a, v, bmm2_scale=0.7)


@pytest.mark.parametrize("mask_type", ["dense", "causal"])
def test_kernel_leaves_out_exactly_the_requests_undefined_codes_names(mask_type):
    """The in-kernel precondition check against the host rule, one request per way to break it."""
    from types import SimpleNamespace

    batch, sq, ps, max_kv_len = 8, 4, 16, 600
    lens = [37, 300, 129, 90, 64, 200, 3, 150]
    q, k, v, seq_lens, table = _case(batch, sq, 8, 2, 64, ps, lens, False, seed=11)
    num_pages, width = k.shape[0], table.shape[1]
    seq_lens[1] = 0  # not positive
    seq_lens[2] = -5  # negative
    seq_lens[3] = max_kv_len + 1  # over max_kv_len (and past the table's width)
    table[4, 1] = num_pages  # a live entry past the cache
    table[5, 0] = -1  # a negative live entry
    table[7, (150 + ps - 1) // ps] = num_pages + 7  # past the live pages: stale, allowed
    # request 6: seq_len 3 < query_len 4 -- undefined only for a causal mask
    md = SimpleNamespace(seq_lens=seq_lens, block_table=table, query_len=sq, max_kv_len=max_kv_len,
                         plan=SimpleNamespace(mask_type=mask_type), causal=mask_type == "causal")
    codes = ts.undefined_codes(md, num_pages, ps)
    expected_written = (codes == 0).cpu()
    assert not expected_written[1:6].any() and expected_written[[0, 7]].all()
    assert bool(expected_written[6]) == (mask_type == "dense")
    out = torch.full((batch, sq, 8, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    triton_decode(q, k, v, seq_lens, table, mask_type=mask_type, window_left=-1, bmm1_scale=0.1, bmm2_scale=1.0,
                  out=out, max_kv_len=max_kv_len)
    written = ~out.isnan().flatten(1).all(dim=1).cpu()
    assert torch.equal(written, expected_written), (width, codes.tolist())


@pytest.mark.parametrize("emulation", ["triton", "torch"])
def test_written_tokens_on_cuda_name_the_requests_the_emulation_left_out(emulation, monkeypatch):
    """written_tokens scans a host copy of the handed metadata; it names the rows the device left unwritten."""
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.moves.synth import SynthSpec, synth_snapshot
    from kvdbg.replayer.runner import replay

    snap = synth_snapshot(SynthSpec(query_lens=(1, 7), seq_lens=(2, 40), causal=True, num_heads=4, num_kv_heads=2,
                                    head_size=64, backend="FLASHINFER_TS", engine_output="reference"))
    monkeypatch.setenv("KVDBG_EMULATION", emulation)
    on_cuda = replay(snap, ["flashinfer_ts"], ReplayOptions(device="cuda")).steps[0].runs["flashinfer_ts"]
    on_cpu = replay(snap, ["flashinfer_ts"], ReplayOptions()).steps[0].runs["flashinfer_ts"]
    assert on_cuda.written.tolist() == on_cpu.written.tolist() == [False] * 4 + [True] * 4
    assert torch.equal(on_cuda.output.isnan().flatten(1).all(dim=1).cpu(), ~on_cuda.written)
