"""Test-only faults inside vLLM's CPU_ATTN, for the sentinel's engine case: wrong attention at chosen steps.

Confined to the engine stages; kvdbg never imports this. :func:`install` wraps
``CPUAttentionBackendImpl.forward`` (or another impl class whose metadata has
``block_table`` and ``num_actual_tokens`` and whose cache is indexed
``[page, kv_head]`` first: tests/gpu/triton_faults.py hands vLLM 0.33's
TRITON_ATTN) *before* kvdbg's plugin wraps it, so the fault sits between kvdbg
and the kernel, where a real kernel bug would be. Steps are counted per layer
as the plugin counts them (forwards with metadata, not recorded into a CUDA
graph). A spec is comma-separated ``kind:layer:step``:

    head:L:S   after the kernel ran, one head's output (head 1) of every token is moved by +1.0
    page:L:S   the kernel gets a block table whose entry 0 of request 0 names request 1's first page;
               the metadata object the engine built (and kvdbg recorded) is left as it was
    nan:L:S    NaN is written into the first page request 0 reads (KV head 0, every token of the page)
               before the kernel runs, and stays there
"""

from __future__ import annotations

import dataclasses

CPU_ATTN_MODULE = "vllm.v1.attention.backends.cpu_attn"
CORRUPTED_HEAD = 1

_installed: dict | None = None


def parse(spec: str) -> dict[tuple[int, int], str]:
    faults = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, layer, step = item.split(":")
        if kind not in ("head", "page", "nan"):
            raise ValueError(f"unknown fault kind {kind!r}")
        faults[int(layer), int(step)] = kind
    return faults


def _layer_index(layer) -> int:
    return int(layer.layer_name.split(".layers.")[1].split(".")[0])


def _recorded_into_a_graph(query) -> bool:
    import torch

    return query.is_cuda and torch.cuda.is_current_stream_capturing()


def install(spec: str, impl_cls: type | None = None) -> None:
    """Wrap ``impl_cls.forward`` (CPU_ATTN's impl when None) with the faults of ``spec``; once per process."""
    global _installed
    if _installed is not None:
        return
    import importlib

    if impl_cls is None:
        impl_cls = importlib.import_module(CPU_ATTN_MODULE).CPUAttentionBackendImpl
    original = impl_cls.forward
    faults = parse(spec)
    counts: dict[str, int] = {}
    _installed = {"faults": faults, "fired": []}

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is None or _recorded_into_a_graph(query):
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = counts.get(layer.layer_name, 0)
        counts[layer.layer_name] = step + 1
        kind = faults.get((_layer_index(layer), step))
        if kind == "page":
            table = attn_metadata.block_table.clone()
            table[0, 0] = table[1, 0]
            attn_metadata = dataclasses.replace(attn_metadata, block_table=table)
        elif kind == "nan":
            page = int(attn_metadata.block_table[0, 0])
            kv_cache[page, 0] = float("nan")
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if kind == "head":
            n = attn_metadata.num_actual_tokens
            rows = output[:n].view(n, self.num_heads, self.head_size)
            rows[:, CORRUPTED_HEAD] += 1.0
        if kind is not None:
            _installed["fired"].append((kind, layer.layer_name, step))
            print(f"sentinel fault fired: {kind} {layer.layer_name} step {step}", flush=True)
        return result

    forward._sentinel_fault_original = original
    impl_cls.forward = forward


def fired() -> list[tuple[str, str, int]]:
    """The faults that fired so far: (kind, layer name, step)."""
    return list(_installed["fired"]) if _installed is not None else []


__all__ = ["CORRUPTED_HEAD", "fired", "install", "parse"]
