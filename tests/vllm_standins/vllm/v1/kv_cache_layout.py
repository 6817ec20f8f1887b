"""Stand-in for vllm.v1.kv_cache_layout: the layout descriptor kvdbg's plugin reads (names and stride orders)."""

from __future__ import annotations

from enum import Enum


class KVCacheLayout(Enum):
    """Memory order of the logical axes [L, B, H, N, C] (layers, blocks, heads, tokens, content)."""

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """Memory order of one layer's [B, H, N, C] axes (the L axis dropped)."""
        return tuple(axis - 1 for axis in self.value if axis != 0)
