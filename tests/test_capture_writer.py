"""Capture under load and faults: the byte-bounded writer, the exit line, a full disk, an unwritable directory,
a process killed mid-write, several processes writing to one directory."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvdbg.capture import temp_files as temp_files_module
from kvdbg.capture import writer as writer_module
from kvdbg.snapshot import store as snapshot_module
from kvdbg.capture.capturer import TEMP_PREFIX, Capturer, stale_temp_files
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.snapshot.store import load_snapshot
from tests.test_capture import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def files(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def capture_steps(capturer: Capturer, engine: Engine, steps) -> list:
    return [capturer.capture(*engine.args(), output=engine.output, step=step, rank=0) for step in steps]


def step_bytes(engine: Engine) -> int:
    """Host bytes one step of ``engine`` holds while it waits for the writer."""
    capturer = Capturer("unused", queue_bytes=1 << 40)
    pending = capturer.begin(*engine.args(), step=0, rank=0)
    pending.attach_output(engine.output)
    return pending.nbytes


@pytest.fixture
def slow_disk(monkeypatch):
    """The "disk" accepts writes only once the returned event is set (its ``writing`` event: a write began)."""
    disk = threading.Event()
    disk.writing = threading.Event()
    real_write = snapshot_module.write_safetensors

    def slow_write(*args, **kwargs):
        disk.writing.set()
        disk.wait(20)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(snapshot_module, "write_safetensors", slow_write)
    yield disk
    disk.set()


def test_the_writer_drops_only_past_its_memory_budget_and_never_holds_up_the_engine(tmp_path, slow_disk, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    size = step_bytes(engine)
    capturer = Capturer(tmp_path, queue_bytes=int(2.5 * size))
    started = time.monotonic()
    results = capture_steps(capturer, engine, range(6))
    assert time.monotonic() - started < 5  # never waited for the disk
    assert results == [None] * 6  # paths are known only once written
    # Two steps fit in the budget (the one being written still holds its memory); four do not.
    assert capturer.dropped == {"queue": 4} and capturer._queued_bytes == 2 * size
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "KVDBG_CAPTURE_QUEUE_BYTES=" in dropped[0] and "Raise KVDBG_CAPTURE_QUEUE_BYTES" \
        in dropped[0]
    slow_disk.set()
    assert capturer.close(10)
    assert len(files(tmp_path)) == 2 == len(capturer.written) and capturer._queued_bytes == 0
    for name in files(tmp_path):
        assert load_snapshot(tmp_path / name).steps[0].output is not None
    line = caplog.records[-1]
    assert line.levelno == logging.WARNING and line.getMessage() == (
        f"kvdbg capture in pid {os.getpid()}: captured 2 snapshot(s), {capturer.bytes_written} bytes, into {tmp_path}; "
        "dropped 4 (4 over the writer's memory budget)")


def test_a_contiguous_range_behind_a_slow_disk_is_kept_whole_with_the_default_budget(tmp_path, slow_disk, caplog):
    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(tmp_path, queue_bytes="auto", steps="10-49")
    capture_steps(capturer, engine, range(60))  # 40 requested; the disk takes none until the end
    assert capturer.queue_budget() >= 64 * 1024**2 and not capturer.dropped
    slow_disk.set()
    assert capturer.close(30)
    steps = sorted(load_snapshot(tmp_path / n).meta.capture["step"] for n in files(tmp_path))
    assert steps == list(range(10, 50))
    started = [r.getMessage() for r in caplog.records if "background writer started" in r.getMessage()]
    assert len(started) == 1 and "KVDBG_CAPTURE_QUEUE_BYTES=auto: 25% of the" in started[0]
    assert caplog.records[-1].getMessage().endswith(f"captured 40 snapshot(s), {capturer.bytes_written} bytes, "
                                                    f"into {tmp_path}; dropped 0")


def test_close_waits_a_bounded_time_and_counts_what_is_left(tmp_path, slow_disk, caplog):
    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(tmp_path, queue_bytes="auto")
    capture_steps(capturer, engine, range(3))
    assert slow_disk.writing.wait(10)  # the writer is inside the first step's write
    started = time.monotonic()
    assert not capturer.close(0.2)
    assert time.monotonic() - started < 5
    # The two steps not started are given up; the one being written is said as such, not as dropped.
    assert capturer.dropped == {"exit": 2} and capturer.requested == 3
    assert caplog.records[-1].getMessage().endswith(
        "captured 0 snapshot(s), 0 bytes, into " f"{tmp_path}; dropped 2 (2 still waiting at shutdown); 1 being written")
    assert not capturer.close(0.1)  # said once
    assert sum("dropped 2" in r.getMessage() for r in caplog.records) == 1
    # The write under way ends whole; the given-up steps are never written: no step is both written and dropped.
    slow_disk.set()
    assert capturer.flush(10)
    assert len(files(tmp_path)) == 1 == len(capturer.written)
    assert capturer.dropped == {"exit": 2} and capturer.requested == 3
    assert capturer.bytes_written == os.path.getsize(tmp_path / files(tmp_path)[0]) and capturer._queued_bytes == 0


def test_steps_without_a_number_are_each_counted_when_not_written(tmp_path):
    """The exit line's count does not fold steps given no number into one (the API's default)."""
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(tmp_path, max_snapshots=1, queue_bytes=0)
    paths = [capturer.capture(*engine.args(), output=engine.output) for _ in range(4)]
    assert paths[0] is not None and paths[1:] == [None] * 3
    assert capturer.dropped == {"off": 3} and capturer.requested == 4
    # A step's two calls (before the cache update, then begin) are one step: counted once.
    capturer = Capturer(tmp_path / "pairs", queue_bytes=0)
    capturer.disable("off for this test")
    t = engine.tensors
    for _ in range(3):
        assert capturer.save_pre_update(engine.layer, key=t.key, value=t.value, slot_mapping=t.slot_mapping,
                                        kv_cache=t.kv_cache) is None
        assert capturer.begin(*engine.args()) is None
    assert capturer.dropped == {"off": 3}
    assert capturer.begin(*engine.args()) is None  # a step with no call before its cache update
    assert capturer.dropped == {"off": 4}


def test_the_count_budget_counts_what_is_in_flight_and_the_rest_as_dropped(tmp_path):
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(tmp_path, queue_bytes="auto", max_snapshots=3)
    capture_steps(capturer, engine, range(6))
    assert capturer.close(10)
    assert len(files(tmp_path)) == 3 and not capturer.active
    assert sum(capturer.dropped.values()) == 3 and set(capturer.dropped) <= {"max_snapshots", "off"}
    assert "past KVDBG_CAPTURE_MAX" in capturer.summary() or "capture was off" in capturer.summary()


@pytest.mark.parametrize("queue_bytes", [0, "auto"], ids=["in-caller", "background"])
def test_disk_full_mid_write_leaves_no_file_and_one_line(tmp_path, monkeypatch, caplog, queue_bytes):
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
    capturer = Capturer(tmp_path, queue_bytes=queue_bytes)
    capture_steps(capturer, engine, range(3))  # never raises into the engine
    assert capturer.flush(10)
    assert files(tmp_path) == []  # neither a partial file under a final name nor a temp file
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert not capturer.active
    capturer.close(1)
    assert "capture turned off: " in caplog.records[-1].getMessage() and "No space left" in \
        caplog.records[-1].getMessage()


@pytest.mark.parametrize("queue_bytes", [0, "auto"], ids=["in-caller", "background"])
def test_an_unwritable_directory_is_one_line_and_the_engine_goes_on(tmp_path, caplog, queue_bytes):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where the directory should be\n")
    capturer = Capturer(blocker / "snaps", queue_bytes=queue_bytes)
    capture_steps(capturer, engine, range(4))
    assert capturer.flush(10)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"cannot create capture directory {blocker / 'snaps'}: Not a directory" in errors[0]
    assert not capturer.active and capturer.written == []
    assert blocker.read_text() == "a file where the directory should be\n"
    capturer.close(1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_is_one_line(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        capturer = Capturer(directory)
        capture_steps(capturer, engine, range(3))
    finally:
        directory.chmod(0o755)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Permission denied" in errors[0]


CHILD_KILLED_MID_WRITE = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from kvdbg.snapshot import store as snapshot_module
    from kvdbg.capture.capturer import Capturer
    from tests.test_capture import Engine

    real_write = snapshot_module.write_safetensors

    def stuck_write(fh, *args, **kwargs):
        fh.write(b"half a snapshot")
        fh.flush()
        print("writing", flush=True)
        time.sleep(600)  # the parent kills this process here

    snapshot_module.write_safetensors = stuck_write
    engine = Engine(layout="pages,heads,tokens,2*dim", dtype="bfloat16")
    capturer = Capturer(sys.argv[1], queue_bytes="auto")
    capturer.capture(*engine.args(), output=engine.output, step=1, rank=0)
    time.sleep(600)
""")


def test_a_capture_killed_mid_write_leaves_only_a_temp_file_which_the_next_run_removes(tmp_path, caplog):
    directory = tmp_path / "snaps"
    directory.mkdir()
    child = subprocess.Popen([sys.executable, "-c", CHILD_KILLED_MID_WRITE.format(root=ROOT), str(directory)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    left = files(directory)
    assert len(left) == 1 and left[0].startswith(TEMP_PREFIX) and left[0].endswith(".tmp"), left
    assert f"-{child.pid}-" in left[0]
    assert stale_temp_files(str(directory)) == [str(directory / left[0])]
    # Temp files this run does not own stay: a live process's (its own parent's), another host's, other tools'.
    alive = f"{TEMP_PREFIX}{temp_files_module._HOST}-{os.getppid()}-abc123.tmp"
    elsewhere = f"{TEMP_PREFIX}otherhost-{child.pid}-abc123.tmp"
    for name in (alive, elsewhere, ".kvdbg-q1w2e3.tmp"):
        (directory / name).write_bytes(b"x")
    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    path = Capturer(directory).capture(*engine.args(), output=engine.output, step=2, rank=0)
    assert path is not None and load_snapshot(path).meta.capture["step"] == 2
    assert sorted(files(directory)) == sorted([os.path.basename(path), alive, elsewhere, ".kvdbg-q1w2e3.tmp"])
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert removed == [f"kvdbg capture: removed 1 temporary file(s) in {directory} left by capture processes that "
                       f"died mid-write (pid {child.pid})"]


CHILD_EXITS = textwrap.dedent("""
    import logging, sys
    sys.path.insert(0, {root!r})
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from kvdbg.capture.capturer import Capturer
    from tests.test_capture import Engine

    engine = Engine(layout="pages,heads,tokens,2*dim", dtype="bfloat16")
    capturer = Capturer(sys.argv[1], queue_bytes="auto", steps="0-2")
    for step in range(5):
        capturer.capture(*engine.args(), output=engine.output, step=step, rank=0)
    # no close(): the exit handler drains the writer and says the line
""")


def test_at_exit_the_writer_drains_and_one_line_says_what_was_captured(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHILD_EXITS.format(root=ROOT), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kvdbg capture in pid")]
    assert len(lines) == 1 and lines[0].endswith(f"captured 3 snapshot(s), {sum(os.path.getsize(tmp_path / n) for n in files(tmp_path))} bytes, into {tmp_path}; dropped 0")
    assert len(files(tmp_path)) == 3


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


def test_page_buffers_come_back_for_the_next_burst_within_the_budget_and_go_when_idle(tmp_path, monkeypatch):
    from kvdbg.capture import buffers as capture_buffers

    monkeypatch.setattr(capture_buffers, "POOLED_MIN_BYTES", 1)  # this engine's pages are small: pool them all
    monkeypatch.setattr(writer_module, "IDLE_RELEASE_SECONDS", 0.3)
    engine = Engine(layout=LAYOUT_VLLM)
    size = step_bytes(engine)
    capturer = Capturer(tmp_path, queue_bytes=3 * size)
    capture_steps(capturer, engine, range(3))
    assert capturer.flush(10) and len(capturer.written) == 3
    pool = capturer._buffers
    kept = pool.free_bytes
    # The burst's buffers are kept for the next one, never more than the budget leaves free.
    assert 0 < kept <= 3 * size
    free_ptrs = {b.data_ptr() for b in pool._free}
    pending = capturer.begin(*engine.args(), step=3, rank=0)
    assert pending.pages.data_ptr() in free_ptrs  # the next step's pages land in a kept buffer
    capturer.finish(pending, engine.output)
    assert capturer.flush(10) and len(capturer.written) == 4
    deadline = time.monotonic() + 10
    while pool.free_bytes and time.monotonic() < deadline:  # idle: the writer gives them back
        time.sleep(0.05)
    assert pool.free_bytes == 0
    assert capturer.close(10)


def test_the_pool_keeps_no_more_free_bytes_than_it_is_told():
    import torch

    from kvdbg.capture.buffers import POOLED_MIN_BYTES, HostBuffers

    pool = HostBuffers(keep_bytes=3 * POOLED_MIN_BYTES)
    buffers = [torch.empty(POOLED_MIN_BYTES * (i + 1), dtype=torch.uint8) for i in range(3)]
    for b in buffers:
        pool.give(b)
    # 1 + 2 + 3 units are over the 3 allowed: the oldest go first.
    assert [b.numel() for b in pool._free] == [3 * POOLED_MIN_BYTES]
    assert pool.trim() == 3 * POOLED_MIN_BYTES and pool.free_bytes == 0


def test_a_numpy_or_torch_step_number_is_filtered_and_recorded_as_an_int(tmp_path):
    import numpy as np
    import torch

    engine = Engine(layout=LAYOUT_VLLM, dtype="bfloat16")
    capturer = Capturer(tmp_path, steps="3-4", queue_bytes=0)
    paths = [capturer.capture(*engine.args(), output=engine.output, step=step, rank=0)
             for step in (np.int64(3), torch.tensor(4), np.int32(5))]
    assert paths[2] is None and [load_snapshot(p).meta.capture["step"] for p in paths[:2]] == [3, 4]
    assert capturer.requested == 2 and not capturer.dropped
    assert capturer.capture(*engine.args(), output=engine.output, step="3", rank=0) is None
    assert capturer.failures == {"input:CaptureInputError": 1} and capturer.dropped == {"input": 1}


def test_while_held_the_writer_finishes_its_step_and_starts_no_other(tmp_path, slow_disk):
    """A CUDA graph being recorded (the vLLM plugin holds the writer): CUDA forbids, process-wide, what the
    writer does for a step; the step under way is finished first, the next waits for the end of the hold."""
    engine = Engine()
    capturer = Capturer(str(tmp_path), queue_bytes=1 << 30)
    capture_steps(capturer, engine, [0, 1])
    assert slow_disk.writing.wait(10)  # step 0 is being written, step 1 waits in the queue
    done = {}

    def hold():
        with capturer.held_writer(timeout=10) as idle:
            done["idle"] = idle
            done["files"] = files(tmp_path)
            time.sleep(0.5)  # the graph's recording: the writer must not start step 1 meanwhile
            done["files_after"] = files(tmp_path)
            done["writing"] = capturer._writing

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.2)
    assert "idle" not in done  # the hold waits for the step under way...
    slow_disk.set()  # ...which finishes
    holder.join(10)
    assert done["idle"] is True and done["writing"] == 0
    assert len(done["files"]) == 1 and done["files_after"] == done["files"]
    assert capturer.flush(10) and len(files(tmp_path)) == 2  # released: the waiting step is written
    capturer.close()


def test_a_hold_waits_a_bounded_time_for_a_step_that_does_not_finish(tmp_path, slow_disk):
    engine = Engine()
    capturer = Capturer(str(tmp_path), queue_bytes=1 << 30)
    capture_steps(capturer, engine, [0])
    assert slow_disk.writing.wait(10)
    began = time.monotonic()
    with capturer.held_writer(timeout=0.3) as idle:
        assert idle is False
    assert time.monotonic() - began < 5
    slow_disk.set()
    assert capturer.flush(10) and len(files(tmp_path)) == 1
    capturer.close()
