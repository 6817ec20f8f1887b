"""Small leaf helpers every layer may use: atomic file writes, background-thread hygiene, the range
grammar (``0-3,7``), the bundled fixtures' location.

May import: the standard library and :mod:`kvdbg.errors`. Never torch at module level.
"""
