"""The FlashInfer watch of the vllm column: its wrappers and builds are read from FlashInfer's own state."""

from __future__ import annotations

import sys
import types

from kvdbg.backends._vllm_library import FlashInferWatch, built_modules, watch_for


def _fake_flashinfer(monkeypatch, jit_dir):
    package = types.ModuleType("flashinfer")
    package.__version__, package.__file__ = "0.7.2.post1", "/site/flashinfer/__init__.py"
    env = types.ModuleType("flashinfer.jit.env")
    env.FLASHINFER_JIT_DIR = jit_dir
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.env", env)
    wrapper_module = types.ModuleType("flashinfer.decode")

    class BatchDecodeWithPagedKVCacheWrapper:
        pass

    BatchDecodeWithPagedKVCacheWrapper.__module__ = "flashinfer.decode"
    return BatchDecodeWithPagedKVCacheWrapper


def _metadata(wrapper_cls):
    decode = types.SimpleNamespace(wrapper=wrapper_cls(), num_reqs=2)
    return types.SimpleNamespace(decode=decode, prefill=None, num_actual_tokens=2)


def test_a_kernel_built_during_a_forward_is_named_and_then_found_built(tmp_path, monkeypatch):
    wrapper = _fake_flashinfer(monkeypatch, tmp_path)
    watch = watch_for("FLASHINFER")
    assert watch_for("TRITON_ATTN") is None
    with watch.watch():  # the builder's plan() builds the kernel
        (tmp_path / "batch_decode_fp16").mkdir()
        (tmp_path / "batch_decode_fp16" / "batch_decode_fp16.so").write_bytes(b"")
    watch.saw(_metadata(wrapper))
    with watch.watch():  # the forward finds it built
        pass
    note = watch.note()
    assert note.startswith("FlashInfer 0.7.2.post1 from /site/flashinfer: vLLM's builder planned "
                           "BatchDecodeWithPagedKVCacheWrapper; 1 kernel module(s) JIT-built during this replay "
                           "(batch_decode_fp16;"), note
    assert built_modules(tmp_path) == {"batch_decode_fp16/batch_decode_fp16.so"}


def test_kernels_already_built_are_said_to_be_loaded_from_the_cache(tmp_path, monkeypatch):
    wrapper = _fake_flashinfer(monkeypatch, tmp_path)
    (tmp_path / "a.so").write_bytes(b"")
    watch = FlashInferWatch()
    assert watch.note().endswith("no step built yet")
    with watch.watch():
        pass
    watch.saw(_metadata(wrapper))
    assert watch.note().endswith(f"every kernel loaded already built (FlashInfer's JIT cache: {tmp_path})")
    assert built_modules(tmp_path / "absent") == set()
