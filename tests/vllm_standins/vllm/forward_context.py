"""Stand-in for vllm.forward_context: the per-step context attention layers read their inputs from."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardContext:
    no_compile_layers: dict[str, Any]
    attn_metadata: Any
    slot_mapping: dict[str, Any] = field(default_factory=dict)


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "Forward context is not set."
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata, no_compile_layers, slot_mapping):
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(no_compile_layers, attn_metadata, slot_mapping)
    try:
        yield
    finally:
        _forward_context = previous
