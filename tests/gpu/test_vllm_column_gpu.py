"""The vllm column running vLLM 0.33's own TRITON_ATTN code on a CUDA GPU: builder, Triton cache write, attention.

Run by tests/gpu/run_vllm_column.sh on a GPU machine with vLLM's Python files carried (no vLLM install). Each
snapshot names TRITON_ATTN; kvdbg's replay runs vLLM's TritonAttentionMetadataBuilder.build,
TritonAttentionImpl.do_kv_cache_update (triton_reshape_and_cache_flash) and TritonAttentionImpl.forward
(unified_attention) on the stored pages, and the results are held to kvdbg's exact reference; shrink and poison
run on the column too.
"""

from __future__ import annotations

import pytest
import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.judge.compare import compare_step
from kvdbg.replayer.runner import replay
from kvdbg.moves.synth import SynthSpec, synth_snapshot

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"


def _options() -> ReplayOptions:
    return ReplayOptions(device=DEVICE)

CASES = {
    # prefill chunks and decodes in one batch (vLLM picks its 2D kernel for it), GQA 4
    "mixed_bf16": dict(seq_lens=(9, 77, 200, 333), query_lens=(9, 5, 1, 1), num_heads=16, num_kv_heads=4,
                       head_size=128, page_size=16, dtype="bfloat16"),
    # decodes only, few requests (vLLM's 3D split-softmax kernel), two steps, a sliding window
    "decode_window_fp16": dict(seq_lens=(700, 90, 1500), query_len=1, num_heads=8, num_kv_heads=1, head_size=64,
                               page_size=32, dtype="float16", sliding_window=256, steps=2),
    # a non-causal block with a window, a live page 0 and stale table tails
    "dense_page0": dict(seq_lens=(300, 41), query_len=4, num_heads=8, num_kv_heads=2, head_size=128,
                        page_size=16, dtype="bfloat16", causal=False, sliding_window=64, use_page_zero=True,
                        stale_tail=2),
    # an FP8 cache (e4m3, per-tensor scales) and query; the step's K/V already in the pages
    "fp8": dict(seq_lens=(64, 500), query_lens=(1, 3), num_heads=8, num_kv_heads=2, head_size=128, page_size=16,
                dtype="bfloat16", fp8=True, new_kv=False, q_scale=0.05, k_scale=0.03, v_scale=0.04),
}


def _snapshot(name: str):
    return synth_snapshot(SynthSpec(seed=7, backend="TRITON_ATTN", **CASES[name]))


def _status(result, name):
    return next(st for st in result.backends if st.name == name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllms_triton_attn_replays_against_the_reference(case):
    snap = _snapshot(case)
    result = replay(snap, ["reference", "vllm"], _options(), required=["vllm"])
    status = _status(result, "vllm")
    assert status.available and status.engine_name == "TRITON_ATTN"
    assert status.info.kernel.startswith("vLLM 0.33.0 TritonAttentionImpl"), status.info.kernel
    notes = " | ".join(status.info.notes)
    print(f"\n{case}: {status.info.kernel}\n  " + "\n  ".join(status.info.notes))
    assert "triton_attn.py" in notes and "create_kv_cache_views" in notes
    if CASES[case].get("new_kv", True):
        assert "TritonAttentionImpl.do_kv_cache_update" in notes
    for step in result.steps:
        comps = [c for c in compare_step(step, snap.meta) if c.actual == "vllm"]
        assert comps and all(c.passed for c in comps), [(c.step, c.max_abs, len(c.failed)) for c in comps]
        print(f"  step {step.step}: max |vllm - reference| {max(c.max_abs for c in comps):.3g}")
    assert "vllm" in result.counted and result.judge().verdict.exit_code == 0


def test_the_column_is_counted_and_a_wrong_cache_fails():
    """The column reads the pages it is given: a corrupted page moves vLLM's output away from the captured one."""
    snap = _snapshot("mixed_bf16")
    good = replay(snap, ["reference", "vllm"], _options(), required=["vllm"])
    for step, replayed in zip(snap.steps, good.steps):
        step.output = replayed.runs["vllm"].output.cpu()
    keys, _ = snap.kv_views()
    live = int(snap.steps[0].block_table[3, 0])
    stored = int((snap.page_ids == live).nonzero()[0])
    keys[stored] = -keys[stored]  # request 3's first page, read by its decode token
    bad = replay(snap, ["reference", "vllm"], _options(), required=["vllm"]).judge()
    failed = [c for c in bad.comparisons if c.actual == "vllm" and c.expected == "captured" and not c.passed]
    assert failed and bad.verdict.exit_code == 1


def test_poison_finds_no_slot_vllms_kernel_must_not_read():
    from kvdbg.moves.poisoner import poison

    snap = _snapshot("dense_page0")
    result = poison(snap, ["reference", "vllm"], _options(), required=["vllm"])
    mine = [b for s in result.steps for b in s.backends if b.backend == "vllm"]
    assert mine and all(b.ran for b in mine)
    for b in mine:
        print("\n" + ", ".join(f"{r.region}: {r.status}" for r in b.regions))
    assert not any(b.reads_poisoned for b in mine)


def test_shrink_keeps_a_failure_of_the_column():
    """A NaN key that request 1 sees makes its heads of that KV group non-finite (never a pass): shrink, driving
    vLLM's kernel on every candidate, keeps that request and KV head."""
    from kvdbg.moves.shrinker import shrink

    snap = _snapshot("mixed_bf16")
    keys, _ = snap.kv_views()
    stored = int((snap.page_ids == int(snap.steps[0].block_table[1, 0])).nonzero()[0])
    keys[stored, 1, 3] = float("nan")  # KV head 1, token 3 of request 1's first page: visible to its queries
    result = shrink(snap, "vllm", device=DEVICE)
    assert result.backend == "vllm" and result.kept_requests == [1] and result.kept_kv_heads == [1]
    assert result.failing_heads_after and result.pages_after < result.pages_before
