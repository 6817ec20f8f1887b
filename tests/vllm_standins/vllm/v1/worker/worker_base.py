"""Stand-in for vllm.v1.worker.worker_base: the per-process worker wrapper whose ``shutdown`` vLLM calls."""

from __future__ import annotations


class WorkerWrapperBase:
    """vLLM 0.33 calls ``shutdown()`` on it when a worker process (or the in-process executor) stops."""

    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True
