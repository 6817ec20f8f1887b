"""Tests against vLLM 0.33's own classes; collected only by tests/vllm033/run.sh (KVDBG_VLLM033=1).

The main test venv has no vLLM 0.33, so a plain ``pytest`` leaves this folder out;
the stage that builds .venv-vllm033 runs it, and fails if vLLM there is not 0.33.
"""

from __future__ import annotations

import os

if os.environ.get("KVDBG_VLLM033") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
