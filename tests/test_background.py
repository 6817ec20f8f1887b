"""kvdbg's background threads run their torch work on their own thread: no OpenMP team beside the engine's."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvdbg.util import background
from kvdbg.util.background import confine_torch_to_this_thread
from kvdbg.capture.capturer import Capturer, writer_niceness
from kvdbg.snapshot.format import LAYOUT_VLLM
from tests.test_capture import Engine


def niceness() -> int | None:
    """The calling thread's niceness (Linux), else None."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


def os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.fixture
def two_torch_threads():
    """The process runs torch on two threads, as an engine on two cores does; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def in_a_thread(work):
    result = {}

    def run():
        result["value"] = work()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["value"]


def parallel_work() -> None:
    x = torch.randn(2_000_000)
    (x * 2).sum()  # far past torch's grain size: split across the thread's OpenMP team, if it has one


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_a_confined_thread_makes_no_openmp_team_and_leaves_the_process_count_alone(two_torch_threads):
    def threads_made_by(work) -> int:
        # New thread ids only: a thread ending meanwhile (the first thread's OpenMP worker leaves after
        # its thread has ended, on its own time) must not count against the work measured.
        before = os_threads()
        work()
        return len(os_threads() - before)

    def unconfined():
        return threads_made_by(parallel_work)

    def confined():
        said = confine_torch_to_this_thread()
        return said, torch.get_num_threads(), threads_made_by(parallel_work)

    made_with_team = in_a_thread(unconfined)
    said, count, made_confined = in_a_thread(confined)
    assert count == 1, said
    assert "alone (of 2)" in said
    # The unconfined thread's parallel operator started a worker thread; the confined one's ran inline.
    assert made_with_team >= 1
    assert made_confined == 0
    assert torch.get_num_threads() == 2  # the process's count, which the engine's threads use, is unchanged


def test_the_capture_writer_runs_torch_on_its_own_thread(tmp_path, two_torch_threads):
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(tmp_path, queue_bytes="auto")
    seen = []
    pending = capturer.begin(*engine.args(), step=0, rank=0)
    # on_written runs in the thread that wrote the file: the writer's.
    capturer.finish(pending, engine.output,
                    on_written=lambda path: seen.append((path, threading.current_thread().name,
                                                         torch.get_num_threads(), niceness())))
    assert capturer.flush(30)
    [(path, thread, count, nice)] = seen
    assert path is not None and thread == "kvdbg-capture-writer"
    assert count == 1
    if nice is not None:  # ten below the engine's thread in priority, at most the lowest (19)
        assert nice == min(19, niceness() + 10) == writer_niceness(niceness())
    assert torch.get_num_threads() == 2
    capturer.close()


def test_a_runtime_that_is_not_torchs_is_passed_over_and_said(monkeypatch, two_torch_threads):
    calls = []

    def not_torchs(count):
        calls.append(count)  # another runtime's count changes; torch's does not

    real = list(background._omp_set_num_threads())
    monkeypatch.setattr(background, "_omp_set_num_threads", lambda: iter([not_torchs, *real]))
    said, count = in_a_thread(lambda: (confine_torch_to_this_thread(), torch.get_num_threads()))
    assert calls == [1] and count == 1 and "alone (of 2)" in said

    monkeypatch.setattr(background, "_omp_set_num_threads", lambda: iter([not_torchs]))
    said, count = in_a_thread(lambda: (confine_torch_to_this_thread(), torch.get_num_threads()))
    assert count == 2 and said == "torch still uses 2 threads here: none of the 1 OpenMP runtime(s) found is torch's"

    monkeypatch.setattr(background, "_omp_set_num_threads", lambda: iter(()))
    said = in_a_thread(confine_torch_to_this_thread)
    assert said == "no OpenMP runtime found; torch may use 2 threads here"


def test_the_writer_yields_to_the_engine_but_never_outranks_it():
    assert writer_niceness(0) == 10
    assert writer_niceness(5) == 15
    assert writer_niceness(15) == 19 and writer_niceness(19) == 19  # the lowest priority there is
    assert writer_niceness(-5) == 5  # an engine given a higher priority keeps its lead over the writer
