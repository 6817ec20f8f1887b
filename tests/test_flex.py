"""FLEX_ATTENTION replay against the reference, vLLM's map quirks as findings, the direct BlockMask."""

from __future__ import annotations

import pytest
import torch

import kvdbg.backends.flex as flex_module
from kvdbg.backends.base import ReplayOptions
from kvdbg.judge.compare import compare_step
from kvdbg.snapshot.format import LAYOUT_KV_PLANES
from kvdbg.replayer.runner import common_metadata, replay
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from tests.helpers import assert_close_ulps

SPECS = {
    "causal_decode": dict(),
    "causal_window": dict(sliding_window=40, query_len=5),
    "dense": dict(causal=False, query_len=3),
    "dense_window": dict(causal=False, sliding_window=50, query_len=4),
    "kv_planes_layout": dict(layout=LAYOUT_KV_PLANES, query_len=2, sliding_window=33),
    "ragged_fp16": dict(dtype="float16", query_lens=(1, 7, 3, 20)),
    "fp32_window": dict(dtype="float32", sliding_window=17, query_len=3),
    "shared_prefix": dict(shared_prefix_pages=1, query_len=2, seq_lens=(40, 77, 200, 333)),
    "stale_tail": dict(stale_tail=4, query_len=2),
    "fp8": dict(fp8=True, query_len=2, q_scale=0.05, k_scale=0.03, v_scale=0.04),
    "page_size_8": dict(page_size=8, query_len=2, causal=False),
}


def _run(snap, **options):
    result = replay(snap, ["reference", "flex"], ReplayOptions(**options))
    step = result.steps[0]
    (comparison,) = compare_step(step, snap.meta)
    return result, step, comparison


@pytest.mark.parametrize("name", sorted(SPECS))
def test_flex_matches_reference(name):
    snap = synth_snapshot(SynthSpec(**SPECS[name]))
    result, step, comparison = _run(snap)
    assert comparison.passed, [(h.request, h.head, h.max_abs) for h in comparison.failed]
    assert not [f for f in step.runs["flex"].findings if f.severity == "error"]
    assert torch.isfinite(step.runs["flex"].output).all()
    info = step.runs["flex"].info
    assert info.kernel == "flex_attention (eager)" and info.device == "cpu" and not info.compiled
    assert info.dtype == snap.meta.layer.dtype


def test_fp8_is_dequantised_and_says_so():
    snap = synth_snapshot(SynthSpec(**SPECS["fp8"]))
    _, step, _ = _run(snap)
    assert any("dequantises" in note for note in step.runs["flex"].info.notes)
    assert {f.code for f in step.runs["flex"].findings} == {"fp8_dequantised"}


@pytest.mark.parametrize("request_with_zero", [0, 2])
def test_null_page_silently_masked_only_for_that_request(request_with_zero):
    snap = synth_snapshot(SynthSpec(use_page_zero=True, page_zero_request=request_with_zero, query_len=2))
    _, step, comparison = _run(snap)
    failing = {(h.request, h.head) for h in comparison.failed}
    assert failing == {(request_with_zero, h) for h in range(snap.meta.layer.num_heads)}
    (finding,) = [f for f in step.runs["flex"].findings if f.code == "live_page_zero"]
    assert finding.severity == "error" and finding.request == request_with_zero
    (col,) = finding.details["logical_blocks"]
    length = int(snap.steps[0].seq_lens[request_with_zero])
    assert finding.details["hidden_keys"] == min(snap.page_size, length - col * snap.page_size)


def test_page_mapped_twice_keeps_last_block_and_is_reported():
    snap = synth_snapshot(SynthSpec(query_len=2, seq_lens=(40, 77, 200)))
    table = snap.steps[0].block_table.clone()
    table[1, 1] = table[1, 3]  # the same engine page at logical blocks 1 and 3 of request 1
    snap.steps[0].block_table = table
    _, step, comparison = _run(snap)
    assert {h.request for h in comparison.failed} == {1}
    (finding,) = [f for f in step.runs["flex"].findings if f.code == "page_mapped_twice"]
    assert finding.request == 1 and finding.details["logical_blocks"] == [1, 3] and finding.details["kept"] == 3
    assert finding.details["hidden_keys"] == snap.page_size and finding.details["masked_blocks"] == [1]
    assert step.runs["flex"].explain[1]["lost_blocks"] == 1


def test_physical_to_logical_ignores_entries_past_live_pages_and_the_null_page():
    snap = synth_snapshot(SynthSpec(stale_tail=3, use_page_zero=True, page_zero_request=1, query_len=1))
    common = common_metadata(snap, 0)
    md = flex_module.FlexBuilder(snap.meta).build(common)
    p2l = md.physical_to_logical
    live = (common.seq_lens + snap.page_size - 1) // snap.page_size
    for r in range(common.num_reqs):
        expected = torch.full((common.num_pages,), -1, dtype=torch.int64)
        for col in range(int(live[r])):
            expected[int(common.block_table[r, col])] = col
        expected[common.null_page] = -1
        assert torch.equal(p2l[r], expected), r


def test_block_mask_lists_each_query_blocks_pages_once():
    snap = synth_snapshot(SynthSpec(query_lens=(3, 20, 1, 9), seq_lens=(30, 90, 17, 200), stale_tail=2))
    common = common_metadata(snap, 0)
    md = flex_module.FlexBuilder(snap.meta).build(common)
    span = -(-common.max_seq_len // snap.page_size)
    for qb in range(md.kv_num_blocks.numel()):
        listed = md.kv_indices[qb, : int(md.kv_num_blocks[qb])].tolist()
        assert len(listed) == len(set(listed))
        toks = range(qb * md.q_block_size, min((qb + 1) * md.q_block_size, common.num_actual_tokens))
        reqs = {int(md.doc_ids[t]) for t in toks}
        want = {int(p) for r in reqs for p in common.block_table[r, :span].tolist() if p >= 0}
        assert set(listed) == want
    assert md.block_mask.BLOCK_SIZE == (flex_module.Q_BLOCK_SIZE, snap.page_size)


def test_window_drops_blocks_wholly_before_the_window():
    snap = synth_snapshot(SynthSpec(seq_lens=(300,), query_len=1, sliding_window=40, page_size=16))
    md = flex_module.FlexBuilder(snap.meta).build(common_metadata(snap, 0))
    # p = 299: keys 260..299 -> logical blocks 16..18 (block of 259 - 39 = 260 // 16 = 16)
    assert int(md.kv_num_blocks[0]) == 3


def test_eager_split_into_several_calls_gives_the_same_output(monkeypatch):
    snap = synth_snapshot(SynthSpec(query_lens=(17, 9, 30, 5), seq_lens=(40, 77, 200, 333)))
    whole = _run(snap)[1].runs["flex"].output
    monkeypatch.setattr(flex_module, "EAGER_SCORE_BUDGET_BYTES", 1)
    result, step, comparison = _run(snap)
    assert comparison.passed
    assert any("eager calls (request chunks)" in note for note in step.runs["flex"].info.notes)
    assert_close_ulps(step.runs["flex"].output, whole)


def test_compiled_flex_on_cpu_matches_reference():
    snap = synth_snapshot(SynthSpec(query_len=3, sliding_window=40, seq_lens=(9, 77, 200)))
    result, step, comparison = _run(snap, compile=True)
    assert step.runs["flex"].error is None
    assert step.runs["flex"].info.kernel == "flex_attention (compiled)" and step.runs["flex"].info.compiled
    assert comparison.passed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_on_cuda_compiled_matches_reference():
    snap = synth_snapshot(SynthSpec(query_len=4, sliding_window=64, seq_lens=(9, 77, 200, 1333)))
    result, step, comparison = _run(snap, device="cuda", compile=True)
    info = step.runs["flex"].info
    assert info.compiled and info.device == "cuda" and info.kernel == "flex_attention (compiled)"
    assert comparison.passed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_on_cuda_picks_eager_for_a_small_step_and_compiled_for_a_big_one(monkeypatch):
    snap = synth_snapshot(SynthSpec(query_len=4, sliding_window=64, seq_lens=(9, 77, 200, 1333)))
    _, step, comparison = _run(snap, device="cuda")
    info = step.runs["flex"].info
    assert not info.compiled and info.kernel == flex_module.EAGER_MATH_KERNEL and comparison.passed
    assert any("chosen by size" in note for note in info.notes)
    monkeypatch.setattr(flex_module, "COMPILE_ABOVE_SCORES", 0)
    _, step, comparison = _run(snap, device="cuda")
    assert step.runs["flex"].info.compiled and comparison.passed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kvdbg_eager_math_on_cuda_equals_torchs_eager_call(monkeypatch):
    snap = synth_snapshot(SynthSpec(query_lens=(17, 9, 30, 5), seq_lens=(40, 77, 200, 333), sliding_window=64))
    runs = {impl: _flex_run(snap, impl, monkeypatch, device="cuda", compile=False) for impl in EAGER_KERNELS}
    for impl, kernel in EAGER_KERNELS.items():
        assert runs[impl].info.kernel == kernel and runs[impl].info.device == "cuda"
    assert_close_ulps(runs["kvdbg"].output, runs["torch"].output)


def test_cpu_flex_stays_eager_unless_asked():
    snap = synth_snapshot(SynthSpec(query_len=2))
    _, step, _ = _run(snap)
    assert not step.runs["flex"].info.compiled
    assert not any("chosen by size" in note for note in step.runs["flex"].info.notes)


def test_unsupported_features_make_the_column_unavailable_with_the_reason():
    snap = synth_snapshot(SynthSpec(kv_sharing_target="model.layers.0.self_attn.attn", new_kv=False))
    result = replay(snap, ["reference", "flex"], ReplayOptions())
    status = {s.name: s for s in result.backends}
    assert status["reference"].available
    assert not status["flex"].available and "KV sharing" in status["flex"].reason
    assert list(result.steps[0].runs) == ["reference"]


def _whole_cache_eager(snap, md):
    """One eager flex_attention call over the whole physical cache with the step's BlockMask (the plain way)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from kvdbg.snapshot.cache import working_cache

    from kvdbg.snapshot.layout import kv_views

    layer = snap.meta.layer
    k, v = kv_views(snap.meta, working_cache(snap))
    n, hkv, ps, d = k.shape
    keys = k.permute(1, 0, 2, 3).reshape(1, hkv, n * ps, d)
    values = v.permute(1, 0, 2, 3).reshape(1, hkv, n * ps, d)
    q = snap.steps[0].query.to(getattr(torch, layer.dtype))[:md.num_actual_tokens].permute(1, 0, 2).unsqueeze(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, keys, values, block_mask=md.block_mask, scale=layer.scale,
                             enable_gqa=layer.num_heads != layer.num_kv_heads)
    return out[0].permute(1, 0, 2)


@pytest.mark.parametrize("spec", [
    dict(query_lens=(17, 9, 30, 5), seq_lens=(40, 77, 200, 333)),
    dict(sliding_window=24, query_len=3, seq_lens=(300, 41, 129), use_page_zero=True, page_zero_request=0),
    dict(causal=False, sliding_window=5, query_len=8, seq_lens=(100, 45), dtype="float32"),
    dict(shared_prefix_pages=2, query_len=2, seq_lens=(64, 90, 150), stale_tail=3, num_kv_heads=1, num_heads=8),
], ids=["ragged", "window_null_block", "dense_narrow_window", "prefix_gqa"])
@pytest.mark.parametrize("budget", [flex_module.EAGER_SCORE_BUDGET_BYTES, 1], ids=["runs", "one_block_a_call"])
def test_compact_eager_runs_equal_one_call_over_the_whole_cache(spec, budget, monkeypatch):
    """Each eager call sees only the pages its query blocks list; the answer is the whole-cache one."""
    snap = synth_snapshot(SynthSpec(new_kv=False, **spec))
    monkeypatch.setattr(flex_module, "EAGER_SCORE_BUDGET_BYTES", budget)
    _, step, _ = _run(snap)
    md = flex_module.FlexBuilder(snap.meta).build(common_metadata(snap, 0))
    # A compact call sums fewer masked (exactly zero) columns: the fp32 reductions are blocked
    # differently, so an output that cancels can move by a few ulps of its inputs' scale.
    assert_close_ulps(step.runs["flex"].output, _whole_cache_eager(snap, md), ulps=8)


@pytest.mark.parametrize("name", ["causal_window", "ragged_fp16", "shared_prefix", "fp8"])
def test_untraced_eager_call_equals_torchs_traced_eager_call(name, monkeypatch):
    """The eager path skips Dynamo's trace around flex_attention; the op and its output are the same."""
    snap = synth_snapshot(SynthSpec(**SPECS[name]))
    untraced = _run(snap)[1].runs["flex"].output
    monkeypatch.setattr(flex_module, "_flex_untraced", lambda flex, *args, **kwargs: flex(*args, **kwargs))
    traced = _run(snap)[1].runs["flex"].output
    assert_close_ulps(untraced, traced)


def test_untraced_eager_call_restores_torchs_switch():
    import torch.nn.attention.flex_attention as torch_flex

    before = torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    _run(synth_snapshot(SynthSpec(query_len=2)))
    assert torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG == before


def test_eager_reads_only_the_pages_each_query_block_lists_as_the_compiled_kernel_does():
    """Drop one page from one query block's list: eager must lose exactly the keys compiled loses."""
    from dataclasses import replace

    from kvdbg.snapshot.cache import working_cache

    snap = synth_snapshot(SynthSpec(query_lens=(3, 20, 2), seq_lens=(40, 77, 90), new_kv=False))
    md = flex_module.FlexBuilder(snap.meta).build(common_metadata(snap, 0))
    counts, indices = md.kv_num_blocks.clone(), md.kv_indices.clone()
    block = 1  # holds tokens of request 1: drop its first listed page from this block only
    assert counts[block] > 1
    indices[block, : counts[block] - 1] = indices[block, 1: counts[block]].clone()
    counts[block] -= 1
    narrowed = replace(md, kv_num_blocks=counts, kv_indices=indices)
    narrowed.block_mask = type(md.block_mask).from_kv_blocks(
        counts[None, None], indices[None, None], BLOCK_SIZE=(md.q_block_size, md.kv_block_size),
        mask_mod=md.block_mask.mask_mod, seq_lengths=md.block_mask.seq_lengths)
    cache = working_cache(snap)
    query = snap.steps[0].query
    outputs = {}
    for compiled in (False, True):
        impl = flex_module.FlexImpl(snap.meta, ReplayOptions(compile=compiled), compiled)
        out = torch.full(query.shape, float("nan"), dtype=query.dtype)
        outputs[compiled] = impl.forward(query, cache, narrowed, out)
        assert impl.compiled is compiled
    full = torch.full(query.shape, float("nan"), dtype=query.dtype)
    flex_module.FlexImpl(snap.meta, ReplayOptions(), False).forward(query, cache, md, full)
    rows = slice(block * md.q_block_size, (block + 1) * md.q_block_size)
    assert not torch.equal(outputs[False][rows], full[rows])  # the dropped page mattered
    torch.testing.assert_close(outputs[False], outputs[True], atol=2e-2, rtol=2e-2)  # bf16, two kernels
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(outputs[False][others], full[others])


def test_finite_page_flags_see_nan_and_inf_but_not_an_overflowing_sum():
    from kvdbg.snapshot.layout import finite_pages

    k = torch.ones(6, 2, 16, 8)
    v = torch.ones(6, 2, 16, 8)
    k[1, 0, 3, 2] = float("nan")
    v[4, 1, 0, 0] = float("-inf")
    k[2] = 3e38  # finite elements whose fp32 sum overflows
    assert finite_pages(k, v).tolist() == [True, False, True, True, False, True]
    assert finite_pages(v).tolist() == [True, True, True, True, False, True]
    fp8 = torch.zeros(3, 4, dtype=torch.uint8)
    fp8[1, 2] = 0x7F  # e4m3fn NaN, held as bytes
    assert finite_pages(fp8).tolist() == [True, False, True]


def test_compiled_flex_says_whether_torchs_on_disk_compile_cache_was_used(tmp_path, monkeypatch):
    """A second process finds the graph in torch's on-disk cache; the column says which happened."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    snap = synth_snapshot(SynthSpec(query_len=2, seq_lens=(40, 70)))
    notes = []
    for _ in range(2):
        torch._dynamo.reset()  # forget the in-process compile, as a new process would
        _, step, comparison = _run(snap, compile=True)
        assert comparison.passed
        notes.append([n for n in step.runs["flex"].info.notes if "on-disk compile cache" in n])
    assert len(notes[0]) == 1 and "compiled and stored in" in notes[0][0] and str(tmp_path) in notes[0][0]
    assert len(notes[1]) == 1 and notes[1][0].startswith("compiled graph loaded from"), notes


def test_untraced_eager_call_skips_dynamos_debugging_backends_unless_a_torch_function_mode_is_on():
    """torch's setup_compilation_env imports Dynamo's debugging backends (AOTAutograd, Inductor, networkx) for a
    backend the untraced call never uses; kvdbg stands in for it, but keeps it while a function mode is active."""
    from tests.helpers import run_python

    out = run_python("""
import sys, torch
from torch.overrides import TorchFunctionMode
import torch.nn.attention.flex_attention as torch_flex
from kvdbg.backends.base import ReplayOptions
from kvdbg.replayer.runner import replay
from kvdbg.moves.synth import SynthSpec, synth_snapshot

own_env = torch_flex.setup_compilation_env
snap = synth_snapshot(SynthSpec(sliding_window=40, query_len=5))
light = replay(snap, ["flex"], ReplayOptions()).steps[0].runs["flex"].output
print("DEBUGGING", "torch._dynamo.backends.debugging" in sys.modules)

class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

with PassThrough():
    moded = replay(snap, ["flex"], ReplayOptions()).steps[0].runs["flex"].output
print("DEBUGGING", "torch._dynamo.backends.debugging" in sys.modules)
print("RESTORED", torch_flex.setup_compilation_env is own_env)
print("EQUAL", torch.equal(light, moded))
""")
    assert out.split("\n")[-5:] == ["DEBUGGING False", "DEBUGGING True", "RESTORED True", "EQUAL True", ""], out


# --------------------------------------------------------------------------- who evaluates an eager step

EAGER_KERNELS = {"torch": "flex_attention (eager)", "kvdbg": flex_module.EAGER_MATH_KERNEL}


def _flex_run(snap, impl, monkeypatch, **options):
    monkeypatch.setenv(flex_module.FLEX_EAGER_ENV, impl)
    return _run(snap, **options)[1].runs["flex"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_kvdbg_eager_math_equals_torchs_eager_call(name, monkeypatch):
    """kvdbg's evaluation runs torch's eager operations: the same output, and the column says which ran."""
    snap = synth_snapshot(SynthSpec(**SPECS[name]))
    runs = {impl: _flex_run(snap, impl, monkeypatch) for impl in EAGER_KERNELS}
    for impl, kernel in EAGER_KERNELS.items():
        assert runs[impl].info.kernel == kernel and not runs[impl].info.compiled
    assert any("torch's flex_attention not called" in note and "KVDBG_FLEX_EAGER=torch" in note
               for note in runs["kvdbg"].info.notes)
    assert torch.isfinite(runs["kvdbg"].output).all()
    assert_close_ulps(runs["kvdbg"].output, runs["torch"].output)


def test_kvdbg_eager_math_equals_torchs_eager_call_one_query_block_a_call(monkeypatch):
    snap = synth_snapshot(SynthSpec(query_lens=(17, 9, 30, 5), seq_lens=(40, 77, 200, 333), sliding_window=40))
    monkeypatch.setattr(flex_module, "EAGER_SCORE_BUDGET_BYTES", 1)
    runs = {impl: _flex_run(snap, impl, monkeypatch) for impl in EAGER_KERNELS}
    assert runs["kvdbg"].info.kernel == flex_module.EAGER_MATH_KERNEL
    assert any("eager calls (request chunks)" in note for note in runs["kvdbg"].info.notes)
    assert_close_ulps(runs["kvdbg"].output, runs["torch"].output)


def test_kvdbg_eager_math_is_poisoned_by_a_nan_page_as_torchs_call_is(nan_k_snapshot, monkeypatch):
    """A NaN in a listed page reaches the tokens that mask it (0 x NaN in P @ V) through both evaluations."""
    from kvdbg import load_snapshot

    snap = load_snapshot(nan_k_snapshot)
    runs = {impl: _flex_run(snap, impl, monkeypatch) for impl in EAGER_KERNELS}
    nan = runs["torch"].output.isnan()
    assert nan.any() and torch.equal(runs["kvdbg"].output.isnan(), nan)
    assert_close_ulps(runs["kvdbg"].output[~nan], runs["torch"].output[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_eager_math_matches_flex_attention_with_fully_masked_rows(dtype):
    """Rows whose mask keeps no key come out zero (safe softmax); fp64 inputs keep fp64 scores."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(dtype) for n in (24, 40, 40))

    def mask_mod(b, h, q_idx, kv_idx):  # rows 0..3 see nothing; the rest a causal band of 8
        return (q_idx >= 4) & (kv_idx <= q_idx + 16) & (kv_idx > q_idx + 8)

    ours = flex_module.eager_math(q, k, v, mask_mod, scale=0.3)
    block_mask = create_block_mask(mask_mod, 1, 1, 24, 40, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = flex_attention(q, k, v, block_mask=block_mask, scale=0.3)
    assert ours.dtype == dtype and torch.equal(ours[:, :, :4], torch.zeros_like(ours[:, :, :4]))
    assert_close_ulps(ours, theirs)


def test_eager_evaluator_is_kvdbg_on_cuda_torch_on_cpu_unless_the_environment_says(monkeypatch):
    from kvdbg.errors import OptionError

    monkeypatch.delenv(flex_module.FLEX_EAGER_ENV, raising=False)
    assert flex_module._resolve_eager(ReplayOptions(device="cpu")) == "torch"
    assert flex_module._resolve_eager(ReplayOptions(device="cuda:1")) == "kvdbg"
    monkeypatch.setenv(flex_module.FLEX_EAGER_ENV, " Torch")
    assert flex_module._resolve_eager(ReplayOptions(device="cuda")) == "torch"
    monkeypatch.setenv(flex_module.FLEX_EAGER_ENV, "kvdbg")
    assert flex_module._resolve_eager(ReplayOptions(device="cpu")) == "kvdbg"
    monkeypatch.setenv(flex_module.FLEX_EAGER_ENV, "fast")
    with pytest.raises(OptionError, match="KVDBG_FLEX_EAGER='fast': choose torch or kvdbg"):
        flex_module._resolve_eager(ReplayOptions(device="cpu"))
    result = replay(synth_snapshot(SynthSpec(query_len=2)), ["reference", "flex"], ReplayOptions())
    status = {s.name: s for s in result.backends}
    assert not status["flex"].available and "KVDBG_FLEX_EAGER='fast'" in status["flex"].reason


@pytest.mark.parametrize("impl", ["kvdbg", "torch"])
def test_kvdbg_eager_math_replays_without_importing_dynamo(impl):
    """What a small replay's flex column costs a process: torch's eager call imports Dynamo, Inductor's IR
    and sympy (seconds where torch has no bytecode cache); kvdbg's evaluation none of them."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = ("import sys, kvdbg\n"
            "report = kvdbg.replay('fixtures/dflash.safetensors', ['flex'])\n"
            "print('KERNEL', [s.info.kernel for s in report.result.backends if s.name == 'flex'][0])\n"
            "print('MODULES', ' '.join(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') "
            "if m in sys.modules))\n")
    env = dict(os.environ, **{flex_module.FLEX_EAGER_ENV: impl})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=env).stdout.splitlines()
    assert out[-2] == f"KERNEL {EAGER_KERNELS[impl]}"
    heavy = out[-1].split()[1:]
    if impl == "kvdbg":
        assert heavy == []
    else:  # the check sees the import when there is one
        assert "torch._dynamo" in heavy
