"""Replays snapshots for the engine stage through kvdbg's console script, one after another in one process.

Each replay is ``kvdbg replay --json PATH`` run by ``kvdbg.cli.main``, the function the ``kvdbg`` script calls, with
this process's stdout and stderr caught for it: what the script would print and its exit code. The process imports
vLLM and torch once for all the snapshots it replays, which a process per snapshot does every time (about 10 of
each replay's seconds on 2 cores).

Protocol (``ReplayWorkers`` in this module is the other end): one JSON line per request on stdin, ``{"path": ...}``;
one JSON line per answer, ``{"rc": int, "stdout": str, "stderr": str}``, on the process's original stdout. Anything
else written to file descriptor 1 while a replay runs (a library's logging handler bound to it earlier) goes to
stderr instead, which the caller sends to a log file.
"""

from __future__ import annotations

import io
import json
import os
import queue
import subprocess
import sys
import threading
import traceback
from contextlib import redirect_stderr, redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def replay(path: str) -> dict:
    """``kvdbg replay --json PATH`` as the console script runs it: its exit code and what it printed."""
    from kvdbg.cli import main

    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(["replay", "--json", path])
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the script would print this and exit 1
            traceback.print_exc()
            rc = 1
    out.flush()
    err.flush()
    return {"rc": rc, "stdout": out.buffer.getvalue().decode("utf-8", "replace"),
            "stderr": err.buffer.getvalue().decode("utf-8", "replace")}


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # fd 1 is stderr from now on: only answers reach the caller's pipe
    for line in sys.stdin:
        if line.strip():
            answers.write(json.dumps(replay(json.loads(line)["path"])) + "\n")
            answers.flush()


class ReplayWorkers:
    """``count`` worker processes (this module run in this interpreter), each replaying one snapshot at a time; a
    worker that dies is said in the answer (its log's tail) and started again for the next snapshot."""

    def __init__(self, count: int, log_dir: str):
        self.log_dir = log_dir
        self.idle: queue.SimpleQueue = queue.SimpleQueue()
        self.started = 0
        self._lock = threading.Lock()
        for _ in range(count):
            self.idle.put(self._start())

    def _start(self) -> tuple[subprocess.Popen, str]:
        with self._lock:
            self.started += 1
            log_path = os.path.join(self.log_dir, f"replay-worker-{self.started}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tests.engine.replay_worker"], cwd=ROOT, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        return proc, log_path

    def replay(self, path: str) -> subprocess.CompletedProcess:
        proc, log_path = self.idle.get()
        try:
            proc.stdin.write(json.dumps({"path": path}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            proc.kill()
            proc.wait()
            with open(log_path) as f:
                tail = f.read()[-600:]
            self.idle.put(self._start())
            return subprocess.CompletedProcess(["kvdbg", "replay", "--json", path], -1, "",
                                               f"the replay worker died (exit {proc.returncode}): {tail}")
        self.idle.put((proc, log_path))
        answer = json.loads(line)
        return subprocess.CompletedProcess(["kvdbg", "replay", "--json", path], answer["rc"], answer["stdout"],
                                           answer["stderr"])

    def close(self) -> None:
        while True:
            try:
                proc, _ = self.idle.get_nowait()
            except queue.Empty:
                return
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    serve()
