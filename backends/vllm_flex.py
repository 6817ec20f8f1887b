"""``vllm_flex``: the ``vllm`` column pinned to vLLM's own FLEX_ATTENTION, whatever backend the snapshot names.

Kept for the commands and scripts that name it: on a FLEX_ATTENTION snapshot it
runs what ``vllm`` runs; on another (a CPU_ATTN capture, say) it shows what
vLLM's FLEX_ATTENTION would have computed for the same batch. The code is
``kvdbg.backends.vllm_native``'s.
"""

from __future__ import annotations

from .vllm_native import FLEX_BACKEND as BACKEND
from .vllm_native import renumber, vllm_version

NAME = "vllm_flex"

__all__ = ["BACKEND", "NAME", "renumber", "vllm_version"]
