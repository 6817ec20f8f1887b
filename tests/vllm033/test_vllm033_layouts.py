"""kvdbg's reading of vLLM 0.33's declared KV-cache layouts, held to vLLM's own classes on a CPU.

What is vLLM's own here (the CUDA wheel's Python, run on a CPU torch): the attention
layer (``Attention``), each backend's class, impl and metadata builder (FLASH_ATTN,
TRITON_ATTN; FLASHINFER's builder excepted, below), the specs the layer declares
(``get_kv_cache_spec``), ``KVCacheLayout``, the layout the engine core would resolve
(``resolve_kv_cache_layout`` over ``get_supported_kv_cache_layouts``), the cache
planning (``get_kv_cache_config_from_groups``) and allocation into per-layer views
(``allocate_kv_cache`` → ``create_kv_cache_views``), each impl's ``do_kv_cache_update``
(which splits the view into K and V: ``kv_cache.transpose(1, 2).split(head_size, -1)``)
and the forward path through the layer and vLLM's ops.

What stands in, because it is GPU code that cannot run on a CPU:

- the cache-write kernels the impls call (``reshape_and_cache_flash`` for FLASH_ATTN and
  FLASHINFER, ``triton_reshape_and_cache_flash`` for TRITON_ATTN): a torch loop writing each
  token's K and V into the K and V views the impl hands it, at its slot (FP8: ``x / scale``
  rounded to e4m3, saturated);
- each impl's ``forward`` (flash-attn, Triton and FlashInfer kernels): exact attention in
  float32 over the cache read through the same K/V views, with the metadata vLLM's builder
  built (block table, lengths, causal), written into the output buffer;
- FLASHINFER's ``build`` (it launches a Triton kernel and plans FlashInfer wrappers on the
  GPU): the engine-level block table, lengths and causal flag, passed through;
- device probes (pinned memory, FlashInfer's SM count).

The plugin's wrappers sit on vLLM's real classes around those stand-ins, exactly as they
wrap the kernels in an engine.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from kvdbg import vllm_plugin

from kvdbg.vllm_plugin import vllm_facts
from kvdbg.cli import cli
from kvdbg.capture.engine_layouts import (
    LayerCacheDeclaration,
    LayoutError,
    check_written_kv,
    declared_layout,
    strides_follow,
    vllm_layout,
)
from kvdbg.snapshot.store import load_snapshot

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import flash_attn, flashinfer, triton_attn
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

BACKENDS = {
    "FLASH_ATTN": flash_attn.FlashAttentionBackend,
    "TRITON_ATTN": triton_attn.TritonAttentionBackend,
    "FLASHINFER": flashinfer.FlashInferBackend,
}
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 12
FP8_SCALES = (1.0, 0.05, 0.04)  # q, k, v: what a checkpoint with FP8 scales leaves on the layer
# FLASH_ATTN's impl refuses an FP8 cache unless flash-attn 3 is there (a CUDA probe); the others take one on CPU.
FP8_BACKENDS = ("TRITON_ATTN", "FLASHINFER")
CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": NUM_HEADS * HEAD_SIZE,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_SIZE, "vocab_size": 512, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    """A real VllmConfig for a tiny model (a config.json is all ModelConfig reads), on the CPU device."""
    model = tmp_path_factory.mktemp("tiny-model")
    (model / "config.json").write_text(json.dumps(CONFIG_JSON))
    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512)
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK_SIZE),
                      device_config=DeviceConfig(device="cpu"))


@pytest.fixture
def vllm_config(base_config):
    config = copy.copy(base_config)
    config.cache_config = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS)
    return config


# --------------------------------------------------------------------------- the GPU code that stands in


def standin_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Stands in for vLLM's reshape_and_cache_flash kernels: token t's K/V into the K/V views at slot_mapping[t]."""
    fp8 = str(kv_cache_dtype).startswith("fp8")
    block_size = key_cache.shape[1]  # the views are [blocks, tokens, heads, D]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for cache, x, scale in ((key_cache, key[t], k_scale), (value_cache, value[t], v_scale)):
            if fp8:
                x = (x.float() / float(scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                x = x.view(torch.uint8) if cache.dtype == torch.uint8 else x
            cache[block, offset] = x.to(cache.dtype) if not fp8 else x


def standin_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
    """Stands in for the backend's attention kernel: float32 attention over the cache, read through the K/V views
    the backend's own forward takes (``kv_cache.transpose(1, 2).split(head_size, -1)``), with vLLM's metadata."""
    if attn_metadata is None:
        return output.fill_(0)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
    fp8 = str(self.kv_cache_dtype).startswith("fp8")
    if fp8:
        key_cache = key_cache.view(torch.float8_e4m3fn).float() * layer._k_scale_float
        value_cache = value_cache.view(torch.float8_e4m3fn).float() * layer._v_scale_float
    if query.dtype == torch.float8_e4m3fn:
        query = query.float() * layer._q_scale_float
    qsl = attn_metadata.query_start_loc.tolist()
    block_size, groups = key_cache.shape[1], self.num_heads // self.num_kv_heads
    for r, length in enumerate(attn_metadata.seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        blocks = attn_metadata.block_table[r, :math.ceil(length / block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(groups, dim=1)
        v = value_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * self.scale
        if bool(attn_metadata.causal):
            positions = torch.arange(length - (end - start), length).unsqueeze(1)
            scores = scores.masked_fill(torch.arange(length).unsqueeze(0) > positions, float("-inf"))
        output[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(output.dtype)
    return output


def standin_flashinfer_build(self, common_prefix_len, common_attn_metadata, fast_build=False):
    """Stands in for FlashInferMetadataBuilder.build (a Triton kernel and FlashInfer's GPU planning)."""
    c = common_attn_metadata
    return SimpleNamespace(block_table=c.block_table_tensor, seq_lens=c.seq_lens, query_start_loc=c.query_start_loc,
                           causal=c.causal, num_actual_tokens=c.num_actual_tokens)


_CACHE_OPS = None


def _register_cache_op() -> None:
    """torch.ops._C_cache_ops.reshape_and_cache_flash (vLLM's compiled op, absent here) as the torch stand-in."""
    global _CACHE_OPS
    if _CACHE_OPS is not None:
        return
    _CACHE_OPS = torch.library.Library("_C_cache_ops", "DEF")
    _CACHE_OPS.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,"
                      " Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")
    _CACHE_OPS.impl("reshape_and_cache_flash", standin_cache_write, "CompositeExplicitAutograd")


@pytest.fixture
def gpu_standins(monkeypatch):
    import vllm.v1.utils

    _register_cache_op()
    monkeypatch.setattr(vllm.v1.utils, "PIN_MEMORY", False)
    monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", standin_cache_write, raising=False)
    monkeypatch.setattr(triton_attn, "triton_reshape_and_cache_flash", standin_cache_write)
    monkeypatch.setattr(flashinfer, "get_device_sm_count", lambda device: 132)
    monkeypatch.setattr(flashinfer, "_get_multi_ctas_kv_counter_buffer",
                        lambda size, device: torch.zeros(size, dtype=torch.uint8))
    monkeypatch.setattr(flashinfer.FlashInferMetadataBuilder, "build", standin_flashinfer_build)
    for backend in BACKENDS.values():
        monkeypatch.setattr(backend.get_impl_cls(), "forward", standin_forward)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    return monkeypatch


# --------------------------------------------------------------------------- a layer group, as the engine builds it

_names = itertools.count()


def build_layers(config, backend, *, fp8=False, layers=2):
    config.cache_config.cache_dtype = "fp8" if fp8 else "auto"  # the engine's, as its builders read it
    cache_config = CacheConfig(block_size=BLOCK_SIZE, cache_dtype=config.cache_config.cache_dtype)
    built = []
    with set_current_vllm_config(config), torch.device("cpu"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            for _ in range(layers):
                layer = Attention(NUM_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, NUM_KV_HEADS, cache_config=cache_config,
                                  prefix=f"model.layers.{next(_names)}.self_attn.attn", attn_backend=backend)
                if fp8:
                    for name, value in zip(("q", "k", "v"), FP8_SCALES):
                        getattr(layer, f"_{name}_scale").fill_(value)
                        setattr(layer, f"_{name}_scale_float", value)
                built.append(layer)
        finally:
            torch.set_default_dtype(previous)
    return built


def allocate(config, layers, layout, spec=None):
    """vLLM's own planning and allocation: one raw buffer, one [B, H, N, C] view per layer, in ``layout``."""
    spec = spec or layers[0].get_kv_cache_spec(config)
    names = [layer.layer_name for layer in layers]
    page = spec.page_size_padded or spec.page_size_bytes
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)],
                                                available_memory=page * NUM_BLOCKS * len(layers))
    views = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    for layer in layers:
        layer.kv_cache = views[layer.layer_name]
    return spec, views


def resolved_layout(config, backend, spec) -> KVCacheLayout:
    """The layout vLLM's engine core resolves for a model served by ``backend`` alone."""
    config.cache_config.kv_cache_layout = None
    supported = [[m.name for m in get_supported_kv_cache_layouts([backend])]]
    return resolve_kv_cache_layout(config, supported, [spec])


def batch(lengths, query_lens, seed=0):
    """A CommonAttentionMetadata for requests of ``lengths`` tokens whose last ``query_lens`` are new, on shuffled
    blocks (block 0 stays the null block)."""
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    width = max(math.ceil(n / BLOCK_SIZE) for n in lengths) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    slots = []
    for r, (length, q) in enumerate(zip(lengths, query_lens)):
        need = math.ceil(length / BLOCK_SIZE)
        table[r, :need] = torch.tensor(pool[:need], dtype=torch.int32)
        pool = pool[need:]
        slots += [int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length - q, length)]
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor(lengths, dtype=torch.int32),
        num_reqs=len(lengths), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(lengths), block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        causal=True)


def extend(common, new_tokens=1):
    """The next step of the same requests: ``new_tokens`` more each, on the blocks they hold."""
    lengths = [n + new_tokens for n in common.seq_lens.tolist()]
    table = common.block_table_tensor
    slots = [int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for r, length in enumerate(lengths) for p in range(length - new_tokens, length)]
    qsl = torch.arange(len(lengths) + 1, dtype=torch.int32) * new_tokens
    return dataclasses.replace(common, query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
                               seq_lens=torch.tensor(lengths, dtype=torch.int32), num_actual_tokens=int(qsl[-1]),
                               max_query_len=new_tokens, max_seq_len=max(lengths),
                               slot_mapping=torch.tensor(slots, dtype=torch.int64))


def run_step(config, layers, builder, common, seed):
    """One engine step through vLLM's layer: the builder's metadata, then each layer's forward (cache update and
    attention). Returns, per layer, the cache as the step found it and the output."""
    gen = torch.Generator().manual_seed(seed)
    metadata = builder.build(0, common)
    seen = []
    n = common.num_actual_tokens
    for layer in layers:
        # Attention logits of a few units, so that reading a wrong page changes the output.
        query = (torch.randn(n, NUM_HEADS * HEAD_SIZE, generator=gen) * 0.5).to(torch.bfloat16)
        key = (torch.randn(n, NUM_KV_HEADS * HEAD_SIZE, generator=gen) * 0.5).to(torch.bfloat16)
        value = torch.randn(n, NUM_KV_HEADS * HEAD_SIZE, generator=gen).to(torch.bfloat16)
        before = layer.kv_cache.clone()
        with set_forward_context({layer.layer_name: metadata}, config,
                                 slot_mapping={layer.layer_name: common.slot_mapping}):
            output = layer.forward(query, key, value)
        seen.append(dict(before=before, output=output, key=key, value=value))
    return seen


# --------------------------------------------------------------------------- each declared layout


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("member", list(KVCacheLayout), ids=lambda m: m.name)
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_each_declared_layout_reads_back_what_the_backends_cache_update_wrote(gpu_standins, vllm_config,
                                                                              backend_name, member, fp8):
    if fp8 and backend_name not in FP8_BACKENDS:
        pytest.skip("FlashAttention's impl refuses an FP8 cache without flash-attn 3 (a CUDA probe)")
    backend = BACKENDS[backend_name]
    vllm_config.cache_config.kv_cache_layout = member.name
    layers = build_layers(vllm_config, backend, fp8=fp8)
    spec, views = allocate(vllm_config, layers, member)
    kv_cache_dtype = "fp8" if fp8 else "auto"
    decl = LayerCacheDeclaration(backend=backend_name, layout=member, spec=spec, kv_cache_dtype=kv_cache_dtype,
                                 supported_layouts=backend.supported_kv_cache_layouts())
    layout = declared_layout(decl, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)
    assert layout.name == f"vllm:{member.name}"
    common = batch([37, 20], [37, 20])
    gen = torch.Generator().manual_seed(1)
    for layer in layers:
        view = layer.kv_cache
        assert strides_follow(view, member.layer_view_order), (member, view.stride())
        layout.check(view, NUM_KV_HEADS, HEAD_SIZE)
        for other in KVCacheLayout:  # a layout whose layer order differs is refused by the strides
            if other.layer_view_order != member.layer_view_order:
                with pytest.raises(LayoutError, match="do not lay its axes out in the order"):
                    vllm_layout(other).check(view, NUM_KV_HEADS, HEAD_SIZE)
        key = torch.randn(57, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
        value = torch.randn(57, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
        layer.impl.do_kv_cache_update(layer, key, value, view, common.slot_mapping)  # vLLM's own indexing
        scales = dict(k_scale=FP8_SCALES[1], v_scale=FP8_SCALES[2]) if fp8 else {}
        assert check_written_kv(layout, view, key=key, value=value, slot_mapping=common.slot_mapping,
                                head_size=HEAD_SIZE, kv_cache_dtype=kv_cache_dtype, **scales) == 57
    # The two layers share one buffer: each holds its own K/V, so the layer axis was read right too.
    assert not torch.equal(layers[0].kv_cache, layers[1].kv_cache)


def test_padded_pages_read_back(gpu_standins, vllm_config):
    """A spec whose pages are padded (hybrid models pad attention pages to the largest page) reads the same."""
    member = KVCacheLayout.LBHNC
    vllm_config.cache_config.kv_cache_layout = member.name
    layers = build_layers(vllm_config, BACKENDS["TRITON_ATTN"])
    spec = layers[0].get_kv_cache_spec(vllm_config)
    spec = dataclasses.replace(spec, page_size_padded=spec.page_size_bytes + 256)
    _, views = allocate(vllm_config, layers, member, spec)
    view = layers[0].kv_cache
    assert view.stride(0) * view.element_size() == spec.page_size_bytes == spec.unpadded_page_size_bytes + 256
    decl = LayerCacheDeclaration(backend="TRITON_ATTN", layout=member, spec=spec, kv_cache_dtype="auto")
    layout = declared_layout(decl, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)
    common = batch([37, 20], [5, 3])
    key = torch.randn(8, NUM_KV_HEADS, HEAD_SIZE).to(torch.bfloat16)
    value = torch.randn(8, NUM_KV_HEADS, HEAD_SIZE).to(torch.bfloat16)
    layers[0].impl.do_kv_cache_update(layers[0], key, value, view, common.slot_mapping)
    assert check_written_kv(layout, view, key=key, value=value, slot_mapping=common.slot_mapping,
                            head_size=HEAD_SIZE) == 8


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_the_resolved_default_layout_is_one_the_backend_declares(gpu_standins, vllm_config, backend_name):
    backend = BACKENDS[backend_name]
    layers = build_layers(vllm_config, backend, layers=1)
    spec = layers[0].get_kv_cache_spec(vllm_config)
    member = resolved_layout(vllm_config, backend, spec)
    supported = backend.supported_kv_cache_layouts()
    assert supported is None or member in supported
    decl = LayerCacheDeclaration(backend=backend_name, layout=member, spec=spec, kv_cache_dtype="auto",
                                 supported_layouts=supported)
    assert declared_layout(decl, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE).name == f"vllm:{member.name}"


# --------------------------------------------------------------------------- what cannot be stored


def _spec_cases(config):
    from vllm.v1 import kv_cache_interface as kci

    base = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    fp8 = dict(base, dtype=torch.uint8)
    mode = kci.get_kv_quant_mode
    return [
        ("MLA", kci.MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
         "auto", "MLA's latent cache"),
        ("NVFP4", flashinfer.FlashInferBackend.customize_spec(
            kci.FullAttentionSpec(**fp8, kv_quant_mode=mode("nvfp4"))), "nvfp4", "kv_quant_mode NVFP4"),
        ("FP8_PER_TOKEN_HEAD", triton_attn.TritonAttentionBackend.customize_spec(
            kci.FullAttentionSpec(**fp8, kv_quant_mode=mode("fp8_per_token_head"))), "fp8_per_token_head",
         "keeps a scale per token and head"),
        ("INT8_PER_TOKEN_HEAD", triton_attn.TritonAttentionBackend.customize_spec(
            kci.FullAttentionSpec(**fp8, kv_quant_mode=mode("int8_per_token_head"))), "int8_per_token_head",
         "kv_quant_mode INT8_PER_TOKEN_HEAD"),
        ("TURBOQUANT", kci.FullAttentionSpec(**fp8, kv_quant_mode=mode("turboquant_k8v4")), "turboquant_k8v4",
         "kv_quant_mode TURBOQUANT_K8V4"),
        ("fp8_e5m2", kci.FullAttentionSpec(**fp8, kv_quant_mode=mode("fp8_e5m2")), "fp8_e5m2",
         "'fp8_e5m2' is an FP8 format the snapshot format does not hold"),
        ("head_size_v", kci.FullAttentionSpec(**base, head_size_v=128), "auto", "head_size_v 128 differs"),
        ("packed", kci.FullAttentionSpec(**base, state_content_bytes=300), "auto", "state_content_bytes=300"),
        ("tokens_per_state", kci.FullAttentionSpec(**base, tokens_per_state=4), "auto", "covers 4 tokens"),
        ("chunked", kci.ChunkedLocalAttentionSpec(**base, attention_chunk_size=256), "auto",
         "chunked local attention (attention_chunk_size=256)"),
        ("cross", kci.CrossAttentionSpec(**base), "auto", "cross-attention, encoder-only or self-addressed"),
        ("encoder_only", kci.EncoderOnlyAttentionSpec(**base), "auto", "cross-attention, encoder-only"),
        ("ring", kci.CircularBufferSpec(**base), "auto", "self-addressed"),
        ("mamba", kci.MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.bfloat16,)), "auto",
         "not an attention cache of K and V"),
    ]


def test_every_spec_kvdbg_cannot_store_is_refused_in_one_line_naming_it(vllm_config):
    for what, spec, kv_cache_dtype, says in _spec_cases(vllm_config):
        decl = LayerCacheDeclaration(backend="TRITON_ATTN", layout=KVCacheLayout.LBNHC, spec=spec,
                                     kv_cache_dtype=kv_cache_dtype)
        with pytest.raises(LayoutError) as info:
            declared_layout(decl, num_kv_heads=spec.num_kv_heads if hasattr(spec, "num_kv_heads") else NUM_KV_HEADS,
                            head_size=getattr(spec, "head_size", HEAD_SIZE))
        assert says in str(info.value) and "\n" not in str(info.value), (what, str(info.value))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_per_tensor_is_read(kv_cache_dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    decl = LayerCacheDeclaration(backend="FLASH_ATTN", layout=KVCacheLayout.LBNHC, spec=spec,
                                 kv_cache_dtype=kv_cache_dtype)
    assert declared_layout(decl, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE).name == "vllm:LBNHC"
    per_head = dataclasses.replace(decl, per_head_scales=True)
    with pytest.raises(LayoutError, match="the FP8 scales are per head"):
        declared_layout(per_head, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)


def test_cudagraph_modes_are_said_as_vllm_defines_them():
    from vllm.config import CUDAGraphMode

    said = {mode.name: " ".join(line for _, line in vllm_facts.cudagraph_note(mode, 512)) for mode in CUDAGraphMode}
    assert said["NONE"] == "" and said["PIECEWISE"] == ""
    assert "uniform decode batches of up to 512 tokens" in said["FULL_DECODE_ONLY"]
    assert "uniform decode batches of up to 512 tokens" in said["FULL_AND_PIECEWISE"]
    assert "every batch of up to 512 tokens" in said["FULL"]


# --------------------------------------------------------------------------- through the plugin's wrappers


@pytest.fixture
def plugin(gpu_standins, tmp_path):
    """The plugin registered as vLLM would (auto: the backend of each layer built), writing in the caller."""
    for name, value in {"KVDBG_CAPTURE_DIR": str(tmp_path / "snaps"), "KVDBG_CAPTURE_QUEUE_BYTES": "0"}.items():
        gpu_standins.setenv(name, value)
    gpu_standins.delenv("KVDBG_CAPTURE_BACKENDS", raising=False)
    vllm_plugin.unregister()
    vllm_plugin.register()
    assert vllm_plugin.active_capturer() is not None
    yield tmp_path / "snaps"
    vllm_plugin.unregister()


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_a_capture_through_the_plugin_loads_maps_and_replays(plugin, vllm_config, backend_name, fp8):
    if fp8 and backend_name not in FP8_BACKENDS:
        pytest.skip("FlashAttention's impl refuses an FP8 cache without flash-attn 3 (a CUDA probe)")
    backend = BACKENDS[backend_name]
    layers = build_layers(vllm_config, backend, fp8=fp8)  # built after register(): the plugin wraps the backend
    spec = layers[0].get_kv_cache_spec(vllm_config)
    member = resolved_layout(vllm_config, backend, spec)
    allocate(vllm_config, layers, member, spec)
    with set_current_vllm_config(vllm_config):
        builder = backend.get_builder_cls()(spec, [layer.layer_name for layer in layers], vllm_config,
                                            torch.device("cpu"))
    prefill = batch([37, 20], [37, 20])
    run_step(vllm_config, layers, builder, prefill, seed=1)
    decode = extend(prefill)
    seen = run_step(vllm_config, layers, builder, decode, seed=2)

    snaps = {(s.meta.layer.name, s.meta.capture["step"]): (p, s)
             for p in sorted(plugin.iterdir()) for s in [load_snapshot(str(p))]}
    assert len(snaps) == 4, sorted(snaps)  # 2 layers x 2 steps
    for i, layer in enumerate(layers):
        path, snap = snaps[layer.layer_name, 1]
        cap = snap.meta.capture
        assert (cap["attention_backend"], cap["kv_cache_layout"], cap["kv_layout_engine"]) == \
            (backend_name, member.name, f"vllm:{member.name}")
        assert cap["kv_cache_spec"]["class"] == type(spec).__name__
        assert cap["kv_layout_read_back"].startswith("passed: the 2 slots do_kv_cache_update wrote read back")
        assert snap.meta.layer.kv_cache_dtype == ("fp8_e4m3" if fp8 else "auto")
        # The pages as the step found them, K|V per token, read through the declared layout.
        engine_pages = seen[i]["before"][snap.page_ids.long()]
        assert torch.equal(snap.kv_cache.view(torch.uint8) if fp8 else snap.kv_cache,
                           engine_pages.view(torch.uint8) if fp8 else engine_pages)
        assert torch.equal(snap.steps[0].output, seen[i]["output"].view(snap.steps[0].output.shape))

        replay = invoke("replay", "--json", path)
        assert replay.exit_code in (0, 1), replay.output
        comparisons = {(c["actual"], c["expected"]): c for c in json.loads(replay.stdout)["comparisons"]}
        heads = comparisons["captured", "reference"]["heads"]
        assert heads and all(h["passed"] for h in heads), heads
        assert invoke("map", path).exit_code == 0
        info = invoke("info", path)
        assert info.exit_code == 0 and backend_name in info.output


def test_a_mis_declared_layout_is_refused_in_one_line_and_nothing_is_written(plugin, vllm_config, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    backend = BACKENDS["FLASH_ATTN"]
    layers = build_layers(vllm_config, backend)
    spec = layers[0].get_kv_cache_spec(vllm_config)
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    allocate(vllm_config, layers, KVCacheLayout.LBNHC, spec)  # the caches are LBNHC ...
    vllm_config.cache_config.kv_cache_layout = "LHBNC"  # ... the engine says LHBNC
    with set_current_vllm_config(vllm_config):
        builder = backend.get_builder_cls()(spec, [layer.layer_name for layer in layers], vllm_config,
                                            torch.device("cpu"))
    prefill = batch([37, 20], [37, 20])
    run_step(vllm_config, layers, builder, prefill, seed=1)
    seen = run_step(vllm_config, layers, builder, extend(prefill), seed=2)
    assert not plugin.exists() and all(s["output"].isfinite().all() for s in seen)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, refused
    assert "FLASH_ATTN layer" in refused[0] and "that layout 'vllm:LHBNC' declares" in refused[0]
