"""On the GPU machine only (tests/gpu/run_*.sh put this directory on PYTHONPATH): empty modules in place of
vLLM's compiled extensions, in every interpreter the run starts.

vLLM runs some of its work in a child interpreter (its model registry inspects an architecture in a
subprocess), and that child imports vLLM's CUDA platform, which imports a compiled module that is not carried.
The parent's stand-ins do not reach a child, so they are installed here, at interpreter start, when
KVDBG_GPU_VLLM_SO_MODULES names the list; the first stand-in imported also answers vLLM's import-time capability
queries (no CUTLASS GEMM) and defines in plain torch the two compiled ops the FLASHINFER path calls: its cache
write (``_register_cache_write``) and, with an FP8 cache, its query's quantisation (``_register_query_quant``).
kvdbg itself never does this.
"""

import importlib.abc
import importlib.util
import os
import sys
import types


class EmptyCompiledModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for the listed names: the attention paths run call none of them, but for the cache write
    (``_register_cache_write``)."""

    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.names else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        if not _LIBRARIES:  # vLLM's CUDA platform imports one of them before anything asks
            _register_capability_queries()
            _register_activation()
            _register_weak_ref_tensor()
            _register_cache_write()
            _register_query_quant()
            if os.environ.get("KVDBG_GPU_COMPILE_OPS"):
                _register_compile_pass_ops()


# vLLM asks its compiled library at import time which CUTLASS GEMMs the GPU supports (a model's module does, in
# the registry's child interpreter). Without the library the answer is "none": the attention path needs none.
_CAPABILITY_QUERIES = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
                       "cutlass_group_gemm_supported")
_LIBRARIES = []


def _register_capability_queries():
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    for name in _CAPABILITY_QUERIES:
        if hasattr(torch.ops._C, name):
            continue
        library.define(f"{name}(int cuda_device_capability) -> bool")
        library.impl(name, lambda capability: False, "CompositeExplicitAutograd")
    _LIBRARIES.append(library)


def _reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """vLLM's cache write, in plain torch (the compiled op is not carried): token ``t`` of the step goes to block
    ``slot // block_size``, row ``slot % block_size`` of the ``[blocks, block_size, heads, head_size]`` views;
    slot -1 (a padded token) writes nothing; an FP8 cache stores ``x / scale`` saturated to e4m3.

    No shape depends on the slots' values (no host synchronisation), so a CUDA graph can record it as vLLM's
    FLASHINFER graphs do: a padded token's row is written back with what it held (slot 0's, the null block's)."""
    import torch

    slots = slot_mapping.to(torch.int64)
    count = slots.shape[0]
    keep = (slots >= 0).view(count, 1, 1)
    slots = slots.clamp(min=0)
    block_size = key_cache.shape[1]
    blocks, rows = slots // block_size, slots % block_size
    for new, cache, scale in ((key[:count], key_cache, k_scale), (value[:count], value_cache, v_scale)):
        if kv_cache_dtype.startswith("fp8"):
            quantized = (new.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            stored, held = quantized.view(torch.uint8), cache.view(torch.uint8)
        else:
            stored, held = new.to(cache.dtype), cache
        held[blocks, rows] = torch.where(keep, stored, held[blocks, rows])


def _silu_and_mul(result, x):
    import torch

    d = x.shape[-1] // 2
    result.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])


def _gelu_and_mul(result, x):
    import torch

    d = x.shape[-1] // 2
    result.copy_(torch.nn.functional.gelu(x[..., :d]) * x[..., d:])


def _gelu_tanh_and_mul(result, x):
    import torch

    d = x.shape[-1] // 2
    result.copy_(torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:])


def _register_activation():
    """``torch.ops._C.silu_and_mul`` and the two GeGLU ops (a Gemma 2 model's ``GeluAndMul``), which the activations'
    ``__init__`` read even when ``custom_ops=["none"]`` makes their forward vLLM's native torch one: plain torch."""
    import torch

    library = None
    for name, impl in (("silu_and_mul", _silu_and_mul), ("gelu_and_mul", _gelu_and_mul),
                       ("gelu_tanh_and_mul", _gelu_tanh_and_mul)):
        if hasattr(torch.ops._C, name):
            continue
        if library is None:
            library = torch.library.Library("_C", "FRAGMENT")
            _LIBRARIES.append(library)
        library.define(f"{name}(Tensor(a!) result, Tensor input) -> ()")
        library.impl(name, impl, "CompositeExplicitAutograd")


def _register_weak_ref_tensor():
    """``torch.ops._C.weak_ref_tensor``, which vLLM's CUDA-graph wrapper applies to a captured graph's outputs (a
    tensor on the same memory that does not keep it alive): here a view, which keeps it alive -- the graph's
    output buffers then live as long as the engine, which a test engine can afford."""
    import torch

    if hasattr(torch.ops._C, "weak_ref_tensor"):
        return
    _stand_in("_C", "weak_ref_tensor(Tensor(a) input) -> Tensor(a)", lambda tensor: tensor.view(tensor.shape),
              "CompositeImplicitAutograd")


def _register_cache_write():
    """``torch.ops._C_cache_ops.reshape_and_cache_flash``, which vLLM's FLASHINFER (and FLASH_ATTN) cache update
    calls, as :func:`_reshape_and_cache_flash`; TRITON_ATTN writes with its own Triton kernel instead."""
    import torch

    try:
        torch.ops._C_cache_ops.reshape_and_cache_flash
        return  # the real op is there
    except (AttributeError, RuntimeError):
        pass
    _stand_in("_C_cache_ops", "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
              "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
              _reshape_and_cache_flash)


def _stand_in(namespace: str, schema: str, impl, dispatch: str = "CompositeExplicitAutograd") -> None:
    """One compiled op of vLLM's, ``torch.ops.<namespace>.<name>`` by its ``schema``, as ``impl`` (plain torch);
    its library kept alive with the others."""
    import torch

    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(schema)
    library.impl(schema.split("(", 1)[0], impl, dispatch)
    _LIBRARIES.append(library)


def _static_scaled_fp8_quant(result, input, scale, group_shape=None):
    """vLLM's static FP8 quantisation with one scale for the tensor (what FlashInferImpl asks for its query when
    the cache is FP8), in plain torch: ``input`` times the scale's reciprocal in float32, saturated to the FP8
    type's largest value, then rounded to nearest even, as vLLM's kernel computes it. A per-group scale is not
    stood in for: it raises, naming itself."""
    import torch

    if scale.numel() != 1:
        raise RuntimeError("torch.ops._C.static_scaled_fp8_quant: the harness stands in for one scale per tensor "
                           f"only, not a scale of shape {tuple(scale.shape)} (group_shape {group_shape})")
    limit = torch.finfo(result.dtype).max
    inverse = 1.0 / scale.float().reshape(())
    result.copy_((input.float() * inverse).clamp(-limit, limit).to(result.dtype))


def _register_query_quant():
    """``torch.ops._C.static_scaled_fp8_quant``, which FlashInferImpl calls (through vLLM's ``scaled_fp8_quant``)
    to quantise its query to the FP8 cache's dtype, as :func:`_static_scaled_fp8_quant`."""
    import torch

    if hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        return
    _stand_in("_C", "static_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor scale, "
              "(int, int)? group_shape=None) -> ()", _static_scaled_fp8_quant)


# The compiled ops that vLLM's torch.compile passes (vllm/compilation/passes) name at import time, outside any
# ``hasattr`` guard, with the schemas vLLM's csrc/torch_bindings.cpp gives them: the passes compare graph nodes
# with these ops, and the fusions that would put them into a graph are switched off by the engines that use this
# (tests/gpu/graph_stage.py, ``pass_config``). Their kernels are not carried, so a call raises and says so.
_COMPILE_PASS_OPS = (
    "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, Tensor cos_sin_cache, "
    "bool is_neox) -> ()",
    "static_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor scale, (int, int)? group_shape=None) -> ()",
    "dynamic_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) scale, Tensor? scale_ub) -> ()",
    "silu_and_mul_quant(Tensor(a!) result, Tensor input, Tensor scale) -> ()",
    "silu_and_mul_per_block_quant(Tensor(a!) out, Tensor input, Tensor(b!) scales, int group_size, "
    "Tensor? scale_ub=None, bool is_scale_transposed=False) -> ()",
    "rms_norm(Tensor(a!) result, Tensor input, Tensor weight, float epsilon) -> ()",
    "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()",
    "rms_norm_static_fp8_quant(Tensor(a!) result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) residual, Tensor weight, "
    "Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant(Tensor(a!) result, Tensor input, Tensor weight, Tensor(b!) scale, "
    "float epsilon, Tensor? scale_ub, Tensor(c!)? residual) -> ()",
    "fused_qk_norm_rope(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, float eps, "
    "Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, Tensor position_ids) -> ()",
)


def _not_carried(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"torch.ops._C.{name}: vLLM's compiled kernel is not carried to this machine (a "
                           "stand-in for vLLM's torch.compile passes, which only name it)")

    return call


def _register_compile_pass_ops():
    """The ops of ``_COMPILE_PASS_OPS`` not already defined, each raising when called (``KVDBG_GPU_COMPILE_OPS``:
    only the torch.compile engines of the graph stage ask for them)."""
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    for schema in _COMPILE_PASS_OPS:
        name = schema.split("(", 1)[0]
        if hasattr(torch.ops._C, name):
            continue
        library.define(schema)
        library.impl(name, _not_carried(name), "CompositeExplicitAutograd")
    _LIBRARIES.append(library)


def install(list_path: str) -> None:
    """Put the stand-ins for the modules listed in ``list_path`` (one name a line) first on sys.meta_path, once."""
    if any(type(f).__name__ == "EmptyCompiledModules" for f in sys.meta_path):
        return
    with open(list_path) as fh:
        sys.meta_path.insert(0, EmptyCompiledModules({line.strip() for line in fh if line.strip()}))


if os.environ.get("KVDBG_GPU_VLLM_SO_MODULES"):
    install(os.environ["KVDBG_GPU_VLLM_SO_MODULES"])
