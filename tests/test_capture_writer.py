"""Capture under load and faults: the background writer, a full disk, several processes writing to one directory."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import threading
import time

import pytest

from kvdbg import snapshot as snapshot_module
from kvdbg.capture import Capturer
from kvdbg.format import LAYOUT_VLLM
from kvdbg.snapshot import load_snapshot
from tests.test_capture import Engine


def files(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def capture_steps(capturer: Capturer, engine: Engine, steps) -> list:
    return [capturer.capture(*engine.args(), output=engine.output, step=step, rank=0) for step in steps]


def test_background_writer_keeps_the_engine_thread_free_and_drops_when_full(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    disk = threading.Event()  # the "disk" accepts writes only once this is set
    real_write = snapshot_module.write_safetensors

    def slow_write(*args, **kwargs):
        disk.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(snapshot_module, "write_safetensors", slow_write)
    capturer = Capturer(tmp_path, queue_size=2)
    started = time.monotonic()
    results = capture_steps(capturer, engine, range(1))
    while capturer._queue.qsize() and time.monotonic() - started < 5:  # the writer takes it, then waits on the disk
        time.sleep(0.001)
    results += capture_steps(capturer, engine, range(1, 6))
    assert time.monotonic() - started < 5  # never waited for the disk
    assert results == [None] * 6  # paths are known only once written
    # One step is being written, two wait in the queue, the other three are dropped and counted.
    assert capturer.failures["dropped:queue_full"] == 3
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "KVDBG_CAPTURE_QUEUE=2" in dropped[0].getMessage()
    disk.set()
    assert capturer.flush(10)
    assert len(files(tmp_path)) == 3 == len(capturer.written)
    for name in files(tmp_path):
        assert load_snapshot(tmp_path / name).steps[0].output is not None


def test_background_writer_respects_the_count_budget(tmp_path):
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(tmp_path, queue_size=8, max_snapshots=3)
    capture_steps(capturer, engine, range(6))
    assert capturer.flush(10)
    assert len(files(tmp_path)) == 3 and not capturer.active


@pytest.mark.parametrize("queue_size", [0, 4], ids=["in-caller", "background"])
def test_disk_full_mid_write_leaves_no_file_and_one_line(tmp_path, monkeypatch, caplog, queue_size):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    real_write = snapshot_module.write_safetensors

    def full_disk(fh, *args, **kwargs):
        class HalfWay:  # accepts some bytes, then the device is full
            written = 0

            def write(self, data):
                n = memoryview(data).nbytes
                if self.written + n > 4096:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.written += n
                return fh.write(data)

        return real_write(HalfWay(), *args, **kwargs)

    monkeypatch.setattr(snapshot_module, "write_safetensors", full_disk)
    capturer = Capturer(tmp_path, queue_size=queue_size)
    capture_steps(capturer, engine, range(3))  # never raises into the engine
    assert capturer.flush(10)
    assert files(tmp_path) == []  # neither a partial file under a final name nor a temp file
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert not capturer.active


def _capture_in_process(directory: str, count: int) -> int:
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(directory, rank=0)
    # Every process uses the same layer, step and rank: the file names collide unless capture moves on.
    paths = [capturer.capture(*engine.args(), output=engine.output, step=1) for _ in range(count)]
    return sum(p is not None for p in paths)


def test_several_processes_write_one_directory_without_collisions(tmp_path):
    context = multiprocessing.get_context("spawn")
    with context.Pool(3) as pool:
        written = pool.starmap(_capture_in_process, [(str(tmp_path), 4)] * 3)
    assert written == [4, 4, 4]
    names = files(tmp_path)
    assert len(names) == 12 and all(n.endswith(".safetensors") for n in names)
    for name in names:
        load_snapshot(tmp_path / name)
