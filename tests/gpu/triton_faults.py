"""Test-only faults inside vLLM 0.33's TRITON_ATTN, for the GPU stage's sentinel run (tests/gpu/engine_sentinel.py).

The GPU twin of tests/engine/sentinel_faults.py: the same three kinds at chosen steps, the same spec
(``kind:layer:step``, comma-separated) and corrupted head, put on ``TritonAttentionImpl.forward`` *before*
kvdbg's plugin wraps it, so each fault sits between kvdbg and the Triton kernel. Confined to the GPU stage;
kvdbg never imports this.

What the faults touch, as vLLM 0.33's TRITON_ATTN hands it to ``forward(layer, query, key, value, kv_cache,
attn_metadata, output=...)`` (held to vLLM's own classes on CPU by tests/vllm033/test_vllm033_gpu_stage.py):

    head   ``output`` ([tokens, heads, head_size] rows; the first ``attn_metadata.num_actual_tokens`` are the
           step's), after the kernel wrote it: head 1 of every token moved by +1.0
    page   ``attn_metadata`` (a ``TritonAttentionMetadata`` dataclass) replaced, for the kernel only, by a copy whose
           ``block_table`` ([requests, pages], device int32) has entry [0, 0] set to request 1's first page; the
           metadata kvdbg's builder hook recorded is the engine's, untouched
    nan    ``kv_cache``, the layer's cache in its logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
           view (K then V in the last dimension): ``kv_cache[page, 0]``, KV head 0 of every token of the first
           page request 0 reads, set to NaN (K and V) before the kernel runs; it stays there
"""

from __future__ import annotations

import importlib

from tests.engine import sentinel_faults
from tests.engine.sentinel_faults import CORRUPTED_HEAD, parse

TRITON_ATTN = ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl")


def impl_class() -> type:
    module, name = TRITON_ATTN
    return getattr(importlib.import_module(module), name)


def install(spec: str) -> None:
    """Wrap TRITON_ATTN's forward with the faults of ``spec`` (call before the engine is built); once per process."""
    sentinel_faults.install(spec, impl_class())


def fired() -> list[tuple[str, str, int]]:
    return sentinel_faults.fired()


__all__ = ["CORRUPTED_HEAD", "fired", "impl_class", "install", "parse"]
