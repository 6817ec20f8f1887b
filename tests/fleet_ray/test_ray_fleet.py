"""`kvdbg replay DIR --ray ADDRESS` on a real Ray cluster of this machine (head + two worker nodes).

The Ray stage (tests/fleet_ray/run.sh, run by .ci/run) installs kvdbg[ray] and
runs these; elsewhere they are skipped when Ray is not installed. Every
subprocess and every wait here is bounded; the cluster is stopped by the
session fixture whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from kvdbg.replayer.batch import STATUS_PASS, BatchOptions, find_snapshots
from kvdbg.fleet.runs import run_fleet
from kvdbg.fleet.results import read_results

from tests.fleet_helpers import mixed_directory, rows, small_directory, verdicts, wait_for_rows, write_cause
from tests.helpers import ROOT

if os.environ.get("KVDBG_REQUIRE_RAY"):  # the Ray stage: a missing or broken Ray fails, never skips
    import ray  # noqa: F401
else:
    pytest.importorskip("ray")

RUN_TIMEOUT_S = 420  # one kvdbg run over a dozen small files, workers' start included, on 2 busy cores


def kvdbg(*args, env=None):
    """`python -m kvdbg ARGS` as its own Ray driver (bounded)."""
    return subprocess.run([sys.executable, "-m", "kvdbg", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, env=dict(os.environ, **(env or {})))


def start_kvdbg(*args):
    return subprocess.Popen([sys.executable, "-m", "kvdbg", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_same_verdicts_and_groups_as_jobs(ray_cluster, tmp_path):
    directory = tmp_path / "mixed"
    planted = mixed_directory(str(directory))
    on_ray, on_jobs = tmp_path / "ray.jsonl", tmp_path / "jobs.jsonl"
    ray_run = kvdbg("replay", directory, "--ray", ray_cluster.address, "--results", on_ray, "--json")
    jobs_run = kvdbg("replay", directory, "--jobs", "2", "--results", on_jobs, "--json")
    assert ray_run.returncode == jobs_run.returncode == 2, ray_run.stderr
    assert verdicts(rows(str(on_ray))) == verdicts(rows(str(on_jobs)))
    ray_data, jobs_data = json.loads(ray_run.stdout), json.loads(jobs_run.stdout)
    assert ray_data["triage"] == jobs_data["triage"] and ray_data["verdict"] == jobs_data["verdict"]
    assert len(ray_data["triage"]["groups"]) == len(planted) - 1  # one group per planted cause, passes aside
    run = ray_data["run"]
    assert run["executor"]["kind"] == "ray" and run["executor"]["nodes"] == 3 and run["executor"]["cpus"] == 2
    # Both worker nodes took files; they share this host's address, so their node ids tell them apart.
    devices = run["devices"]
    assert len(devices) == 2 and sum(d["files"] for d in devices) == 11, devices
    assert all(d["device"].endswith(" cpu") and "/" in d["device"] for d in devices)
    assert read_results(str(on_ray)).runs[0]["executor"]["kind"] == "ray"


def test_a_worker_killed_mid_run_loses_nothing(ray_cluster, tmp_path):
    """SIGKILL to the Ray worker process replaying files: Ray runs its task again; every file gets its row."""
    directory = tmp_path / "d"
    paths = small_directory(str(directory), 12)
    results = str(tmp_path / "r.jsonl")
    process = start_kvdbg("replay", directory, "--ray", ray_cluster.address, "--results", results, "--json")
    try:
        first = wait_for_rows(results, 2, timeout=RUN_TIMEOUT_S, process=process)
        victim = first[-1]["placement"]["pid"]
        os.kill(victim, signal.SIGKILL)
        out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, err.decode()[-3000:]
    data = json.loads(out)
    assert [f["status"] for f in data["files"]] == [STATUS_PASS] * 12
    assert sorted(os.path.basename(r["path"]) for r in rows(results)) == sorted(map(os.path.basename, paths))
    assert len(rows(results)) == 12  # one row per file: nothing lost, nothing twice


def test_a_task_whose_worker_dies_is_retried_once_then_reported(ray_cluster, tmp_path):
    """A file that kills its worker once passes on the retry; one that kills it every time gets a row saying so."""
    directory = tmp_path / "d"
    paths = small_directory(str(directory), 2)
    once = write_cause(str(directory), "pass", 60, name="die_once.safetensors")
    always = write_cause(str(directory), "pass", 61, name="die.safetensors")
    from tests.fleet_helpers import dying_replay

    fleet = run_fleet([*paths, once, always], BatchOptions(), use_ray=True, ray=ray_cluster.address,
                      replay=dying_replay)
    statuses = {os.path.basename(r.path): r.result.status for r in fleet.rows}
    assert statuses == {"s0000.safetensors": "pass", "s0001.safetensors": "pass", "die_once.safetensors": "pass",
                        "die.safetensors": "crashed"}
    assert os.path.exists(once + ".died")  # its first attempt did die
    died = fleet.rows[-1].result.summary
    assert died.startswith("the worker process died twice (it was retried once): WorkerCrashedError"), died
    assert [g.signature.kind for g in fleet.triage.groups] == ["worker died"] and fleet.batch.exit_code == 1


def test_resume_after_an_interrupted_run_finishes_the_rest(ray_cluster, tmp_path):
    """The driver killed mid-run (SIGKILL: no end record); --resume replays only what has no row."""
    directory = tmp_path / "d"
    # Three quick files first (names sort first), then longer ones: the run is surely still going when the third
    # row is in, however quiet the machine.
    paths = small_directory(str(directory), 3, seed=300)
    paths += [write_cause(str(directory), "pass", 700 + i, name=f"t{i:04d}.safetensors", seq_lens=(12000, 16000))
              for i in range(8)]
    total = len(paths)
    results = str(tmp_path / "r.jsonl")
    process = start_kvdbg("replay", directory, "--ray", ray_cluster.address, "--results", results)
    try:
        wait_for_rows(results, 3, timeout=RUN_TIMEOUT_S, process=process)
        process.kill()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    interrupted = read_results(results)
    kept = len(interrupted.rows)
    assert 3 <= kept < total and not interrupted.finished
    resumed = kvdbg("replay", directory, "--ray", ray_cluster.address, "--results", results, "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    data = json.loads(resumed.stdout)
    assert data["run"]["resumed"] == kept and data["run"]["replayed"] == total - kept
    assert [f["status"] for f in data["files"]] == [STATUS_PASS] * total
    final = read_results(results)
    assert final.finished and len(final.rows) == total and len(final.runs) == 2
    assert sorted(os.path.basename(r.path) for r in final.rows) == sorted(map(os.path.basename, paths))
    assert len(rows(results)) == total  # the kept rows were not replayed again


def test_no_cluster_at_the_address_is_a_one_line_error(tmp_path):
    paths = small_directory(str(tmp_path / "d"), 1)
    with socket_closed_port() as port:
        res = kvdbg("replay", paths[0], "--ray", f"127.0.0.1:{port}")
    assert res.returncode == 2
    assert res.stderr.strip().startswith(f"Error: --ray 127.0.0.1:{port}: nothing answers there")
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_cluster_without_gpus_refuses_cuda_tasks(ray_cluster, tmp_path):
    paths = small_directory(str(tmp_path / "d"), 1)
    res = kvdbg("replay", paths[0], "--ray", ray_cluster.address, "--device", "cuda")
    assert res.returncode == 2, res.stderr
    assert "no node offers the 1 GPU a task asks for (the cluster has: CPU 2)" in res.stderr


class socket_closed_port:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass


def test_every_file_of_a_directory_is_a_task(ray_cluster, tmp_path):
    """find_snapshots' files go out as absolute paths: a relative DIR works from any working directory."""
    directory = tmp_path / "rel"
    small_directory(str(directory), 2)
    res = subprocess.run([sys.executable, "-m", "kvdbg", "replay", "rel", "--ray", ray_cluster.address, "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    assert [f["path"] for f in data["files"]] == [os.path.join("rel", os.path.basename(p))
                                                  for p in find_snapshots([str(directory)])]
