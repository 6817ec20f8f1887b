"""The vllm column with vLLM 0.33's CUDA wheel on a CPU torch: unavailable with the reason, and its cache reading
held to vLLM 0.33's own layout classes.

vLLM's code cannot run here (no GPU; vLLM's platform is unspecified), so every
snapshot's vllm column must say so in one line, never raise an error finding,
and leave the verdict and exit code those of the other columns. The cache the
column would hand a backend is built with vLLM 0.33's own functions and read
back the way each backend's forward reads it.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from click.testing import CliRunner

from kvdbg.backends._vllm_kv_cache import allocate, choose_layout, place_pages, supported_layouts
from kvdbg.snapshot.layout import CPU_ATTN_K_TRANSPOSED
from kvdbg.cli import cli
from kvdbg.moves.synth import SynthSpec, synth_snapshot

BACKENDS = ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN"]
OTHER_COLUMNS = "reference,flex,flashinfer_ts"


def _snapshot(tmp_path, backend: str) -> str:
    from kvdbg.replayer.runner import replay
    from kvdbg.snapshot.store import save_snapshot

    snap = synth_snapshot(SynthSpec(seq_lens=(9, 77, 40), query_lens=(1, 1, 3), page_size=32, dtype="float16",
                                    backend=backend))
    for step, replayed in zip(snap.steps, replay(snap, ["reference"]).steps):
        step.output = replayed.runs["reference"].output.to(torch.float16)
    return save_snapshot(snap, str(tmp_path / f"{backend}.safetensors"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_column_is_unavailable_in_one_line_and_changes_no_verdict(tmp_path, backend):
    path = _snapshot(tmp_path, backend)
    full = CliRunner().invoke(cli, ["replay", path, "--json"])
    others = CliRunner().invoke(cli, ["replay", path, "--json", "--backend", OTHER_COLUMNS])
    assert full.exit_code == others.exit_code == 0, full.output[-2000:]
    data, without = json.loads(full.output), json.loads(others.output)
    status = {b["name"]: b for b in data["backends"]}["vllm"]
    assert not status["available"] and status["engine_name"] == backend
    reason = status["reason"]
    assert "\n" not in reason and "pin_memory" not in reason
    if backend in ("FLEX_ATTENTION", "CPU_ATTN"):
        assert reason.startswith("vLLM 0.33.0 found no platform it runs on in this environment")
    else:
        assert reason.startswith(f"vLLM's {backend} runs on a CUDA GPU, and this replay runs on cpu")
    assert not any(f["backend"] == "vllm" for f in data["findings"])
    assert data["verdict"]["status"] == without["verdict"]["status"]
    assert data["verdict"]["exit_code"] == without["verdict"]["exit_code"]


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLEX_ATTENTION"])
def test_naming_the_column_where_it_cannot_run_is_exit_2(tmp_path, backend):
    res = CliRunner().invoke(cli, ["replay", _snapshot(tmp_path, backend), "--backend", "vllm"])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: backend vllm cannot run: ")


def _backend_class(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def _read_back(name: str, view: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [blocks, Hkv, page_size, D] as the backend's forward reads its layer cache (vLLM 0.33's code)."""
    if name == "CPU_ATTN":  # cpu_attn.py: view [B, H, 2N, D], chunk on dim 2; the C++ kernel reads K transposed
        blocks, heads, tokens, _ = view.shape
        key_cache, value_cache = view.view(blocks, heads, 2 * tokens, -1).chunk(2, dim=2)
        keys = key_cache.reshape(blocks, heads, head_size, tokens).transpose(-1, -2)
        return keys, value_cache.reshape(blocks, heads, tokens, head_size)
    # flash_attn.py, triton_attn.py, flex_attention.py, flashinfer.py: transpose(1, 2).split(head_size, -1)
    key_cache, value_cache = view.transpose(1, 2).split(head_size, dim=-1)
    return key_cache.transpose(1, 2), value_cache.transpose(1, 2)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_pages_read_back_through_each_backends_own_view_in_every_layout_it_supports(name, fp8):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cls = _backend_class(name)
    head_size, page_size, heads = 64, 32, 2
    dtype = torch.uint8 if fp8 else torch.float16
    spec = FullAttentionSpec(block_size=page_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, heads, page_size, head_size, generator=gen)
    values = torch.randn(3, heads, page_size, head_size, generator=gen)
    if fp8:
        keys, values = keys.to(torch.float8_e4m3fn), values.to(torch.float8_e4m3fn)
    else:
        keys, values = keys.half(), values.half()
    content = CPU_ATTN_K_TRANSPOSED if name == "CPU_ATTN" else None
    layouts = supported_layouts(cls)
    assert layouts
    for layout in layouts:
        view = allocate(spec, layout, 4, "model.layers.0.self_attn.attn", "cpu")
        assert tuple(view.shape) == (4, heads, page_size, 2 * head_size) and view.dtype == dtype
        place_pages(view, keys, values, torch.tensor([1, 3, 2]), content)
        got_k, got_v = _read_back(name, view, head_size)
        want_k, want_v = keys.view(dtype), values.view(dtype)
        assert torch.equal(got_k[[1, 3, 2]], want_k), layout.name
        assert torch.equal(got_v[[1, 3, 2]], want_v), layout.name
        assert torch.count_nonzero(view[0]) == 0  # the null block stays empty


def test_the_engines_resolved_layout_is_used_when_the_snapshot_records_it():
    meta = synth_snapshot(SynthSpec(seq_lens=(5,), backend="TRITON_ATTN")).meta
    from dataclasses import replace

    cls = _backend_class("TRITON_ATTN")
    first, why = choose_layout(cls, meta)
    assert first == supported_layouts(cls)[0] and "first choice" in why
    other = supported_layouts(cls)[-1]
    layout, why = choose_layout(cls, replace(meta, capture={"kv_cache_layout": other.name}))
    assert layout == other and "capture.kv_cache_layout" in why
    flex = _backend_class("FLEX_ATTENTION")
    from kvdbg.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="does not support"):
        choose_layout(flex, replace(meta, capture={"kv_cache_layout": "LBHNC"}))


def test_the_vllm_interfaces_the_column_calls_have_the_shape_it_expects():
    """What kvdbg hands vLLM 0.33, checked against its signatures (the column runs them on a GPU)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionImpl, CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views

    fields = inspect.signature(CommonAttentionMetadata).parameters
    for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
                 "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "causal",
                 "seq_lens_cpu_upper_bound"):
        assert name in fields, name
    layer = inspect.signature(Attention).parameters
    for name in ("cache_config", "logits_soft_cap", "per_layer_sliding_window", "prefix", "attn_backend"):
        assert name in layer, name
    assert list(inspect.signature(AttentionImpl.forward).parameters)[:8] == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
    assert {"layer_stride", "block_stride"} <= set(inspect.signature(KVCacheTensor).parameters)
    assert list(inspect.signature(compute_layout_strides).parameters)[:4] == [
        "spec", "num_blocks", "num_layers", "layout"]
    assert list(inspect.signature(create_kv_cache_views).parameters)[:5] == [
        "raw", "spec", "num_blocks", "layout", "kv_cache_tensor"]
    for name in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN"):
        impl = _backend_class(name).get_impl_cls()
        assert list(inspect.signature(impl.do_kv_cache_update).parameters)[:6] == [
            "self", "layer", "key", "value", "kv_cache", "slot_mapping"], name


# --------------------------------------------------------------------------- layer features through TRITON_ATTN

def _record_kernel_calls(monkeypatch):
    """vLLM 0.33's TritonAttentionImpl runs as it is; its two Triton kernels (GPU code) are stood in for: the cache
    write keeps nothing, the attention kernel records the arguments the impl hands it and writes zeros. The
    stand-ins compute no attention: what is checked is what reaches the kernel, not what it computes (the GPU
    run, tests/gpu/run_vllm_column.sh, runs the real kernels)."""
    from vllm.v1.attention.backends import triton_attn

    from kvdbg.backends import vllm_native

    calls = []

    def unified_attention(**kwargs):
        calls.append(kwargs)
        kwargs["out"].fill_(0)

    monkeypatch.setattr(triton_attn, "unified_attention", unified_attention)
    monkeypatch.setattr(triton_attn, "triton_reshape_and_cache_flash", lambda *args, **kwargs: None)
    # vLLM's platform is unspecified here (no GPU): the column would say so and stop (see the tests above).
    monkeypatch.setattr(vllm_native, "platform_reason", lambda name, device: None)
    return calls


def test_triton_attn_hands_the_snapshots_sinks_alibi_and_soft_cap_to_its_kernel(monkeypatch):
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.replayer.runner import replay

    calls = _record_kernel_calls(monkeypatch)
    sinks = (0.5, -1.0, 2.0, 0.25, 0.0, 1.5, -0.5, 3.0)  # exact in bfloat16: handed in the model dtype
    snap = synth_snapshot(SynthSpec(seq_lens=(9, 40), query_lens=(1, 3), num_heads=8, num_kv_heads=2, head_size=64,
                                    page_size=16, dtype="bfloat16", backend="TRITON_ATTN", sinks=sinks,
                                    alibi_slopes="auto", alibi_sqrt=True, logits_soft_cap=30.0, sliding_window=24,
                                    steps=2))
    result = replay(snap, ["reference", "vllm"], ReplayOptions(device="cpu"), required=["vllm"])
    status = next(st for st in result.backends if st.name == "vllm")
    assert status.available and "TritonAttentionImpl" in status.info.kernel
    assert len(calls) == 2  # one kernel call per step, from vLLM's own forward
    for kw in calls:
        assert kw["sinks"].dtype == torch.bfloat16 and torch.equal(kw["sinks"].float(), snap.sinks)
        assert kw["alibi_slopes"].dtype == torch.float32 and torch.equal(kw["alibi_slopes"], snap.alibi_slopes)
        assert kw["use_alibi_sqrt"] is True and kw["softcap"] == 30.0
        assert tuple(kw["window_size"]) == (23, 0) and kw["chunk_lookback"] == -1
        assert bool(kw["causal"])


def test_float32_sinks_the_model_dtype_would_round_reach_the_kernel_unrounded(monkeypatch):
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.replayer.runner import replay

    calls = _record_kernel_calls(monkeypatch)
    snap = synth_snapshot(SynthSpec(seq_lens=(9, 40), num_heads=8, num_kv_heads=2, head_size=64, page_size=16,
                                    dtype="float16", backend="TRITON_ATTN", sinks="auto", sliding_window=32,
                                    chunk_lookback=1))
    result = replay(snap, ["reference", "vllm"], ReplayOptions(device="cpu"), required=["vllm"])
    notes = " ".join(next(st for st in result.backends if st.name == "vllm").info.notes)
    assert "(in float32: the model dtype would round them)" in notes and "chunk_lookback=1" in notes
    (kw,) = calls
    assert kw["sinks"].dtype == torch.float32 and torch.equal(kw["sinks"], snap.sinks)
    assert kw["alibi_slopes"] is None and kw["chunk_lookback"] == 1


@pytest.mark.parametrize("backend, features, reason", [
    ("FLEX_ATTENTION", dict(alibi_slopes="auto"), "FlexAttention does not support alibi slopes"),
    ("FLEX_ATTENTION", dict(sinks="auto"), "rejects this layer (attention sinks not supported)"),
    ("FLEX_ATTENTION", dict(alibi_slopes="auto", alibi_sqrt=True), "use_alibi_sqrt is not supported by backend"),
    ("FLEX_ATTENTION", dict(sliding_window=32, chunk_lookback=1),
     "Chunked attention with lookback requires the Triton"),
])
def test_a_feature_vllm_0_33_refuses_for_the_backend_makes_the_column_unavailable(monkeypatch, backend, features,
                                                                                  reason):
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.replayer.runner import replay

    _record_kernel_calls(monkeypatch)
    snap = synth_snapshot(SynthSpec(seq_lens=(9, 40), num_heads=8, num_kv_heads=2, head_size=64, page_size=16,
                                    dtype="bfloat16", backend=backend, engine_output="reference", **features))
    result = replay(snap, ["reference", "vllm"], ReplayOptions(device="cpu"))
    status = next(st for st in result.backends if st.name == "vllm")
    assert not status.available and reason in status.reason and "\n" not in status.reason, status.reason
    assert not any(f.backend == "vllm" for f in result.findings)


def _column_engine(meta, layout):
    from kvdbg.backends._vllm_engine import MinimalEngine

    return MinimalEngine(_backend_class(meta.backend.name), meta, "cpu", 16, 4, 64, layout=layout)


def test_the_columns_engine_config_holds_the_layout_vllms_engine_core_resolves():
    """The builders of some backends (FLASHINFER's) read the model's resolved layout from the config; vLLM 0.33's
    engine core resolves it before any builder runs, so the column's config must hold that resolution."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    meta = synth_snapshot(SynthSpec(seq_lens=(5, 40), page_size=16, backend="TRITON_ATTN")).meta
    cls = _backend_class("TRITON_ATTN")
    engine = _column_engine(meta, choose_layout(cls, meta))
    # What the engine core resolves for a fresh config of this layer: the worker's report is vLLM's own.
    unresolved = _column_engine(meta, None)
    assert unresolved.config.cache_config.kv_cache_layout is None
    expected = resolve_kv_cache_layout(unresolved.config, [[m.name for m in get_supported_kv_cache_layouts([cls])]],
                                       [unresolved.spec])
    assert engine.resolved_layout == expected == choose_layout(cls, meta)[0]
    with set_current_vllm_config(engine.config):
        assert engine.config.cache_config.get_resolved_kv_cache_layout() == expected


def test_the_layout_the_engine_recorded_is_the_one_the_columns_config_resolves(monkeypatch):
    from dataclasses import replace

    from kvdbg.errors import BackendUnavailable

    meta = synth_snapshot(SynthSpec(seq_lens=(5,), page_size=16, backend="TRITON_ATTN")).meta
    cls = _backend_class("TRITON_ATTN")
    last = supported_layouts(cls)[-1]
    assert last != supported_layouts(cls)[0]
    captured = replace(meta, capture={"kv_cache_layout": last.name})
    engine = _column_engine(captured, choose_layout(cls, captured))
    assert engine.config.cache_config.kv_cache_layout == last.name and engine.resolved_layout == last
    # A layout forced on vLLM that is not the one the cache is viewed with: the column says so, never mixes them.
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", supported_layouts(cls)[0].name)
    with pytest.raises(BackendUnavailable, match=f"resolves the KV-cache layout {supported_layouts(cls)[0].name}"):
        _column_engine(meta, (last, "a test's choice"))
