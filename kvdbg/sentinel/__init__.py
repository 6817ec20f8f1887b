"""The sentinel: a sampled check of a live engine's attention against the reference, and the capture
of a step that fails it. Its variables (``config``) and the check with its policy (``checker``); its
hooks in vLLM live in :mod:`kvdbg.vllm_plugin.sentinel_hooks`.

May import :mod:`kvdbg.capture`, :mod:`kvdbg.backends` (the reference) and everything below them.
"""
