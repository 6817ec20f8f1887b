"""Capture from a live engine: its variables (``config``), the engine's cache layouts it accepts
(``engine_layouts``), the layer, backend and step it hands over (``inputs``), what the engine's thread
copies (``prepare``, into ``buffers``), the pure building of a snapshot from those copies (``build``), and
the never-raising shell (``capturer``) with its writing half: the writer thread and the writes (``writer``),
their temporary files (``temp_files``).

May import :mod:`kvdbg.errors`, :mod:`kvdbg.util`, :mod:`kvdbg.judge`, :mod:`kvdbg.snapshot`; never
replay, backends or vLLM (the plugin, :mod:`kvdbg.vllm_plugin`, hands it plain tensors).

``kvdbg.capture`` was one module before it was a package: its API (``Capturer``, ``CaptureLayer``,
``CaptureBackend``, ``StepTensors``, ``capture_step``) is re-exported here, loaded on first use.
"""

_REEXPORTS = {name: "kvdbg.capture.capturer" for name in
              ("Capturer", "CaptureLayer", "CaptureBackend", "StepTensors", "capture_step")}


def __getattr__(name: str):
    module = _REEXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvdbg.capture' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
