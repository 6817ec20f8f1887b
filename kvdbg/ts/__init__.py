"""FLASHINFER_TS's rules, apart from any kernel: the prims_ts kernel's preconditions (``contract``),
the planner's FP8 profile (``planner``), the page-aligned window restriction (``window``, pure Python, so
``kvdbg window`` never imports torch) and its vectorised twin on the device (``window_torch``).

The backend (:mod:`kvdbg.backends.flashinfer_ts`), the window command and the page map all read these.
May import :mod:`kvdbg.errors`, :mod:`kvdbg.util`, :mod:`kvdbg.judge`.
"""
