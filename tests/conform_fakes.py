"""Fake conform runners that worker processes can import (kvdbg.fleet.conform_pool builds a runner by
``module:class`` in each spawned worker, where a test's monkeypatching does not reach)."""

from __future__ import annotations

import os
import signal

from kvdbg.errors import BackendUnavailable
from kvdbg.moves.conform.run import FAIL, PASS, REFUSED, Outcome



class FakeRunner:
    """Refuses page size 16 alone and FP8 with float32; fails window × sinks at every precision (semantic) and
    the soft cap below float32 (rounding); on page size 64 the worker process kills itself."""

    def __init__(self, backend="FAKE_ATTN", device="cpu", *, seed=0, atol=None, rtol=None):
        self.backend = backend
        if backend == "NO_ATTN":
            raise BackendUnavailable(f"--backend {backend}: not in the fake registry")

    def refusal(self, row):
        return "block_size not supported" if row["page_size"] == "16" else None

    def run(self, row, kind, exact=False):
        if row["page_size"] == "64":
            os.kill(os.getpid(), signal.SIGKILL)  # a kernel that takes its process down
        if row["head_size"] == "128" and kind == "prefill":
            marker = os.path.join(os.environ["KVDBG_TEST_MARK_DIR"], "crashed")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # once only: the retry on a fresh worker passes
        if row["dtype"] == "bfloat16" and row["gqa"] == "4" and kind == "mixed":
            raise ValueError("a mistake of kvdbg's own")
        if row["alibi"] == "sqrt" and row["dtype"] == "float32" and os.environ.get("TRITON_F32_DEFAULT") != "ieee":
            return Outcome(FAIL, max_abs=2e-3, first={"step": 0, "request": 0, "head": 0, "token": 0,
                                                     "max_abs": 2e-3}, tolerance="rule")  # as TF32 products do
        if row["kv_cache"] == "fp8" and row["dtype"] == "float32":
            return Outcome(REFUSED, reason="kv_cache_dtype not supported with float32")
        if row["window"] != "none" and row["sinks"] == "on":
            return Outcome(FAIL, max_abs=0.25, first={"step": 0, "request": 1, "head": 3, "token": 0,
                                                     "max_abs": 0.25}, tolerance="rule")
        if row["soft_cap"] == "on" and row["dtype"] != "float32":
            return Outcome(FAIL, max_abs=0.02, first={"step": 0, "request": 0, "head": 0, "token": 0,
                                                     "max_abs": 0.02}, tolerance="rule")
        return Outcome(PASS, max_abs=1e-3, tolerance="rule", kernel=f"fake in process {os.getpid()}")


def _failing_snapshot(row, kind):
    """A real synthetic snapshot (torch tensors) as a FAIL carries it."""
    from kvdbg.moves.conform.matrix import spec_for
    from kvdbg.moves.synth import synth_snapshot

    return synth_snapshot(spec_for("TRITON_ATTN", row, kind, 0))


class SnapshotRunner(FakeRunner):
    """Fails window × sinks as FakeRunner does, each FAIL carrying its snapshot (tensors), as EngineRunner's do."""

    def run(self, row, kind, exact=False):
        outcome = super().run(row, kind, exact)
        if outcome.status == FAIL:
            outcome.snapshot = _failing_snapshot(row, kind)
        return outcome


class BrokenContextRunner(SnapshotRunner):
    """As SnapshotRunner, but a cell with sinks on leaves the process's (pretend) CUDA context broken: the worker
    answers, then leaves."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import kvdbg.fleet.conform_pool as pool

        self._broken = None
        pool._cuda_broken = lambda device: self._broken  # the worker's check after each cell

    def run(self, row, kind, exact=False):
        outcome = super().run(row, kind, exact)
        if row["sinks"] == "on":
            self._broken = "AcceleratorError: CUDA error: an illegal memory access was encountered"
        return outcome


class UnpicklableErrorRunner(FakeRunner):
    """A mistake of kvdbg's whose exception cannot travel back to the parent (it holds a lock)."""

    def run(self, row, kind, exact=False):
        import threading

        error = RuntimeError("a mistake of kvdbg's own, holding a lock")
        error.lock = threading.Lock()
        raise error


class NoIeeeRunner(FakeRunner):
    """A worker started for IEEE float32 products dies while it starts (say, out of memory importing the engine)."""

    def __init__(self, *args, **kwargs):
        if os.environ.get("TRITON_F32_DEFAULT") == "ieee":
            os.kill(os.getpid(), signal.SIGKILL)
        super().__init__(*args, **kwargs)
