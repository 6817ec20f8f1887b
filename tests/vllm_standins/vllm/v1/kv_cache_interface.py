"""Stand-in for vllm.v1.kv_cache_interface: the attention specs builders read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int | None = None
