"""On the GPU machine only (tests/gpu/run_*.sh put this directory on PYTHONPATH): empty modules in place of
vLLM's compiled extensions, in every interpreter the run starts.

vLLM runs some of its work in a child interpreter (its model registry inspects an architecture in a
subprocess), and that child imports vLLM's CUDA platform, which imports a compiled module that is not carried.
The parent's stand-ins do not reach a child, so they are installed here, at interpreter start, when
KVDBG_GPU_VLLM_SO_MODULES names the list; the first stand-in imported also answers vLLM's import-time capability
queries (no CUTLASS GEMM) and defines vLLM's cache write in plain torch (``_register_cache_write``: the only
compiled op the FLASHINFER path calls). kvdbg itself never does this.
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
    slot -1 (a padded token) writes nothing; an FP8 cache stores ``x / scale`` saturated to e4m3."""
    import torch

    slots = slot_mapping.to(torch.int64)
    count = slots.shape[0]
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[1]
    blocks, rows = slots // block_size, slots % block_size
    for new, cache, scale in ((key[:count][keep], key_cache, k_scale), (value[:count][keep], value_cache, v_scale)):
        if kv_cache_dtype.startswith("fp8"):
            quantized = (new.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            cache.view(torch.uint8)[blocks, rows] = quantized.view(torch.uint8)
        else:
            cache[blocks, rows] = new.to(cache.dtype)


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
    library = torch.library.Library("_C", "FRAGMENT")
    library.define("weak_ref_tensor(Tensor(a) input) -> Tensor(a)")
    library.impl("weak_ref_tensor", lambda tensor: tensor.view(tensor.shape), "CompositeImplicitAutograd")
    _LIBRARIES.append(library)


def _register_cache_write():
    """``torch.ops._C_cache_ops.reshape_and_cache_flash``, which vLLM's FLASHINFER (and FLASH_ATTN) cache update
    calls, as :func:`_reshape_and_cache_flash`; TRITON_ATTN writes with its own Triton kernel instead."""
    import torch

    try:
        torch.ops._C_cache_ops.reshape_and_cache_flash
        return  # the real op is there
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("_C_cache_ops", "FRAGMENT")
    library.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                   "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")
    library.impl("reshape_and_cache_flash", _reshape_and_cache_flash, "CompositeExplicitAutograd")
    _LIBRARIES.append(library)


def install(list_path: str) -> None:
    """Put the stand-ins for the modules listed in ``list_path`` (one name a line) first on sys.meta_path, once."""
    if any(type(f).__name__ == "EmptyCompiledModules" for f in sys.meta_path):
        return
    with open(list_path) as fh:
        sys.meta_path.insert(0, EmptyCompiledModules({line.strip() for line in fh if line.strip()}))


if os.environ.get("KVDBG_GPU_VLLM_SO_MODULES"):
    install(os.environ["KVDBG_GPU_VLLM_SO_MODULES"])
