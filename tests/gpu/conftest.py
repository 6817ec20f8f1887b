"""The vllm column on a GPU machine with vLLM's Python files only (tests/gpu/run_vllm_column.sh).

Collected only when KVDBG_GPU_VLLM_SO_MODULES names the list of vLLM's compiled modules that were left behind:
the harness then puts empty stand-ins for them in place before anything imports vLLM. kvdbg itself never does
this: where vLLM's code does not import, its column says so (tests/test_vllm_column.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import types

SO_MODULES = os.environ.get("KVDBG_GPU_VLLM_SO_MODULES")


class EmptyCompiledModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules in place of vLLM's compiled extensions: the TRITON_ATTN path calls none of them."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.names else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        pass


if not SO_MODULES:
    collect_ignore_glob = ["test_*.py"]
else:
    with open(SO_MODULES) as fh:
        sys.meta_path.insert(0, EmptyCompiledModules({line.strip() for line in fh if line.strip()}))
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
