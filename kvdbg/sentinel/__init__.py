"""The sentinel: a sampled check of a live engine's attention against the reference, and the capture
of a step that fails it. Its variables (``config``), the check with its policy (``checker``), and on a GPU the
process that checks staged graph steps (``remote``: the engine's side and the child's loop; ``child``: the child's
entry point); its hooks in vLLM live in :mod:`kvdbg.vllm_plugin.sentinel_hooks`.

May import :mod:`kvdbg.capture`, :mod:`kvdbg.backends` (the reference) and everything below them.
"""
