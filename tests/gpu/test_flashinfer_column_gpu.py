"""The vllm column running vLLM 0.33's FLASHINFER backend on a CUDA GPU: FlashInfer's real paged kernels.

Run by tests/gpu/run_flashinfer_column.sh on a Hopper GPU with vLLM's and FlashInfer's Python files carried.
Each snapshot names FLASHINFER; kvdbg's replay runs vLLM's FlashInferMetadataBuilder.build (which plans
FlashInfer's BatchDecodeWithPagedKVCacheWrapper / BatchPrefillWithPagedKVCacheWrapper), FlashInferImpl's cache
update (vLLM's reshape_and_cache_flash, stood in for in plain torch by the harness: tests/gpu/stub_site) and
FlashInferImpl.forward, whose kernels FlashInfer JIT-builds on first use; the outputs are held to kvdbg's exact
reference, and a planted wrong output must fail naming its request and head.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.judge.compare import compare_step
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from kvdbg.replayer.runner import replay

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OPTIONS = ReplayOptions(device="cuda")

CASES = {
    # decodes only, GQA 8/2, fp16 (FlashInfer's batch decode kernel)
    "decode_fp16_gqa": dict(seq_lens=(700, 90, 1500, 33), query_len=1, num_heads=8, num_kv_heads=2, head_size=128,
                            page_size=16, dtype="float16"),
    # decodes with a sliding window past the first pages, two steps (window_left planned per step)
    "decode_window": dict(seq_lens=(700, 90, 1500), query_len=1, num_heads=8, num_kv_heads=2, head_size=128,
                          page_size=16, dtype="float16", sliding_window=256, steps=2),
    # a soft-capped decode, page size 32
    "decode_softcap_page32": dict(seq_lens=(300, 41, 1000), query_len=1, num_heads=16, num_kv_heads=4,
                                  head_size=128, page_size=32, dtype="float16", logits_soft_cap=30.0),
    # prefill chunks and decodes in one batch (the prefill and decode wrappers both planned), GQA 4
    "mixed_bf16": dict(seq_lens=(9, 77, 200, 333), query_lens=(9, 5, 1, 1), num_heads=16, num_kv_heads=4,
                       head_size=128, page_size=16, dtype="bfloat16"),
    # a windowed prefill chunk beside decodes
    "mixed_window_fp16": dict(seq_lens=(400, 64, 900), query_lens=(16, 1, 1), num_heads=8, num_kv_heads=2,
                              head_size=128, page_size=16, dtype="float16", sliding_window=128),
}


def _snapshot(name: str, **extra):
    return synth_snapshot(SynthSpec(seed=11, backend="FLASHINFER", **{**CASES[name], **extra}))


def _status(result, name="vllm"):
    return next(st for st in result.backends if st.name == name)


@pytest.mark.parametrize("case", list(CASES))
def test_flashinfers_kernels_under_vllms_backend_replay_against_the_reference(case):
    snap = _snapshot(case)
    start = time.perf_counter()
    result = replay(snap, ["reference", "vllm"], OPTIONS, required=["vllm"])
    seconds = time.perf_counter() - start
    status = _status(result)
    assert status.available and status.engine_name == "FLASHINFER", status.reason
    assert status.info.kernel.startswith("vLLM 0.33.0 FlashInferImpl"), status.info.kernel
    notes = " | ".join(status.info.notes)
    print(f"\n{case} ({seconds:.1f} s): {status.info.kernel}\n  " + "\n  ".join(status.info.notes))
    assert "FlashInfer 0.7.2" in notes and "Wrapper" in notes
    assert "FlashInferImpl.do_kv_cache_update" in notes  # vLLM's own cache update ran
    for step in result.steps:
        comps = [c for c in compare_step(step, snap.meta) if c.actual == "vllm"]
        assert comps and all(c.passed for c in comps), [(c.step, c.max_abs, len(c.failed)) for c in comps]
        print(f"  step {step.step}: max |vllm - reference| {max(c.max_abs for c in comps):.3g}")
    assert "vllm" in result.counted and result.judge().verdict.exit_code == 0


def test_a_planted_wrong_output_fails_naming_its_request_and_head():
    snap = _snapshot("decode_fp16_gqa")
    good = replay(snap, ["reference", "vllm"], OPTIONS, required=["vllm"])
    for step, replayed in zip(snap.steps, good.steps):
        step.output = replayed.runs["vllm"].output.cpu().clone()
    start = int(snap.steps[0].query_start_loc[2])
    snap.steps[0].output[start, 5] += 0.5  # request 2, query head 5: what a wrong kernel would have written
    report = replay(snap, ["reference", "vllm"], OPTIONS, required=["vllm"]).judge()
    wrong = [(c.actual, h.request, h.head) for c in report.comparisons if c.expected == "captured"
             for h in c.failed]
    assert ("vllm", 2, 5) in wrong and all((r, h) == (2, 5) for _, r, h in wrong), wrong
    assert report.verdict.exit_code == 1


def test_a_feature_flashinfer_refuses_on_hopper_is_the_columns_one_line_reason():
    snap = _snapshot("decode_fp16_gqa", sinks="auto")
    result = replay(snap, ["reference", "vllm"], OPTIONS)
    status = _status(result)
    print(f"\nsinks on FLASHINFER: available={status.available} reason={status.reason}")
    assert not status.available and "\n" not in status.reason and "sink" in status.reason.lower()


def test_an_fp8_cache_runs_or_is_refused_in_vllms_words():
    snap = _snapshot("decode_fp16_gqa", fp8=True, new_kv=False, q_scale=1.0, k_scale=0.03, v_scale=0.04)
    result = replay(snap, ["reference", "vllm"], OPTIONS)
    status = _status(result)
    print(f"\nfp8 on FLASHINFER: available={status.available} reason={status.reason!r}")
    if status.available:
        comps = [c for s in result.steps for c in compare_step(s, snap.meta) if c.actual == "vllm"]
        print("  max |vllm - reference|", max(c.max_abs for c in comps))
        assert comps and all(c.passed for c in comps)
    else:
        assert status.reason and "\n" not in status.reason


def test_one_snapshot_two_flashinfers_the_real_hopper_kernel_beside_the_ts_emulation():
    """A decode step both FlashInfers run: the real paged decode kernel (vLLM's FLASHINFER) and kvdbg's emulation
    of FLASHINFER_TS's prims_ts contract (a different kernel, same attention): each within tolerance of the
    reference, and of each other."""
    snap = _snapshot("decode_fp16_gqa")
    result = replay(snap, ["reference", "vllm", "flashinfer_ts"], OPTIONS, required=["vllm", "flashinfer_ts"])
    ts = _status(result, "flashinfer_ts")
    print(f"\nflashinfer_ts: {ts.info.kernel}")
    for step in result.steps:
        comps = {c.actual: c for c in compare_step(step, snap.meta) if c.expected == "reference"}
        assert comps["vllm"].passed and comps["flashinfer_ts"].passed
        real, emulated = step.runs["vllm"].output.float(), step.runs["flashinfer_ts"].output.float()
        print(f"  step {step.step}: max |real - emulated| {(real - emulated).abs().max().item():.3g}")
    # ... and the replay says what that difference is (finding two_flashinfers, info: not a failure)
    said = [f for f in result.findings if f.code == "two_flashinfers"]
    assert said and all(f.severity == "info" for f in said), [f.code for f in result.findings]
    print("  " + said[0].message)
    assert result.judge().verdict.exit_code == 0
