"""What the GPU engine stage (tests/gpu/engine_stage.py) relies on in vLLM 0.33, held to vLLM's own classes on a CPU.

- the sentinel's faults (tests/gpu/triton_faults.py) on TRITON_ATTN's own forward, metadata and cache view: each
  lands where it says (the Triton kernel stands in as in test_vllm033_layouts);
- the soft-capped model (a tiny Gemma 2): vLLM's config reads it as the stage needs, and its weights are the ones
  the architecture names;
- the harness's activation stand-ins compute what vLLM's own torch-native forward computes.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest
import torch

from tests.engine import sentinel_faults
from tests.gpu import triton_faults
from tests.helpers import ROOT

# By the name pytest imports it under (this folder has no __init__.py): one module object, whose stand-in op
# library is registered once however the two files are collected.
from test_vllm033_layouts import (  # noqa: E402, F401  (fixtures)
    BACKENDS, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, allocate, base_config, batch, build_layers, extend, gpu_standins,
    resolved_layout, standin_forward, vllm_config
)


def test_the_faults_target_tritons_forward_and_its_metadata_fields():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadata

    assert triton_faults.impl_class() is TritonAttentionImpl
    assert list(inspect.signature(TritonAttentionImpl.forward).parameters)[:8] == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
    fields = {f.name for f in dataclasses.fields(TritonAttentionMetadata)}
    assert {"block_table", "num_actual_tokens", "seq_lens", "query_start_loc"} <= fields


def _index(layer) -> int:
    return int(layer.layer_name.split(".layers.")[1].split(".")[0])


def _call(layer, query, key, value, metadata):
    output = torch.empty(query.shape[0], NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    layer.impl.forward(layer, query, key, value, layer.kv_cache, metadata, output=output)
    return output


def test_each_fault_lands_where_it_says_in_tritons_own_metadata_and_cache(gpu_standins, vllm_config):
    """Two TRITON_ATTN layers on vLLM's own allocation; step 0 fills the cache, step 1 carries the head fault on
    one layer and the page fault on the other, step 2 the NaN; the kernel is the float32 stand-in."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    monkeypatch = gpu_standins
    monkeypatch.setattr(sentinel_faults, "_installed", None)
    backend = BACKENDS["TRITON_ATTN"]
    layers = build_layers(vllm_config, backend)
    spec = layers[0].get_kv_cache_spec(vllm_config)
    allocate(vllm_config, layers, resolved_layout(vllm_config, backend, spec))
    a, b = (_index(layer) for layer in layers)
    triton_faults.install(f"head:{a}:1,page:{b}:1,nan:{a}:2")  # over the stand-in kernel gpu_standins put there
    assert TritonAttentionImpl.forward._sentinel_fault_original is standin_forward

    gen = torch.Generator().manual_seed(0)
    builder = backend.get_builder_cls()(spec, [layer.layer_name for layer in layers], vllm_config,
                                        torch.device("cpu"))

    def inputs(n):
        return ((torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=gen) * 2).to(torch.bfloat16),
                torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16) * 2,
                torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16))

    def step(common, layer):
        metadata = builder.build(0, common)
        q, k, v = inputs(common.num_actual_tokens)
        layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, common.slot_mapping)
        clean = standin_forward(layer.impl, layer, q, k, v, layer.kv_cache, metadata,
                                torch.empty(q.shape[0], NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16))
        table = metadata.block_table.clone()
        return metadata, table, clean, _call(layer, q, k, v, metadata), (q, k, v)

    common = batch([37, 20], [37, 20])
    for layer in layers:  # step 0: no fault
        _, _, clean, out, _ = step(common, layer)
        assert torch.equal(out, clean)
    common = extend(common)
    # step 1, layer a: head 1 of every token moved by +1 after the kernel, nothing else
    metadata, table, clean, out, _ = step(common, layers[0])
    assert torch.equal(out[:, 1], clean[:, 1] + 1.0)
    assert torch.equal(out[:, [0, 2, 3]], clean[:, [0, 2, 3]])
    # step 1, layer b: the kernel read request 1's first page in place of request 0's; the metadata stays right
    metadata, table, clean, out, qkv = step(common, layers[1])
    assert torch.equal(metadata.block_table, table) and table[0, 0] != table[1, 0]
    wrong = dataclasses.replace(metadata, block_table=table.clone())
    wrong.block_table[0, 0] = table[1, 0]
    expected = standin_forward(layers[1].impl, layers[1], *qkv, layers[1].kv_cache, wrong, torch.empty_like(out))
    assert torch.equal(out, expected)
    assert not torch.equal(out[0], clean[0]) and torch.equal(out[1], clean[1])
    # step 2, layer a: NaN in KV head 0 of request 0's first page (K and V, every token), read by heads 0 and 1
    common = extend(common)
    metadata, table, clean, out, _ = step(common, layers[0])
    page = int(table[0, 0])
    key_cache, value_cache = layers[0].kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)  # TRITON_ATTN's own views
    assert key_cache[page, :, 0].isnan().all() and value_cache[page, :, 0].isnan().all()
    assert not key_cache[page, :, 1].isnan().any() and not key_cache[int(table[1, 0])].isnan().any()
    assert out[0, :2].isnan().all() and not out[0, 2:].isnan().any() and not out[1].isnan().any()
    assert [kind for kind, _, _ in triton_faults.fired()] == ["head", "page", "nan"]
    assert triton_faults.fired()[2] == ("nan", layers[0].layer_name, 2)


def test_the_soft_capped_model_is_a_bfloat16_gemma2_with_one_kind_of_kv_cache(tmp_path):
    from vllm.config import ModelConfig

    from tests.gpu.engine_stage import MODELS, cases_of
    from tests.engine.tiny_model import write_model

    model = MODELS["softcap"]
    directory = write_model(model, str(tmp_path / "softcap"))
    config = ModelConfig(model=directory, skip_tokenizer_init=True, dtype=model.dtype, max_model_len=512)
    assert config.architectures == ["Gemma2ForCausalLM"] and config.dtype == torch.bfloat16
    hf = config.hf_config
    assert hf.attn_logit_softcapping == model.soft_cap == 5.0 and hf.final_logit_softcapping is None
    assert hf.layer_types == ["full_attention"] * model.num_layers and config.get_sliding_window() is None
    assert hf.query_pre_attn_scalar == model.head_dim  # the scale, head_dim ** -0.5, as the Llama models'
    with pytest.raises(Exception, match="bfloat16 or float32"):  # why the model is bfloat16
        ModelConfig(model=directory, skip_tokenizer_init=True, dtype="float16", max_model_len=512)
    assert cases_of("softcap") == ["prefill_decode", "chunked_mixed", "prefix_hit"]


def test_the_soft_capped_models_weights_are_gemma2s_and_its_attention_is_capped(tmp_path):
    """transformers' own Gemma 2 takes the checkpoint with no key missing or left over, and its attention logits
    reach the cap (so a replay that dropped it would fail)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Gemma2ForCausalLM

    from tests.engine.tiny_model import write_model
    from tests.gpu.engine_stage import MODELS

    directory = write_model(MODELS["softcap"], str(tmp_path / "softcap"))
    config = AutoConfig.from_pretrained(directory)
    model = Gemma2ForCausalLM(config).to(torch.bfloat16)
    weights = load_file(os.path.join(directory, "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert unexpected == [] and [k for k in missing if k != "lm_head.weight"] == []  # lm_head is the embedding
    layer = model.model.layers[0].self_attn
    x = model.model.embed_tokens(torch.arange(3, 67).unsqueeze(0)) * config.hidden_size ** 0.5
    x = model.model.layers[0].input_layernorm(x)
    q = layer.q_proj(x).view(64, config.num_attention_heads, -1).transpose(0, 1).float()
    k = layer.k_proj(x).view(64, config.num_key_value_heads, -1).transpose(0, 1).float()
    logits = q[:2] @ k[0].T * config.query_pre_attn_scalar ** -0.5  # two heads of KV head 0, no position
    assert logits.abs().max() > 2 * config.attn_logit_softcapping


def test_the_harness_activations_compute_what_vllms_native_forward_does(tmp_path):
    """tests/gpu/stub_site's plain-torch ``silu_and_mul``, ``gelu_and_mul`` and ``gelu_tanh_and_mul`` (in a child
    interpreter: they register into torch.ops._C, which must stay as it is for the other tests)."""
    stub = os.path.join(ROOT, "tests", "gpu", "stub_site", "sitecustomize.py")
    script = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("stub", {stub!r})
stub = importlib.util.module_from_spec(spec); spec.loader.exec_module(stub)
stub._register_activation()
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
x = torch.randn(5, 2 * 48, dtype=torch.bfloat16)
native = {{"silu_and_mul": SiluAndMul.forward_native(x)}}  # a static method
for name, approximate in (("gelu_and_mul", "none"), ("gelu_tanh_and_mul", "tanh")):
    gelu = GeluAndMul.__new__(GeluAndMul)
    gelu.approximate = approximate  # what __init__ keeps; its op lookup needs CUDA
    native[name] = GeluAndMul.forward_native(gelu, x)
for name, want in native.items():
    out = torch.empty(5, 48, dtype=torch.bfloat16)
    getattr(torch.ops._C, name)(out, x)
    assert torch.equal(out, want), name
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, VLLM_CONFIGURE_LOGGING="0"), timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_the_harness_cache_write_is_vllms_and_records_in_a_cuda_graph():
    """tests/gpu/stub_site's ``reshape_and_cache_flash`` (FLASHINFER's cache write on the GPU machine) writes what a
    token-by-token write does -- padded slots (-1) write nothing, FP8 stores x / scale saturated -- and no shape in
    it depends on the slots' values, so a CUDA graph can record it (vLLM's FLASHINFER graphs do): it runs on fake
    tensors, which have no values and refuse an output shape that depends on them (a boolean-mask index, as the
    stand-in had, raises there)."""
    stub = os.path.join(ROOT, "tests", "gpu", "stub_site", "sitecustomize.py")
    script = f"""
import importlib.util, torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
spec = importlib.util.spec_from_file_location("stub", {stub!r})
stub = importlib.util.module_from_spec(spec); spec.loader.exec_module(stub)
torch.manual_seed(0)
slots = torch.tensor([5, -1, 9, 23, -1, 0])
for dtype in ("auto", "fp8"):
    base = torch.randn(6, 4, 2, 8)
    key_cache = base.half() if dtype == "auto" else base.to(torch.float8_e4m3fn)
    value_cache = key_cache.clone()
    key, value = torch.randn(6, 2, 8).half() * 600, torch.randn(6, 2, 8).half()
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
    before = (key_cache.clone(), value_cache.clone())
    stub._reshape_and_cache_flash(key, value, key_cache, value_cache, slots, dtype, k_scale, v_scale)
    for new, old, cache, scale in ((key, before[0], key_cache, 0.5), (value, before[1], value_cache, 2.0)):
        want = old.clone()
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                x = new[i] if dtype == "auto" else (new[i].float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                want[slot // 4, slot % 4] = x
        assert torch.equal(want.view(torch.uint8), cache.view(torch.uint8)), dtype
    mode = FakeTensorMode()  # no values: a shape that depends on them raises DynamicOutputShapeException
    fake = [mode.from_tensor(t) for t in (key, value, key_cache, value_cache, slots, k_scale, v_scale)]
    with mode:
        stub._reshape_and_cache_flash(*fake[:5], dtype, *fake[5:])
        try:
            fake[0][fake[4] >= 0]  # the check itself: a boolean-mask index is refused
            raise SystemExit("fake tensors took a value-dependent shape")
        except DynamicOutputShapeException:
            pass
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, VLLM_CONFIGURE_LOGGING="0"), timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_harness_query_quantisation_is_vllms_static_fp8_quant():
    """tests/gpu/stub_site's ``static_scaled_fp8_quant`` (FlashInferImpl quantises its query with it when the cache
    is FP8), called through vLLM's own ``scaled_fp8_quant``: each value times the scale's reciprocal, saturated to
    e4m3's 448, and a per-group scale refused in words (in a child interpreter: it registers into torch.ops._C)."""
    stub = os.path.join(ROOT, "tests", "gpu", "stub_site", "sitecustomize.py")
    script = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("stub", {stub!r})
stub = importlib.util.module_from_spec(spec); spec.loader.exec_module(stub)
stub._register_query_quant()
from vllm import _custom_ops as ops
torch.manual_seed(0)
query = torch.randn(6, 4 * 16).to(torch.bfloat16) * 3
query[0, :3] = torch.tensor([1000.0, -1000.0, 0.0])
scale = torch.tensor([0.05])
out, kept = ops.scaled_fp8_quant(query, scale=scale)
assert out.dtype == torch.float8_e4m3fn and kept is scale, (out.dtype, kept)
want = (query.float() * (1 / 0.05)).clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
assert out[0, :3].float().tolist() == [448.0, -448.0, 0.0]
back = out.float() * 0.05
inside = (query.float().abs() < 448 * 0.05)
assert ((back - query.float()).abs()[inside] <= query.float().abs()[inside] * 2 ** -4 + 1e-3).all()
try:
    ops.scaled_fp8_quant(query, scale=torch.ones(6, 1), group_shape=(1, -1))
    raise SystemExit("a per-token scale was taken")
except RuntimeError as exc:
    assert "one scale per tensor" in str(exc), exc
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, VLLM_CONFIGURE_LOGGING="0"), timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_harness_compile_op_standins_let_vllms_compile_passes_import():
    """vLLM's torch.compile passes (a PIECEWISE engine's) name compiled ops at import; with
    ``KVDBG_GPU_COMPILE_OPS`` tests/gpu/stub_site defines them with vLLM's schemas, each raising if called. Checked
    here on vLLM's CUDA code path (the platform's is_cuda answered yes): without them the import fails."""
    stub_dir = os.path.join(ROOT, "tests", "gpu", "stub_site")
    script = f"""
import importlib.util, os, sys, tempfile, torch
import vllm
spec = importlib.util.spec_from_file_location("stub", {os.path.join(stub_dir, "sitecustomize.py")!r})
stub = importlib.util.module_from_spec(spec); spec.loader.exec_module(stub)
# vLLM's compiled modules, empty, as on the GPU machine (its list: tests/gpu/vllm_carry.py)
root = os.path.dirname(os.path.dirname(vllm.__file__))
names = [os.path.relpath(os.path.join(d, f), root).split(".")[0].replace(os.sep, ".")
         for d, _, files in os.walk(os.path.dirname(vllm.__file__)) for f in files if f.endswith(".so")]
with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
    fh.write("\\n".join(names))
stub.install(fh.name)
importlib.import_module(names[0])  # the first stand-in imported registers the harness's ops, as there
from vllm.platforms import current_platform
type(current_platform).is_cuda_alike = lambda self: True
type(current_platform).is_cuda = lambda self: True
import vllm.compilation.passes.pass_manager
print("imported")
try:
    torch.ops._C.rotary_embedding(torch.zeros(1), torch.zeros(1), None, 1, torch.zeros(1), True)
except RuntimeError as exc:
    print("raised" if "not carried" in str(exc) else repr(exc))
"""
    env = {k: v for k, v in os.environ.items() if k != "KVDBG_GPU_COMPILE_OPS"}
    without = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                             env=dict(env, VLLM_CONFIGURE_LOGGING="0"), timeout=300)
    assert without.returncode != 0 and "rotary_embedding" in without.stderr, without.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=dict(env, VLLM_CONFIGURE_LOGGING="0", KVDBG_GPU_COMPILE_OPS="1"), timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["imported", "raised"], done.stderr[-3000:]
