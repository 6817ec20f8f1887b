"""FLASHINFER_TS against a recording BatchDecodePagedTSWrapper: every plan/run argument, and the real-kernel gate."""

from __future__ import annotations

import math
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.backends import flashinfer_ts as ts
from kvdbg.backends.flashinfer_ts import gate as ts_gate
from kvdbg.snapshot.cache import working_cache
from kvdbg.errors import BackendUnavailable
from kvdbg.replayer.runner import common_metadata, replay
from kvdbg.moves.synth import LAYOUT_KV_PLANES, SynthSpec, synth_snapshot
from kvdbg.ts.contract import api_for_version

from tests.helpers import ROOT


class Recording:
    """Stands in for flashinfer's wrapper: records the calls and writes a recognisable output."""

    FILL = 0.375  # exact in fp16 and bf16

    def __init__(self, log):
        self.log = log

    def __call__(self, kv_layout):  # the class is called to make a wrapper
        wrapper = types.SimpleNamespace(kv_layout=kv_layout, plans=[], runs=[])

        def plan(**kwargs):  # keyword-only, as the backend must call it
            wrapper.plans.append(kwargs)

        def run(**kwargs):
            # The builder's buffers are persistent: keep what they held at this run.
            kwargs["seq_lens_at_run"] = kwargs["seq_lens"].tolist()
            wrapper.runs.append(kwargs)
            kwargs["out"].fill_(self.FILL)

        wrapper.plan, wrapper.run = plan, run
        self.log.append(wrapper)
        return wrapper


def _gate(log, version="0.7.1"):
    api, note = api_for_version(ts.parse_version(version))
    return ts.KernelGate(True, None, Recording(log), version, (10, 0), api=api, api_note=note)


def _run(snap, log):
    inst = ts.create(snap.meta, ReplayOptions(), gate=_gate(log))
    common = common_metadata(snap, 0)
    cache = working_cache(snap)
    query = snap.steps[0].query
    out = torch.full((query.shape[0], snap.meta.layer.num_heads, snap.meta.layer.head_size), float("nan"),
                     dtype=inst.output_dtype)
    md = inst.builder.build(common)
    inst.impl.forward(query, cache, md, out)
    return inst, md, cache, out


CASES = {
    "causal": dict(seq_lens=(40, 77, 130), causal=True),
    "dense": dict(seq_lens=(40, 77, 130), causal=False, query_len=4),
    "dense_window": dict(seq_lens=(300, 77, 130), causal=False, query_len=4, sliding_window=64),
    "causal_window": dict(seq_lens=(30, 40, 50), causal=True, sliding_window=64),
    "fp8_bf16_model": dict(seq_lens=(40, 77), fp8=True, q_scale=0.5, k_scale=0.25, v_scale=2.0),
    "fp8_fp16_model": dict(seq_lens=(40, 77), fp8=True, dtype="float16", k_scale=0.5),
    "bf16": dict(seq_lens=(40, 77), dtype="bfloat16", query_len=2, causal=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_and_run_arguments(case):
    spec = SynthSpec(num_heads=4, num_kv_heads=2, head_size=64, page_size=16, **CASES[case])
    snap = synth_snapshot(spec)
    layer, backend = snap.meta.layer, snap.meta.backend
    log = []
    inst, md, cache, out = _run(snap, log)
    assert len(log) == 1
    wrapper = log[0]
    assert wrapper.kv_layout == "HND"
    assert len(wrapper.plans) == 1 and len(wrapper.runs) == 1
    plan = wrapper.plans[0]
    q = spec.query_len
    num_reqs = len(spec.seq_lens)
    fp8 = spec.fp8
    model = getattr(torch, spec.dtype)
    kv_dtype = torch.float8_e4m3fn if fp8 else model
    o_dtype = torch.float16 if fp8 else model
    window = spec.sliding_window
    max_kv_len = backend.max_model_len if window is None else window + backend.max_decode_query_len + 16
    assert plan == dict(
        device=torch.device("cpu"), batch_size=num_reqs, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
        max_kv_len=max_kv_len, max_seq_len_q=q, packed_query=False, q_data_type=kv_dtype, kv_data_type=kv_dtype,
        o_data_type=o_dtype, mask_type="causal" if spec.causal else "dense",
        window_left=window - 1 if (spec.causal and window) else -1,
    )

    run = wrapper.runs[0]
    assert set(run) - {"seq_lens_at_run"} == {"q", "paged_kv_cache", "seq_lens", "block_tables", "bmm1_scale", "bmm2_scale", "out",
                        "validate"}
    assert run["validate"] is False
    assert run["q"].shape == (num_reqs, q, 4, 64) and run["q"].dtype == kv_dtype
    k, v = run["paged_kv_cache"]
    d = 64
    # Views of the page tensor itself: same storage, no repacking, token stride 2*D.
    for t in (k, v):
        assert t.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        assert t.shape == (cache.shape[0], 2, 16, d)
        assert t.stride() == (2 * 16 * 2 * d, 16 * 2 * d, 2 * d, 1)
        assert t.dtype == kv_dtype
    assert v.data_ptr() - k.data_ptr() == d * k.element_size()
    assert run["bmm1_scale"] == pytest.approx(layer.scale * spec.q_scale * spec.k_scale, rel=1e-12)
    assert run["bmm2_scale"] == spec.v_scale
    assert run["out"].shape == (num_reqs, q, 4, 64) and run["out"].dtype == o_dtype
    assert run["seq_lens"].dtype == torch.int32 and run["block_tables"].dtype == torch.int32
    assert run["seq_lens"] is md.seq_lens and run["block_tables"] is md.block_table
    if window is not None and not spec.causal:
        expect = [min(n, n - max(0, (n - (window + q - 1)) // 16) * 16) for n in spec.seq_lens]
        assert run["seq_lens"].tolist() == expect
        assert run["block_tables"].shape[1] == math.ceil((window + q - 1) / 16) + 1
    else:
        assert run["seq_lens"].tolist() == list(spec.seq_lens)
    # What the kernel wrote reaches the output, converted to the model dtype.
    assert out.dtype == model
    assert torch.all(out == Recording.FILL)
    info = inst.describe()
    assert not info.emulated and info.kernel == "prims_ts BatchDecodePagedTSWrapper on sm100"


def test_query_in_model_dtype_on_fp8_cache_is_quantised_with_q_scale():
    snap = synth_snapshot(SynthSpec(seq_lens=(40,), fp8=True, q_scale=0.5, head_size=64, num_heads=2,
                                    num_kv_heads=1))
    bf16_query = torch.randn(1, 2, 64).to(torch.bfloat16)
    snap.steps[0].query = bf16_query
    log = []
    inst = ts.create(snap.meta, ReplayOptions(), gate=_gate(log))
    md = inst.builder.build(common_metadata(snap, 0))
    inst.impl.forward(bf16_query, working_cache(snap), md, torch.full((1, 2, 64), float("nan"), dtype=torch.bfloat16))
    q = log[0].runs[0]["q"]
    assert q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(q.float().reshape(1, 2, 64), (bf16_query.float() / 0.5).to(torch.float8_e4m3fn).float())


def test_plans_are_reused_across_steps_with_the_same_shape():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 77), steps=3, head_size=64))
    log = []
    inst = ts.create(snap.meta, ReplayOptions(), gate=_gate(log))
    cache = working_cache(snap)
    for step in range(3):
        md = inst.builder.build(common_metadata(snap, step))
        inst.impl.forward(snap.steps[step].query, cache, md, torch.full((2, 8, 64), float("nan"), dtype=torch.bfloat16))
    assert len(log) == 1 and len(log[0].plans) == 1 and len(log[0].runs) == 3
    assert [r["seq_lens_at_run"] for r in log[0].runs] == [[40, 77], [41, 78], [42, 79]]
    # One persistent buffer, written in place, as a captured CUDA graph needs.
    assert len({r["seq_lens"].data_ptr() for r in log[0].runs}) == 1
    assert len({r["block_tables"].data_ptr() for r in log[0].runs}) == 1


# --------------------------------------------------------------------------- the gate


def _fake_flashinfer(monkeypatch, version, log):
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = version
    attention = types.ModuleType("flashinfer.attention")
    prims = types.ModuleType("flashinfer.attention.prims_ts")
    prims.BatchDecodePagedTSWrapper = Recording(log)
    pkg.attention, attention.prims_ts = attention, prims
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.attention", attention)
    monkeypatch.setitem(sys.modules, "flashinfer.attention.prims_ts", prims)


def test_gate_flashinfer_missing():
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flashinfer is installed here")
    gate = ts.kernel_gate("cpu")
    assert not gate.available
    assert gate.reason.startswith("flashinfer missing:") and ">= 0.7.1" in gate.reason


def test_gate_version_0_7_0_post1_is_too_old(monkeypatch):
    log = []
    _fake_flashinfer(monkeypatch, "0.7.0.post1", log)
    monkeypatch.setattr(ts_gate, "_probe_device", lambda device: ((10, 0), None))
    gate = ts.kernel_gate("cuda")
    assert not gate.available
    assert "0.7.0.post1 is too old" in gate.reason and "cutlass-dsl 4.8" in gate.reason
    snap = synth_snapshot(SynthSpec(seq_lens=(40,), head_size=64))
    result = replay(snap, ["flashinfer_ts"])
    info = result.steps[0].runs["flashinfer_ts"].info
    assert info.emulated and info.kernel == ts.EMULATED_KERNEL
    assert any("0.7.0.post1 is too old" in n for n in info.notes)
    assert log == []


def test_gate_unparseable_and_old_versions(monkeypatch):
    log = []
    _fake_flashinfer(monkeypatch, "0.6.9", log)
    assert "0.6.9 is too old" in ts.kernel_gate("cuda").reason
    _fake_flashinfer(monkeypatch, "nightly", log)
    assert "cannot compare" in ts.kernel_gate("cuda").reason
    assert ts.parse_version("0.7.0.post1") == (0, 7, 0) and ts.parse_version("0.7.1rc2") == (0, 7, 1)


def test_gate_no_cuda(monkeypatch):
    log = []
    _fake_flashinfer(monkeypatch, "0.7.1", log)
    gate = ts.kernel_gate("cpu")
    assert not gate.available
    if torch.cuda.is_available():
        assert "replay runs on cpu" in gate.reason
    else:
        assert gate.reason.startswith("no CUDA")


def test_gate_hopper_is_refused(monkeypatch):
    log = []
    _fake_flashinfer(monkeypatch, "0.7.1", log)
    monkeypatch.setattr(ts_gate, "_probe_device", lambda device: ((9, 0), None))
    gate = ts.kernel_gate("cuda")
    assert not gate.available and gate.capability == (9, 0)
    assert gate.reason.startswith("compute capability 9.0 (Hopper") and "10.0, 10.3, 10.7" in gate.reason


def test_gate_blackwell_calls_the_wrapper_through_replay(monkeypatch):
    log = []
    _fake_flashinfer(monkeypatch, "0.7.1", log)
    monkeypatch.setattr(ts_gate, "_probe_device", lambda device: ((10, 0), None))
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 77), head_size=64))
    result = replay(snap, ["flashinfer_ts"])
    run = result.steps[0].runs["flashinfer_ts"]
    assert run.error is None
    assert not run.info.emulated and "sm100" in run.info.kernel
    assert len(log) == 1 and len(log[0].runs) == 1 and log[0].runs[0]["validate"] is False
    assert torch.all(run.output == Recording.FILL)


def test_force_emulation_and_plan_rejection_fall_back_with_the_reason(monkeypatch):
    log = []
    _fake_flashinfer(monkeypatch, "0.7.1", log)
    monkeypatch.setattr(ts_gate, "_probe_device", lambda device: ((10, 0), None))
    snap = synth_snapshot(SynthSpec(seq_lens=(40,), head_size=64))
    inst = ts.create(snap.meta, ReplayOptions(force_emulation=True))
    assert inst.describe().emulated and "emulation requested" in inst.describe().notes[0]
    odd = synth_snapshot(SynthSpec(seq_lens=(40,), head_size=96))
    with pytest.raises(BackendUnavailable, match="plan\\(\\) rejects this layer.*head_dim 96"):
        ts.create(odd.meta, ReplayOptions())  # nothing is emulated for a layer the real plan() refuses
    assert log == []


# --------------------------------------------------------------------------- vLLM's rejections


@pytest.mark.parametrize("extra, words", [
    ({"sinks": "auto"}, "attention sinks"),
    ({"alibi_slopes": "auto"}, "ALiBi"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"kv_sharing_target": "model.layers.0.self_attn.attn", "new_kv": False}, "KV sharing"),
    ({"attn_type": "encoder_only", "causal": False, "query_len": 40}, "attn_type 'encoder_only'"),
])
def test_rejections_show_as_unavailable_with_the_reason(extra, words):
    snap = synth_snapshot(SynthSpec(seq_lens=(40,), head_size=64, **extra))
    reason = ts.BACKEND.unsupported_reason(snap.meta)
    assert reason is not None and words in reason
    result = replay(snap, ["reference", "flashinfer_ts"])
    status = {s.name: s for s in result.backends}["flashinfer_ts"]
    assert not status.available and status.reason == reason
    with pytest.raises(BackendUnavailable, match=words):
        ts.create(snap.meta, ReplayOptions())


def test_kv_planes_layout_cannot_be_handed_to_the_kernel():
    snap = synth_snapshot(SynthSpec(seq_lens=(40,), head_size=64, layout=LAYOUT_KV_PLANES))
    reason = ts.BACKEND.unsupported_reason(snap.meta)
    assert "cannot be given to prims_ts as it is" in reason and "token stride 2*D" in reason
    clean = synth_snapshot(SynthSpec(seq_lens=(40,), head_size=64))
    assert ts.BACKEND.unsupported_reason(clean.meta) is None


def test_per_request_causal_tensor_is_refused():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 50), head_size=64))
    inst = ts.create(snap.meta, ReplayOptions())
    common = replace(common_metadata(snap, 0), causal=torch.tensor([True, False]))
    with pytest.raises(BackendUnavailable, match="per-request causal"):
        inst.builder.build(common)


def test_module_import_does_not_import_flashinfer_or_vllm():
    code = ("import sys, kvdbg.backends.flashinfer_ts as m; "
            "print(any(n.split('.')[0] in ('flashinfer', 'vllm') for n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "False"
