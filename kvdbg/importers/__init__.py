"""Other recorders' files turned into kvdbg snapshots: FlashInfer's level-10 API dumps (``dumpdir`` reads a
dump directory as untrusted input, ``flashinfer_paged`` converts one paged-attention call, ``session`` pairs a
session's calls and writes the snapshots), flashinfer-bench datasets (the ``fibench`` package), and ``source``,
which tells which one a path is.

May import :mod:`kvdbg.errors`, :mod:`kvdbg.util` and :mod:`kvdbg.snapshot`; nothing here imports FlashInfer.
"""
