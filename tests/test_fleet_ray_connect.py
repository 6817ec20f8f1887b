"""How `--ray` joins, leaves and watches a cluster, with a stand-in for Ray (no Ray needed; the real thing is
tests/fleet_ray).

The stand-in does what Ray 2.60 does where it matters: ``init`` for ``local`` starts a process with
``PR_SET_PDEATHSIG`` from the calling thread (Ray's fate sharing: Linux kills it when that *thread* ends), and the
driver's later calls need that process (the GCS) alive.
"""

from __future__ import annotations

import ctypes
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.errors import BackendUnavailable
from kvdbg.fleet import ray_executor
from kvdbg.fleet.ray_executor import RayPool
from kvdbg.replayer.batch import BatchOptions

from tests.helpers import FIXTURES

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


class AuthenticationError(Exception):
    """Named as Ray's (ray.exceptions.AuthenticationError)."""


class LocalRayletDiedError(Exception):
    """Named as Ray's: the raylet the driver submits through died."""


class WorkerCrashedError(Exception):
    pass


class FakeRay(types.ModuleType):
    """The parts of Ray that RayPool calls."""

    def __init__(self, *, init=None, gcs_address: str | None = None):
        super().__init__("ray")
        self._init = init
        self.gcs = None  # the "GCS" process a private cluster starts
        self.gcs_address = gcs_address
        self.shutdowns = 0
        self.seen_env: dict[str, str | None] = {}
        self.exceptions = types.SimpleNamespace(
            RayError=Exception, AuthenticationError=AuthenticationError, LocalRayletDiedError=LocalRayletDiedError,
            WorkerCrashedError=WorkerCrashedError, NodeDiedError=WorkerCrashedError,
            OutOfMemoryError=WorkerCrashedError)

    def init(self, address=None, **kwargs):
        self.seen_env = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        if self._init is not None:
            return self._init(address)
        if address == "local":  # as Ray's services.start_ray_process: fate-shared with the calling thread
            self.gcs = subprocess.Popen(["sleep", "120"], preexec_fn=_die_with_parent_thread)

    def _gcs_alive(self) -> None:
        if self.gcs is not None:
            time.sleep(0.2)  # the kernel's SIGKILL, had the thread ended, has landed by now
            if self.gcs.poll() is not None:
                raise ConnectionError("Failed to connect to GCS: it was killed")

    def cluster_resources(self):
        self._gcs_alive()
        return {"CPU": 2.0}

    def nodes(self):
        self._gcs_alive()
        return [{"Alive": True}]

    def get_runtime_context(self):
        return types.SimpleNamespace(gcs_address=self.gcs_address)

    def shutdown(self):
        self.shutdowns += 1
        if self.gcs is not None and self.gcs.poll() is None:
            self.gcs.kill()
            self.gcs.wait(timeout=10)


def _die_with_parent_thread() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, as ray._private.utils does


@pytest.fixture
def fake_ray(monkeypatch, tmp_path):
    """Install a FakeRay as ``ray`` (and hide Ray's compiled core, which the executor may reach for)."""

    def install(**kwargs) -> FakeRay:
        fake = FakeRay(**kwargs)
        monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where --ray local makes its cluster's directory
        monkeypatch.setitem(sys.modules, "ray", fake)
        monkeypatch.setitem(sys.modules, "ray._raylet", None)
        return fake

    made: list[FakeRay] = []
    yield lambda **kw: made.append(install(**kw)) or made[-1]
    for fake in made:
        if fake.gcs is not None and fake.gcs.poll() is None:
            fake.gcs.kill()
            fake.gcs.wait(timeout=10)


@linux
def test_the_thread_that_starts_a_private_cluster_outlives_the_connection(fake_ray):
    """Issue 44.4: ray.init ran in a thread that then ended, and Linux killed the cluster's processes with it;
    the driver's next call found no GCS (Ray then ends the process after 60 s, exit 1)."""
    fake = fake_ray()
    pool = RayPool("local", BatchOptions(), connect_timeout=30)
    try:
        info = pool.connect()
        assert info["nodes"] == 1 and info["cpus"] == 2
        time.sleep(0.3)
        assert fake.gcs.poll() is None, "the private cluster died when connect() returned"
    finally:
        pool.close()
    assert fake.shutdowns == 1 and fake.gcs.poll() is not None  # close() ended it, within its bound


def test_a_private_cluster_has_its_own_token_and_leaves_the_environment_as_it_was(fake_ray, monkeypatch,
                                                                                   tmp_path):
    """Issue 44.5: Ray 2.60 starts a private cluster with token authentication and reads, or writes,
    ~/.ray/auth_token for it. kvdbg gives it a token of its own (RAY_AUTH_TOKEN, which Ray prefers to the file)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-users-own")
    fake = fake_ray()
    pool = RayPool("local", BatchOptions(), connect_timeout=30)
    try:
        pool.connect()
    finally:
        pool.close()
    token = fake.seen_env["RAY_AUTH_TOKEN"]
    assert token and token != "the-users-own" and len(token) == 64
    assert os.environ["RAY_AUTH_TOKEN"] == "the-users-own" and "RAY_AUTH_MODE" not in os.environ
    assert not (tmp_path / ".ray").exists()
    # Another address is Ray's business: the environment is left as the user set it.
    fake = fake_ray()
    pool = RayPool("auto", BatchOptions(), connect_timeout=30)
    try:
        pool.connect()
    finally:
        pool.close()
    assert fake.seen_env["RAY_AUTH_TOKEN"] == "the-users-own"


def test_an_init_that_hangs_is_one_line_within_the_bound(fake_ray, monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    abandoned = []
    monkeypatch.setattr(ray_executor, "_abandon_ray", abandoned.append)  # this process goes on
    never = threading.Event()
    fake_ray(init=lambda address: never.wait(60))
    pool = RayPool("local", BatchOptions(), connect_timeout=1)
    started = time.monotonic()
    try:
        with pytest.raises(BackendUnavailable) as err:
            pool.connect()
    finally:
        never.set()
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert message.startswith("--ray local: Ray did not start a cluster here within 1 s (Ray's messages: ")
    assert "\n" not in message and sys.stdout is not sys.stderr  # stdout given back
    assert len(abandoned) == 1  # the init still runs: Ray's atexit hook would wait for it


def test_a_refused_token_is_one_line_that_says_which_token(fake_ray, monkeypatch, tmp_path):
    """Ray says only 'Failed to connect to Ray cluster at ...' (after about 20 s of one message a second); the
    cause is in the exception's chain."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def refuse(address):
        try:
            raise AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing or incorrect.")
        except AuthenticationError as exc:
            raise ConnectionError(f"Failed to connect to Ray cluster at {address}") from exc

    fake_ray(init=refuse)
    with pytest.raises(BackendUnavailable) as err:
        RayPool("auto", BatchOptions(), connect_timeout=10).connect()
    message = str(err.value)
    assert message.startswith("--ray auto: the cluster refused this driver's token (InvalidAuthToken); give this "
                              "driver the cluster's token: RAY_AUTH_MODE=token with RAY_AUTH_TOKEN"), message
    assert "\n" not in message


def test_ray_writing_to_file_descriptor_2_while_joining_is_kept_out_of_the_way(fake_ray, monkeypatch, tmp_path,
                                                                              capfd):
    """Ray's core logs straight to fd 2 (a line a second while it retries): a failure must still be one line."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def noisy(address):
        for i in range(5):
            os.write(2, f"[2026-01-01 00:00:0{i},000 W 1 2] gcs_client.cc:210: Failed to get cluster ID\n".encode())
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.7:6379")

    fake_ray(init=noisy)
    with pytest.raises(BackendUnavailable) as err:
        RayPool("auto", BatchOptions(), connect_timeout=10).connect()
    assert capfd.readouterr().err == ""
    message = str(err.value)
    assert message.startswith("--ray auto: cannot join the cluster: ConnectionError: Failed to connect to Ray "
                              "cluster at 10.0.0.7:6379 (Ray's messages: ")
    log = message.rsplit(" ", 1)[1].rstrip(")")
    assert open(log).read().count("Failed to get cluster ID") == 5
    # A connection that works leaves no file behind.
    fake_ray()
    pool = RayPool("auto", BatchOptions(), connect_timeout=10)
    pool.connect()
    pool.close()
    assert os.listdir(tmp_path) == [os.path.basename(log)]


def test_a_head_that_stops_answering_stops_the_run_with_one_line(fake_ray, monkeypatch):
    """Ray's own client waits 60 s for a lost GCS and then ends the process with exit 1 (a failing verdict's
    code); kvdbg probes the head and stops first, exit 2, the rows kept."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = fake_ray(gcs_address=f"127.0.0.1:{port}")
    waits = []

    def wait(refs, num_returns=1, timeout=None):
        waits.append(time.monotonic())
        assert len(waits) < 200, "the run went on without its head"
        time.sleep(0.01)
        return [], refs

    fake.wait = wait
    fake.cancel = lambda ref, force=False: None
    fake.remote = lambda fn: types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: object()))
    monkeypatch.setattr(ray_executor, "GCS_PROBE_EVERY_S", 0.05, raising=False)
    pool = RayPool("127.0.0.1:1", BatchOptions(), stall_timeout=3600)
    pool.resources, pool._gcs = {"CPU": 2.0}, fake.gcs_address
    with pytest.raises(BackendUnavailable) as err:
        list(pool.run([(0, "a.safetensors"), (1, "b.safetensors")]))
    assert str(err.value) == (f"--ray 127.0.0.1:1: the cluster's head (GCS at 127.0.0.1:{port}) stopped answering; "
                              "2 file(s) were not replayed (--resume continues them)")


def test_rays_words_are_addresses_even_where_a_file_has_that_name(tmp_path, monkeypatch):
    directory = tmp_path / "d"
    directory.mkdir()
    shutil.copy(os.path.join(FIXTURES, "causal_gqa.safetensors"), directory)
    (tmp_path / "local").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed: the address was accepted
    res = CliRunner().invoke(cli, ["replay", str(directory), "--ray", "local"])
    assert res.exit_code == 2 and res.output.startswith("Error: --ray needs Ray, which is not installed"), res.output


def test_no_cluster_to_find_says_what_to_do(fake_ray, monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def none_here(address):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    fake_ray(init=none_here)
    with pytest.raises(BackendUnavailable) as err:
        RayPool(None, BatchOptions(), connect_timeout=10).connect()
    assert str(err.value).startswith("--ray auto: no Ray cluster runs on this machine: start one (ray start --head), "
                                     "give the address of one (--ray HOST:PORT, RAY_ADDRESS), or run a private one "
                                     "for this run (--ray local) (Ray's messages: ")


@linux
def test_a_shutdown_that_hangs_is_bounded_and_the_private_cluster_ends_anyway(fake_ray, monkeypatch):
    """Without its GCS, Ray's shutdown can wait for ever (then Ray's client ends the process, exit 1, 60 s after
    the GCS went): close() gives it CLOSE_TIMEOUT_S, ends the processes the private cluster started and all
    below them (Ray's agents are the raylet's children), and takes Ray's own atexit hook out of the way."""
    forgotten, left = [], []
    monkeypatch.setattr("atexit.unregister", forgotten.append)
    monkeypatch.setattr(ray_executor, "_leave_fd2_to_ray", lambda: left.append(True))  # this process goes on
    monkeypatch.setattr(ray_executor, "_exit_at_once", lambda: left.append(True))
    monkeypatch.setattr(ray_executor, "CLOSE_TIMEOUT_S", 1.0)
    wedged = threading.Event()
    fake = fake_ray()

    def start(address):  # a "raylet" with an "agent" below it
        fake.gcs = subprocess.Popen(["sh", "-c", "sleep 120 & wait"], preexec_fn=_die_with_parent_thread)

    fake._init = start
    fake.shutdown = lambda: wedged.wait(60)
    pool = RayPool("local", BatchOptions(), connect_timeout=30)
    pool.connect()
    time.sleep(0.3)
    below = [pid for pid in ray_executor._children(fake.gcs.pid)]
    assert below, "the stand-in raylet has no child"
    started = time.monotonic()
    try:
        pool.close()
    finally:
        wedged.set()
    assert time.monotonic() - started < 5
    assert fake.gcs.wait(timeout=10) == -signal.SIGKILL
    for pid in below:  # SIGKILL'ed: gone (or a zombie of init's) once the kernel is through with it
        end = time.monotonic() + 10
        while (stat := ray_executor._stat(pid)) is not None and stat[0] != b"Z" and time.monotonic() < end:
            time.sleep(0.05)
        assert stat is None or stat[0] == b"Z", f"process {pid} below the private cluster still runs"
    assert forgotten == [fake.shutdown] and left == [True, True]


def test_the_driver_s_own_node_dying_stops_the_run_with_one_line(fake_ray):
    """LocalRayletDiedError is Ray's failure, not the file's: no task can run after it (it was a row per file,
    'the worker process died twice', exit 1)."""
    fake = fake_ray()
    fake.wait = lambda refs, num_returns=1, timeout=None: (refs[:1], refs[1:])
    fake.cancel = lambda ref, force=False: None
    fake.remote = lambda fn: types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: object()))

    def get(ref, timeout=None):
        raise LocalRayletDiedError("The task's local raylet died. Check raylet.out for more information.")

    fake.get = get
    pool = RayPool("local", BatchOptions())
    pool.resources = {"CPU": 2.0}
    with pytest.raises(BackendUnavailable) as err:
        list(pool.run([(0, "a.safetensors"), (1, "b.safetensors"), (2, "c.safetensors")]))
    assert str(err.value) == ("--ray local: the Ray node of this machine died (LocalRayletDiedError: The task's "
                              "local raylet died. Check raylet.out for more information.); 3 file(s) were not "
                              "replayed (--resume continues them)")


def test_rays_messages_during_a_run_are_one_line_each():
    shown = io.StringIO()
    out = ray_executor._FirstLines(shown)
    print("(raylet) Raylet is terminated. Last 20 lines of the Raylet logs:\n    [state-dump] a\n    b", file=out)
    print("(raylet) A worker died", file=out, end="")
    print(" or was killed.", file=out)
    assert shown.getvalue() == ("(raylet) Raylet is terminated. Last 20 lines of the Raylet logs:\n"
                                "(raylet) A worker died or was killed.\n")


def test_a_ray_left_running_neither_writes_after_the_error_nor_decides_the_exit(tmp_path):
    """Ray's core left running (close() could not shut it down): what it writes to file descriptor 2 never
    follows kvdbg's error line (sys.stderr still reaches the real stderr), Ray's atexit hook does not run, and
    sys.exit's code is the process's, whatever the interpreter's ending would do. In a child process: this is
    for good."""
    code = ("import atexit, os, sys, types\n"
            "from kvdbg.fleet.ray_executor import _abandon_ray\n"
            "ray = types.SimpleNamespace(shutdown=lambda: os.write(1, b'ray.shutdown ran at exit'))\n"
            "atexit.register(ray.shutdown)\n"
            "atexit.register(lambda: os.kill(os.getpid(), 11))  # as the interpreter's ending in Ray's core\n"
            "_abandon_ray(ray)\n"
            "os.write(2, b'[E] task_manager.cc: Failed to push error to driver\\n')\n"
            "print('Error: --ray local: one line', file=sys.stderr)\n"
            "print('out')\n"
            "sys.exit(2)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr == "Error: --ray local: one line\n", res.stderr
    assert res.stdout == "out\n"
