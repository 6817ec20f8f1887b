"""Stand-in for vllm.v1.attention.backend: the base classes and CommonAttentionMetadata of vLLM 0.33."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch


class AttentionType(str, Enum):
    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


class AttentionBackend(ABC):
    # Whether the backend's forward() also writes the step's K/V into the cache.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type["AttentionImpl"]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls(): ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]: ...


class AttentionMetadata:
    pass


T = TypeVar("T", bound=AttentionMetadata)
M = TypeVar("M")


@dataclass
class CommonAttentionMetadata:
    """Per-batch metadata shared by every layer and backend (field names and order as in vLLM 0.33)."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None
    encoder_seq_lens: torch.Tensor | None = None
    encoder_seq_lens_cpu: Any = None
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    mm_req_doc_ranges: dict | None = None

    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    def naive_query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def replace(self, **kwargs) -> "CommonAttentionMetadata":
        return replace(self, **kwargs)

    def compute_num_computed_tokens(self) -> torch.Tensor:
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])


class AttentionMetadataBuilder(ABC, Generic[M]):
    reorder_batch_threshold: int | None = None
    supports_update_block_table: bool = False

    @abstractmethod
    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    @abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> M: ...

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int) -> M:
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata, fast_build=True)


class AttentionLayer(Protocol):
    _q_scale: torch.Tensor
    _k_scale: torch.Tensor
    _v_scale: torch.Tensor
    _q_scale_float: float
    _k_scale_float: float
    _v_scale_float: float


class AttentionImplBase(ABC, Generic[T]):
    num_heads: int
    head_size: int
    scale: float
    supports_quant_query_input: bool = False


class AttentionImpl(AttentionImplBase[T], Generic[T]):
    kv_cache_dtype: str

    @abstractmethod
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None) -> None: ...

    @abstractmethod
    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: T, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor: ...
