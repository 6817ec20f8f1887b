"""Stand-in for vllm.v1.kv_cache_interface: the attention specs builders and kvdbg's plugin read."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class KVQuantMode(IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    FP8_PER_TOKEN_HEAD = 3

    @property
    def is_per_token_head(self) -> bool:
        return self == KVQuantMode.FP8_PER_TOKEN_HEAD


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int = 1

    def __post_init__(self):
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int | None = None
