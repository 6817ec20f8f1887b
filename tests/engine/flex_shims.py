"""Test-only shims that let vLLM's real FLEX_ATTENTION backend run inside vLLM's CPU build.

Confined to the engine stage; kvdbg itself never imports this. What they change,
and why (each is the smallest change found that makes the backend run; the
builder, the masks and the impl stay vLLM's own):

1. ``CpuPlatform.get_attn_backend_cls`` returns FLEX_ATTENTION for decoder
   attention (the CPU platform always picks CPU_ATTN);
2. ``_C_cache_ops::reshape_and_cache_flash``, which FLEX's cache update calls and
   the CPU wheel does not build, gets a torch implementation (auto dtype only);
3. vLLM's ``torch.compile``-d ``flex_attention`` is swapped for the eager one:
   torch 2.13's compiled CPU flex_attention fails to build at block sizes 16-64.

The engine must also keep ``num_gpu_blocks_override`` small: torch's CPU flex
lowering refuses a KV length larger than the block mask vLLM builds.
"""

from __future__ import annotations

import torch

_installed = False


def _reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    # key_cache / value_cache: [blocks, block_size, Hkv, D] views of the [blocks, Hkv, block_size, 2*D] cache
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise NotImplementedError(f"the test shim writes only unquantised caches, not {kv_cache_dtype!r}")
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    rows = keep.nonzero().reshape(-1)
    blocks, offsets = slots[rows] // block_size, slots[rows] % block_size
    key_cache[blocks, offsets] = key[rows].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[rows].to(value_cache.dtype)


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if getattr(attn_selector_config, "use_mla", False) or getattr(attn_selector_config, "use_sparse", False):
            return original(cls, selected_backend, attn_selector_config, num_heads)
        return AttentionBackendEnum.FLEX_ATTENTION.get_path()

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    if not hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
        lib.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                   "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")
        lib.impl("reshape_and_cache_flash", _reshape_and_cache_flash, "CPU")
        globals()["_library"] = lib  # the registration lives as long as the library object

    import vllm.v1.attention.backends.flex_attention as flex_module
    from torch.nn.attention.flex_attention import flex_attention

    flex_module.flex_attention_compiled = flex_attention
    _installed = True
