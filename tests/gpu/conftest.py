"""The vllm column on a GPU machine with vLLM's Python files only (tests/gpu/run_vllm_column.sh).

Collected only when KVDBG_GPU_VLLM_SO_MODULES names the list of vLLM's compiled modules that were left behind:
the harness then puts empty stand-ins for them in place before anything imports vLLM. kvdbg itself never does
this: where vLLM's code does not import, its column says so (tests/test_vllm_column.py).
"""

from __future__ import annotations

import importlib.util
import os

SO_MODULES = os.environ.get("KVDBG_GPU_VLLM_SO_MODULES")


if not SO_MODULES:
    collect_ignore_glob = ["test_*.py"]
else:
    # run_vllm_column.sh puts stub_site on PYTHONPATH, whose sitecustomize has installed the stand-ins already
    # (here and in vLLM's child interpreters); install() does nothing then. Loaded by path: one definition.
    _path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub_site", "sitecustomize.py")
    _spec = importlib.util.spec_from_file_location("kvdbg_gpu_stub_site", _path)
    _stub_site = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_stub_site)
    _stub_site.install(SO_MODULES)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
