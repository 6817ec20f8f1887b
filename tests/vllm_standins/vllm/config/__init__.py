"""Stand-in for vllm.config: only the fields the stand-in builders and kvdbg's plugin read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    max_model_len: int = 32768
    num_attention_heads: int = 8

    def get_num_attention_heads(self, parallel_config=None) -> int:
        return self.num_attention_heads


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int | None = None
    cache_dtype: str = "auto"
    # Resolved by the engine core in vLLM; the stand-ins' caches are contiguous [blocks, heads, tokens, 2*D].
    kv_cache_layout: str | None = "LBHNC"

    def get_resolved_kv_cache_layout(self):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        if self.kv_cache_layout is None:
            raise ValueError("KV cache layout has not been resolved yet")
        return KVCacheLayout[self.kv_cache_layout]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int | None = None


@dataclass
class ParallelConfig:
    decode_context_parallel_size: int = 1


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
