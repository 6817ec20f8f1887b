"""Replay: one step's common metadata, every backend's builder and impl run on it, the judged report
(``runner``); a file or a directory of files, tensor-parallel ranks as one row (``batch``).

May import everything below it: :mod:`kvdbg.errors`, :mod:`kvdbg.util`, :mod:`kvdbg.judge`,
:mod:`kvdbg.ts`, :mod:`kvdbg.snapshot`, :mod:`kvdbg.backends`. (Named ``replayer`` so that the Python
API's ``kvdbg.replay()`` stays a function.)
"""
