"""On the GPU machine only (tests/gpu/run_*.sh put this directory on PYTHONPATH): empty modules in place of
vLLM's compiled extensions, in every interpreter the run starts.

vLLM runs some of its work in a child interpreter (its model registry inspects an architecture in a
subprocess), and that child imports vLLM's CUDA platform, which imports a compiled module that is not carried.
The parent's stand-ins do not reach a child, so they are installed here, at interpreter start, when
KVDBG_GPU_VLLM_SO_MODULES names the list; the first stand-in imported also answers vLLM's import-time capability
queries (no CUTLASS GEMM). kvdbg itself never does this.
"""

import importlib.abc
import importlib.util
import os
import sys
import types


class EmptyCompiledModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for the listed names: the TRITON_ATTN path calls none of them."""

    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.names else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        if not _LIBRARIES:  # vLLM's CUDA platform imports one of them before anything asks
            _register_capability_queries()


# vLLM asks its compiled library at import time which CUTLASS GEMMs the GPU supports (a model's module does, in
# the registry's child interpreter). Without the library the answer is "none": the attention path needs none.
_CAPABILITY_QUERIES = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
                       "cutlass_group_gemm_supported")
_LIBRARIES = []


def _register_capability_queries():
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    for name in _CAPABILITY_QUERIES:
        if hasattr(torch.ops._C, name):
            continue
        library.define(f"{name}(int cuda_device_capability) -> bool")
        library.impl(name, lambda capability: False, "CompositeExplicitAutograd")
    _LIBRARIES.append(library)


def install(list_path: str) -> None:
    """Put the stand-ins for the modules listed in ``list_path`` (one name a line) first on sys.meta_path, once."""
    if any(type(f).__name__ == "EmptyCompiledModules" for f in sys.meta_path):
        return
    with open(list_path) as fh:
        sys.meta_path.insert(0, EmptyCompiledModules({line.strip() for line in fh if line.strip()}))


if os.environ.get("KVDBG_GPU_VLLM_SO_MODULES"):
    install(os.environ["KVDBG_GPU_VLLM_SO_MODULES"])
