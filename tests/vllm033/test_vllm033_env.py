"""The stage's environment is what it claims: vLLM 0.33.0's CUDA wheel on a CPU torch, its backends importable."""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest
import torch


def test_vllm_is_the_033_cuda_wheel_on_a_cpu_torch():
    assert importlib.metadata.version("vllm") == "0.33.0"
    assert not torch.cuda.is_available()


@pytest.mark.parametrize("module, backend, name", [
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend", "FLASH_ATTN"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend", "TRITON_ATTN"),
    ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend", "FLASHINFER"),
])
def test_gpu_backend_classes_import_on_cpu(module, backend, name):
    cls = getattr(importlib.import_module(module), backend)
    assert cls.get_name() == name
    assert cls.get_impl_cls() is not None and cls.get_builder_cls() is not None
