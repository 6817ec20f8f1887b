"""Stand-in for vllm.v1.worker.worker_base: the per-process worker wrapper whose ``execute_model`` and ``shutdown`` vLLM calls."""

from __future__ import annotations


class WorkerWrapperBase:
    """vLLM 0.33 calls ``shutdown()`` on it when a worker process (or the in-process executor) stops."""

    def __init__(self) -> None:
        self.shut_down = False

    def execute_model(self, scheduler_output):
        """One step of the model; the test passes what runs on the device before the step's first build."""
        return scheduler_output() if callable(scheduler_output) else scheduler_output

    def shutdown(self) -> None:
        self.shut_down = True
