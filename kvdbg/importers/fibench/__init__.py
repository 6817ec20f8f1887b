"""flashinfer-bench datasets turned into kvdbg snapshots: ``dataset`` reads a dataset as untrusted input (its
definitions, workload lines and safetensors blobs), ``gqa_paged`` converts one workload of a paged GQA decode or
prefill definition, ``importer`` lists every workload and writes the snapshots.

May import :mod:`kvdbg.errors`, :mod:`kvdbg.util`, :mod:`kvdbg.snapshot` and the FlashInfer dump importer's
converter (:mod:`kvdbg.importers.flashinfer_paged`) and report records (:mod:`kvdbg.importers.session`);
nothing here imports flashinfer-bench, and no definition's reference code is ever run.
"""
