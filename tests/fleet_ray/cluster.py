"""A Ray cluster on this machine for the Ray stage and the bench: a head and N worker nodes on 127.0.0.1.

Started with Ray's own command line (``ray start --block``), one process group
per node, every wait bounded. :meth:`LocalCluster.stop` stops exactly the
nodes it started: SIGTERM to each ``ray start`` (Ray drains the node and ends
its processes), then SIGKILL to each node's process group, then any process
still naming this cluster's private temp directory -- never ``ray stop``, which
would end every Ray process of the machine, other users' included. If the test
process itself dies, each ``ray start`` gets SIGKILL from the kernel (Linux's
parent-death signal) and Ray's fate sharing takes its node down with it.

Ray records the nodes under the host's own address (it turns 127.0.0.1 into
it); the drivers connect through 127.0.0.1.

**Token authentication, pinned.** Ray 2.60's ``ray start --head`` turns token
authentication on by itself when ``~/.ray/auth_token`` exists (as on any
machine where Ray ran before: a cluster ``ray.init`` starts writes it), while
``ray start --address=...`` (the worker nodes) and a driver given an address
never do: with that file the worker nodes and the drivers were refused
(``InvalidAuthToken``) and never joined. So the cluster does not leave it to
``~/.ray``: every node runs with ``RAY_AUTH_MODE=token`` and a token of its own
(``RAY_AUTH_TOKEN``, which Ray prefers to any file), and :meth:`LocalCluster.drivers`
(entered by ``with LocalCluster() as cluster``) gives the drivers of this
process and its children the same. Nothing under ``~/.ray`` is read or written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from kvdbg.util.environ import restore_environ, saved_environ

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_death_kills() -> None:
    """In the child before exec: SIGKILL when the test process dies (Linux); its own process group."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalCluster:
    """Head (no CPU for tasks) plus ``workers`` nodes of ``cpus`` CPU each; ``address`` is ``127.0.0.1:PORT``."""

    def __init__(self, workers: int = 2, cpus: int = 1, *, timeout: float = 180.0):
        self.workers, self.cpus, self.timeout = workers, cpus, timeout
        self.ray = os.path.join(os.path.dirname(sys.executable), "ray")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Short: Ray puts its sockets below it, and a socket path holds at most 107 bytes.
        self.temp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
        # What a driver of this cluster needs in its environment (see the module doc).
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=ROOT,
                        # one thread per task, as the --jobs workers on these cores
                        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **self.auth_env)
        self.env.pop("RAY_AUTH_TOKEN_PATH", None)
        self.nodes: list[tuple[subprocess.Popen, str]] = []

    def _start_node(self, args: list[str], name: str) -> None:
        log = os.path.join(self.temp, f"{name}.log")
        with open(log, "wb") as out:
            process = subprocess.Popen([self.ray, "start", *args, "--block", "--disable-usage-stats"],
                                       stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.temp,
                                       preexec_fn=_parent_death_kills)
        self.nodes.append((process, log))
        end = time.monotonic() + self.timeout
        while time.monotonic() < end:
            with open(log, "rb") as fh:
                if b"block forever" in fh.read():
                    return
            if process.poll() is not None:
                break
            time.sleep(0.2)
        with open(log, "rb") as fh:
            tail = fh.read()[-2000:].decode(errors="replace")
        raise RuntimeError(f"ray node {name} did not start within {self.timeout:.0f} s:\n{tail}")

    def start(self) -> "LocalCluster":
        try:
            self._start_node(["--head", "--node-ip-address=127.0.0.1", f"--port={self.port}", "--num-cpus=0",
                              "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={self.temp}"], "head")
            for i in range(self.workers):  # one after the other: nodes started at once race for ports
                self._start_node([f"--address={self.address}", "--node-ip-address=127.0.0.1",
                                  f"--num-cpus={self.cpus}", "--num-gpus=0"], f"worker{i}")
            self._wait_for_cpus()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_cpus(self) -> None:
        """Until the cluster reports every worker node's CPUs (a driver in a child process, bounded)."""
        code = ("import ray, sys, time; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                "end = time.monotonic() + float(sys.argv[3])\n"
                "while ray.cluster_resources().get('CPU', 0) < float(sys.argv[2]) and time.monotonic() < end:\n"
                "    time.sleep(0.5)\n"
                "print(ray.cluster_resources().get('CPU', 0))")
        need = self.workers * self.cpus
        out = subprocess.run([sys.executable, "-c", code, self.address, str(need), str(self.timeout)],
                             capture_output=True, text=True, env=self.env, timeout=self.timeout + 60)
        if out.returncode != 0 or float(out.stdout.split()[-1]) < need:
            raise RuntimeError(f"the cluster at {self.address} did not offer {need} CPU: {out.stdout}{out.stderr}")

    def stop(self) -> list[int]:
        """Stop every node started here; returns the ids of stray processes that had to be killed."""
        for process, _ in reversed(self.nodes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process, _ in reversed(self.nodes):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its group: whatever the node left behind
            except (ProcessLookupError, PermissionError):
                pass
            if process.poll() is None:
                process.wait(timeout=30)
        strays = self._strays()
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes = []
        shutil.rmtree(self.temp, ignore_errors=True)
        return strays

    def _strays(self) -> list[int]:
        """Processes whose command line names this cluster's temp directory (its nodes' and workers')."""
        mine = self.temp.encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if mine in fh.read():
                        found.append(int(entry))
            except OSError:
                continue
        return found

    @contextlib.contextmanager
    def drivers(self):
        """os.environ holds this cluster's token while inside: drivers started here (``python -m kvdbg``) or
        in this process (run_fleet) are let in. This process's Ray, if imported, reads it again on the way
        in and out (it caches the mode and the token)."""
        saved = saved_environ((*self.auth_env, "RAY_AUTH_TOKEN_PATH"))
        os.environ.update(self.auth_env)
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        _reload_ray_auth()
        try:
            yield self
        finally:
            restore_environ(saved)
            _reload_ray_auth()

    def __enter__(self) -> "LocalCluster":
        self.start()
        self._drivers = self.drivers()
        self._drivers.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._drivers.__exit__(None, None, None)
        finally:
            self.stop()


def _reload_ray_auth() -> None:
    if "ray" in sys.modules:
        from kvdbg.fleet.ray_executor import _reload_ray_auth as reload

        reload()
