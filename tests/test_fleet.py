"""`kvdbg replay DIR` as a fleet run: workers per device, a results file kept across runs, groups by cause."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from kvdbg.replayer.batch import STATUS_PASS, BatchOptions, find_snapshots
from kvdbg.cli import cli
from kvdbg.errors import BackendUnavailable, OptionError
from kvdbg.fleet.runs import run_fleet
from kvdbg.fleet.results import ResultsError, read_results
from kvdbg.fleet.workers import Started, WorkerSlot, default_per_gpu, plan_workers, visible_gpus

from tests.fleet_helpers import (dying_replay, env_replay, mixed_directory, rows, small_directory, verdicts,
                                 wait_for_rows, write_cause)
from tests.helpers import ROOT, shown_commands, wider_than


# Worker tests replay the reference alone: a worker's start (importing torch) is what they pay for.
QUICK = BatchOptions(backends=("reference",))


def invoke(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


# --------------------------------------------------------------------------- which worker on which device


def test_cpu_workers_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert plan_workers("cpu", None, [], 16) == [WorkerSlot(0, "cpu")]
    slots = plan_workers("cpu", 4, ["0", "1"], 16)  # GPUs are not used unless asked for
    assert [(s.device, s.visible, s.threads) for s in slots] == [("cpu", None, 4)] * 4
    assert slots[0].env == {"OMP_NUM_THREADS": "4"} and slots[0].pinned_device == "cpu"
    assert plan_workers("auto", 2, [], 3)[0].threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting stays
    assert plan_workers("cpu", 4, [], 16)[0].env == {}


def test_every_gpu_gets_workers_interleaved():
    slots = plan_workers("cuda", 2, ["0", "1", "2", "3"], 64)
    assert [s.device for s in slots] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"] * 2
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots[:4]] == ["0", "1", "2", "3"]
    assert {s.pinned_device for s in slots} == {"cuda"} and {s.threads for s in slots} == {8}
    # "auto" is cuda when a GPU is visible; the default is two per GPU, one where cores are short.
    assert len(plan_workers("auto", None, ["0", "1"], 16)) == 4
    assert default_per_gpu(16, 1) == 2 and default_per_gpu(8, 8) == 1 and default_per_gpu(2, 8) == 1


def test_one_gpu_named_gets_every_worker():
    slots = plan_workers("cuda:1", 3, ["0", "1"], 8)
    assert [(s.device, s.visible) for s in slots] == [("cuda:1", "1")] * 3


def test_visible_devices_are_kept_as_written():
    """A parent already restricted (or addressing GPUs by UUID) pins each worker to the very GPU it calls cuda:i."""
    env = {"CUDA_VISIBLE_DEVICES": "3, GPU-8f2c,1"}
    assert visible_gpus(3, env) == ["3", "GPU-8f2c", "1"]
    assert visible_gpus(2, env) == ["3", "GPU-8f2c"]  # torch saw two: the third entry is not a GPU it can use
    assert visible_gpus(2, {}) == ["0", "1"]
    slots = plan_workers("cuda", 1, visible_gpus(3, env), 8)
    assert [(s.device, s.env["CUDA_VISIBLE_DEVICES"]) for s in slots] == [
        ("cuda:0", "3"), ("cuda:1", "GPU-8f2c"), ("cuda:2", "1")]


@pytest.mark.parametrize("parent_env", [None, "5,7,9"])
def test_three_gpus_each_get_their_workers_pinned(tmp_path, monkeypatch, parent_env):
    """The scheduler of several GPUs on a machine with none: torch's count is replaced by 3, and the replay by
    one that only notes what its worker sees (tests.fleet_helpers.env_replay)."""
    import kvdbg.fleet.workers

    monkeypatch.setattr(kvdbg.fleet.workers, "cuda_count", lambda: 3)
    if parent_env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent_env)
    ids = (parent_env or "0,1,2").split(",")
    paths = [write_cause(str(tmp_path), "corrupt", i, name=f"f{i:02d}.safetensors") for i in range(12)]
    killed = []

    def kill_the_fifth(event):
        if isinstance(event, Started) and event.index == 4 and event.attempt == 1:
            os.kill(event.placement.pid, signal.SIGKILL)
            killed.append(event.placement.device)

    fleet = run_fleet(paths, BatchOptions(device="cuda"), jobs=2, replay=env_replay, on_event=kill_the_fifth)
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == parent_env  # the parent's own environment is unchanged
    assert fleet.executor["per_device"] == {"cuda:0": 2, "cuda:1": 2, "cuda:2": 2}
    assert [d.device for d in fleet.devices] == ["cuda:0", "cuda:1", "cuda:2"]
    assert all(d.files for d in fleet.devices) and sum(d.files for d in fleet.devices) == 12
    assert [r.result.status for r in fleet.rows] == ["pass"] * 12
    for row in fleet.rows:  # each worker saw only its GPU, under the parent's name for it, as "cuda"
        with open(f"{row.path}.{row.placement.pid}.where", encoding="utf-8") as fh:
            seen = json.load(fh)
        assert seen == {"CUDA_VISIBLE_DEVICES": ids[int(row.placement.device[-1])], "device": "cuda"}
    # The killed worker's file went to a fresh worker on the same GPU.
    assert fleet.rows[4].attempts == 2 and fleet.rows[4].placement.device == killed[0]
    assert [(w.placement.device, w.index, w.retried) for w in fleet.lost] == [(killed[0], 4, True)]


def test_device_errors_name_the_option():
    with pytest.raises(BackendUnavailable, match="--device cuda: no CUDA device is visible"):
        plan_workers("cuda", None, [], 8)
    with pytest.raises(OptionError, match=r"--device cuda:2: only 2 CUDA device\(s\) are visible"):
        plan_workers("cuda:2", None, ["0", "1"], 8)


def test_cuda_on_a_machine_without_one_is_a_one_line_error(tmp_path):
    small_directory(str(tmp_path / "d"), 2)
    res = invoke("replay", tmp_path / "d", "--device", "cuda", "--jobs", "2")
    assert res.exit_code == 2
    assert res.output.strip().startswith("Error: --device cuda: ") and len(res.output.strip().splitlines()) == 1


# --------------------------------------------------------------------------- a directory of mixed causes


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fleet") / "mixed")
    return directory, mixed_directory(directory)


@pytest.fixture(scope="module")
def mixed_run(mixed, tmp_path_factory):
    """`kvdbg replay DIR --jobs 2 --results F --json` over the mixed directory, once for the module."""
    directory, _ = mixed
    results = str(tmp_path_factory.mktemp("runs") / "mixed.jsonl")
    res = invoke("replay", directory, "--jobs", "2", "--results", results, "--json")
    return res, results


def test_groups_match_the_causes_built_in(mixed, mixed_run):
    """Done-when of the fleet issue: several failure causes, passes and a corrupt file give one group per cause."""
    _, planted = mixed
    res, _ = mixed_run
    assert res.exit_code == 2, res.output  # a corrupt file is bad input
    data = json.loads(res.stdout)
    groups = data["triage"]["groups"]
    found = {frozenset(os.path.basename(p) for p in g["paths"]): g for g in groups}
    expected = {cause: frozenset(names) for cause, names in planted.items() if cause != "pass"}
    assert set(found) == set(expected.values()), [g["key"] for g in groups]
    flex = found[expected["flex_null_page"]]
    assert flex["kind"] == "fail" and "error finding live_page_zero" in flex["parts"]
    assert "flex vs reference: all 8 heads, outside tolerance" in flex["parts"]
    capture = found[expected["wrong_capture"]]
    # The engine's output is off: the reference and the emulated FLASHINFER_TS (its own backend) both say so.
    assert sorted(capture["parts"]) == ["captured vs reference: all 8 heads, outside tolerance",
                                        "flashinfer_ts vs captured: all 8 heads, outside tolerance"]
    poisoned = found[expected["poisoned_page"]]
    assert "error finding nonfinite_kv" in poisoned["parts"] and "NaN/Inf expected" in poisoned["key"]
    corrupt = found[expected["corrupt"]]
    assert corrupt["kind"] == "bad input" and corrupt["key"].startswith("bad input: truncated file: tensor")
    assert data["triage"]["passed"] == 3 and data["triage"]["total"] == 11
    # Failures first, the biggest group first; each example is one of its files, replayed with the run's options.
    assert [g["kind"] for g in groups] == ["fail", "fail", "fail", "bad input"] and groups[0]["count"] == 3
    for g in groups:
        assert g["example"]["path"] in g["paths"]
        assert g["example"]["command"] == f"kvdbg replay {g['example']['path']}"
    assert list(data)[-1] == "verdict" and data["verdict"]["exit_code"] == 2


def test_group_example_replays_to_the_same_verdict(mixed_run):
    data = json.loads(mixed_run[0].stdout)
    flex = data["triage"]["groups"][0]
    args = flex["example"]["command"].split()[1:]
    single = invoke(*args, "--json")
    assert single.exit_code == 1
    assert json.loads(single.stdout)["verdict"]["summary"] == next(
        f["summary"] for f in data["files"] if f["path"] == flex["example"]["path"])


def test_summary_reads_at_80_columns_without_colour(mixed, tmp_path):
    directory, _ = mixed
    some = tmp_path / "some"
    some.mkdir()
    for name in ("corrupt_7.safetensors", "flex_null_page_0.safetensors", "pass_8.safetensors"):
        shutil.copy(os.path.join(directory, name), some / name)
    res = invoke("replay", some, env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert res.exit_code == 2
    text = res.stdout
    assert "\x1b[" not in text
    lines = text.splitlines()
    assert not wider_than(lines)  # a command too wide breaks between words; a longer path stands alone
    assert "By cause: 3 row(s): 1 pass; 1 fail, 1 cause; 1 bad input, 1 cause" in text
    assert "1. fail × 1: flex vs captured: all 8 heads, outside tolerance; flex vs" in text
    assert f"kvdbg replay {some / 'corrupt_7.safetensors'}" in shown_commands(text)
    assert "Ran on: cpu 3 files;" in text
    assert text.rstrip().endswith("(exit 2)")


def test_triage_text_reads_at_80_columns(mixed_run):
    _, results = mixed_run
    res = invoke("triage", results, env={"COLUMNS": "80", "NO_COLOR": "1"})
    lines = res.stdout.splitlines()
    assert not wider_than(lines)
    assert sum(line.startswith("   $ kvdbg replay ") for line in lines) == 4  # one example per group
    assert len(shown_commands(res.stdout)) == 4
    assert res.stdout.rstrip().endswith("(exit 2)") and "\x1b[" not in res.stdout


def test_triage_reads_the_same_groups_from_the_results_file(mixed_run):
    res, results = mixed_run
    replayed = json.loads(res.stdout)["triage"]
    tri = invoke("triage", results, "--json")
    assert tri.exit_code == 2
    data = json.loads(tri.stdout)
    assert {k: data[k] for k in replayed} == replayed  # headline, total, passed, groups
    assert data["finished"] and data["rows"] == 11 and data["planned"] == 11
    assert list(data)[-1] == "verdict" and data["verdict"]["exit_code"] == 2
    text = invoke("triage", results, env={"COLUMNS": "200", "NO_COLOR": "1"}).stdout
    assert text.splitlines()[0] == f"{results}: 11 row(s) from 1 run(s); the last run finished"
    assert "By cause: 11 row(s): 3 pass; 7 fail, 3 causes; 1 bad input, 1 cause" in text


def test_triage_never_imports_torch(mixed_run):
    _, results = mixed_run
    code = ("import sys\nfrom kvdbg.cli import main\ntry:\n    main(['triage', sys.argv[1], '--json'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, results], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.stderr.strip() == "False" and json.loads(done.stdout)["rows"] == 11


def test_results_file_has_one_strict_json_line_per_file(mixed, mixed_run):
    directory, _ = mixed
    _, results = mixed_run
    with open(results, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) for line in lines]
    assert [r["record"] for r in records] == ["run"] + ["row"] * 11 + ["end"]
    run = records[0]
    assert run["planned"] == 11 and run["options"]["device_kind"] == "cpu" and run["executor"]["workers"] == 2
    row = next(r for r in records[1:-1] if r["path"].endswith("pass_9.safetensors"))
    for name in ("path", "files", "layer", "engine_step", "ranks", "status", "exit_code", "verdict", "worst",
                 "error_findings", "signature", "seconds", "placement", "attempts", "finished"):
        assert name in row, name
    assert row["ranks"] == [1] and row["engine_step"] == 109  # what the capture recorded
    assert row["files"][0]["path"] == os.path.abspath(row["path"]) and row["files"][0]["size"] > 0
    assert row["placement"]["device"] == "cpu" and row["attempts"] == 1 and row["signature"] is None
    assert records[-1]["rows"] == 11 and records[-1]["exit_code"] == 2 and not records[-1]["interrupted"]
    # The same rows as a run in this process writes (no worker).
    sequential = os.path.join(os.path.dirname(results), "sequential.jsonl")
    fleet = run_fleet(find_snapshots([directory]), BatchOptions(), results=sequential)
    assert fleet.executor["workers"] == 1 and fleet.devices[0].workers == 1
    assert verdicts(rows(results)) == verdicts(rows(sequential))


# --------------------------------------------------------------------------- results that outlive the run


def test_existing_results_need_resume_or_force(tmp_path):
    small_directory(str(tmp_path / "d"), 2)
    results = tmp_path / "r.jsonl"
    assert invoke("replay", tmp_path / "d", "--results", results).exit_code == 0
    res = invoke("replay", tmp_path / "d", "--results", results)
    assert res.exit_code == 2
    assert res.output.strip() == (f"Error: --results {results} already exists; --resume continues it, --force "
                                  "starts it over")
    assert invoke("replay", tmp_path / "d", "--results", results, "--force").exit_code == 0
    assert len(rows(str(results))) == 2  # started over
    res = invoke("replay", tmp_path / "d", "--resume")
    assert res.exit_code == 2 and "--resume needs --results FILE" in res.output


def test_resume_keeps_unchanged_rows_and_replays_the_rest(tmp_path):
    directory = tmp_path / "d"
    paths = small_directory(str(directory), 4)
    results = str(tmp_path / "r.jsonl")
    first = run_fleet(paths[:2], BatchOptions(), results=results)
    assert first.replayed == 2
    os.utime(paths[0], ns=(time.time_ns(), time.time_ns() + 10**9))  # captured again: a newer file
    again = run_fleet(paths, BatchOptions(), results=results, resume=True)
    assert again.resumed == 1 and again.replayed == 3
    assert [r.path for r in again.rows] == paths and again.batch.exit_code == 0
    found = read_results(results)
    assert len(found.runs) == 2 and found.superseded == 1 and len(found.rows) == 4 and found.finished
    assert found.runs[1]["resumed"] and found.runs[1]["skipped"] == 1
    # Nothing left: a third run replays nothing and gives the same verdict from the file alone.
    third = run_fleet(paths, BatchOptions(), results=results, resume=True)
    assert third.replayed == 0 and third.resumed == 4 and third.batch.summary == again.batch.summary


def test_resume_refuses_other_options(tmp_path):
    paths = small_directory(str(tmp_path / "d"), 1)
    results = str(tmp_path / "r.jsonl")
    run_fleet(paths, BatchOptions(backends=("flex",)), results=results)
    with pytest.raises(ResultsError, match=r"--resume: .* was written with backends flex, this run has "
                                           r"\(default\); its rows would mix two judgements"):
        run_fleet(paths, BatchOptions(), results=results, resume=True)
    with pytest.raises(ResultsError, match="written with atol"):
        run_fleet(paths, BatchOptions(backends=("flex",), atol=0.1), results=results, resume=True)


def test_a_torn_last_line_is_ignored_then_cut_off(tmp_path):
    paths = small_directory(str(tmp_path / "d"), 3)
    results = str(tmp_path / "r.jsonl")
    run_fleet(paths[:2], BatchOptions(), results=results)
    with open(results, "ab") as fh:
        fh.write(b'{"record":"row","path":"half a li')  # a crash in the middle of a write
    found = read_results(results)
    assert found.torn_tail == len(b'{"record":"row","path":"half a li') and len(found.rows) == 2
    status = invoke("triage", results, env={"COLUMNS": "200"}).stdout.splitlines()[0]
    assert "the last run finished; a last line cut short (33 bytes) is ignored" in status
    run_fleet(paths, BatchOptions(), results=results, resume=True)
    with open(results, encoding="utf-8") as fh:
        assert all(json.loads(line) for line in fh)  # strict JSON on every line again
    assert len(read_results(results).rows) == 3


@pytest.mark.parametrize("content, message", [
    (b"", "empty results file"),
    (b'{"record":"row"}\n', "not a kvdbg results file (line 1 is not a run record)"),
    (b"not json\n", "line 1: not a JSON line"),
])
def test_not_a_results_file_is_one_line(tmp_path, content, message):
    path = tmp_path / "r.jsonl"
    path.write_bytes(content)
    res = invoke("triage", path)
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1


def test_ctrl_c_loses_only_the_files_in_flight_and_resume_finishes(tmp_path):
    """SIGINT to a running `kvdbg replay DIR --jobs 2`: exit 130, every finished row kept; --resume does the rest."""
    directory = tmp_path / "d"
    # Three quick files first (names sort first), then longer ones: the run is surely still going when the third
    # row is in (thirty quick files can all finish within one poll of the results file on a quiet machine).
    paths = small_directory(str(directory), 3)
    paths += [write_cause(str(directory), "pass", 700 + i, name=f"t{i:04d}.safetensors", seq_lens=(12000, 16000))
              for i in range(8)]
    total = len(paths)
    results = str(tmp_path / "r.jsonl")
    # Every backend (not the reference alone): long enough a run to be stopped midway.
    command = [sys.executable, "-m", "kvdbg", "replay", str(directory), "--jobs", "2", "--results", results]
    # SIGINT's default action restored in the child: under a shell's background job (nohup, `cmd &`) it inherits
    # an ignored SIGINT, and Python then never raises KeyboardInterrupt -- a user's Ctrl-C is what is tested.
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for_rows(results, 3, timeout=240, process=process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130 and b"kvdbg: interrupted" in err and b"Traceback" not in err
    found = read_results(results)
    kept = len(found.rows)
    assert 3 <= kept < total and not found.finished and found.last_end["interrupted"]
    res = invoke("replay", directory, "--results", results, "--resume", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["run"]["resumed"] == kept and data["run"]["replayed"] == total - kept
    assert sorted(os.path.basename(r["path"]) for r in rows(results)) == sorted(map(os.path.basename, paths))


# --------------------------------------------------------------------------- a worker killed mid-run


def test_a_killed_worker_s_file_is_replayed_again(tmp_path):
    """#27 on CPU: the worker holding a file is killed; its file goes to a fresh worker, nothing is lost.

    The first worker is killed on its first file: the pool restarts its slot in the same place, and the
    first free worker in order then is the fresh one. (Killed on a later file, the worker holding it is
    either one, and the other may be free first and take the file back: nothing to assert about which.)
    """
    paths = small_directory(str(tmp_path / "d"), 6)
    killed = []

    def kill_the_first(event):
        if isinstance(event, Started) and event.index == 0 and event.attempt == 1:
            os.kill(event.placement.pid, signal.SIGKILL)
            killed.append(event.placement.pid)

    fleet = run_fleet(paths, QUICK, jobs=2, on_event=kill_the_first)
    assert killed and [r.path for r in fleet.rows] == paths
    assert [r.result.status for r in fleet.rows] == [STATUS_PASS] * 6
    other = fleet.rows[1].placement.pid  # the second worker's first file
    assert fleet.rows[0].attempts == 2 and fleet.rows[0].placement.pid not in (killed[0], other)
    assert [(w.index, w.retried, w.how) for w in fleet.lost] == [(0, True, "killed by SIGKILL")]
    # The killed worker finished nothing: the rows name the second worker and the fresh one.
    assert sum(d.files for d in fleet.devices) == 6 and fleet.devices[0].workers == 2


def test_a_file_that_kills_every_worker_is_reported_after_one_retry(tmp_path):
    directory = tmp_path / "d"
    paths = small_directory(str(directory), 3)
    die = write_cause(str(directory), "pass", 50, name="die.safetensors")
    results = str(tmp_path / "r.jsonl")
    fleet = run_fleet([*paths, die], QUICK, jobs=2, replay=dying_replay, results=results)
    row = fleet.rows[-1]
    assert row.result.status == "crashed" and row.attempts == 2
    assert row.result.summary.startswith("the worker process died twice (it was retried once): killed by SIGKILL")
    assert [r.result.status for r in fleet.rows[:3]] == [STATUS_PASS] * 3 and fleet.batch.exit_code == 1
    assert [g.signature.key for g in fleet.triage.groups] == ["worker died: the worker process died twice (it was "
                                                              "retried once): killed by SIGKILL; replay it alone "
                                                              "(`kvdbg replay FILE`) to see why, e.g. under "
                                                              "/usr/bin/time -v for its memory"]
    assert [w.retried for w in fleet.lost] == [True, False]


def test_a_worker_process_killed_from_outside_loses_nothing(tmp_path):
    """The real thing: SIGKILL to one worker process of a running `kvdbg replay DIR --jobs 2`."""
    directory = tmp_path / "d"
    paths = small_directory(str(directory), 10)
    results = str(tmp_path / "r.jsonl")
    command = [sys.executable, "-m", "kvdbg", "replay", str(directory), "--jobs", "2", "--results", results,
               "--backend", "reference", "--json"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # Killed while the run is under way: replaying these files takes a fraction of a second once a worker has
        # imported torch, so waiting for rows would race the run's end; a worker is killed as soon as it exists,
        # holding its first file or about to.
        worker = _children(process.pid)[0]
        os.kill(worker, signal.SIGKILL)
        out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err.decode()
    data = json.loads(out)
    assert [f["status"] for f in data["files"]] == ["pass"] * 10
    assert [w["pid"] for w in data["run"]["workers_lost"]] == [worker]
    assert sorted(os.path.basename(r["path"]) for r in rows(results)) == sorted(map(os.path.basename, paths))


def _children(pid: int) -> list[int]:
    """The worker processes of ``pid``: the spawned interpreters whose parent it is (Linux /proc).

    Polled for a few seconds: a worker that just finished its file may be between files, or being replaced.
    """
    end = time.monotonic() + 10
    while time.monotonic() < end:
        workers = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
                if parent != pid:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if b"spawn_main" in fh.read():  # a spawned worker, not the tracker or a passing subprocess
                        workers.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        if workers:
            return workers
        time.sleep(0.05)
    raise AssertionError("no worker process")


# --------------------------------------------------------------------------- options


def test_ray_options_that_cannot_work_are_one_line_errors(tmp_path, monkeypatch):
    directory = tmp_path / "d"
    small_directory(str(directory), 1)
    # click's optional value takes the next word: a path there is refused, not taken as an address.
    res = invoke("replay", "--ray", directory)
    assert res.exit_code == 2
    assert res.output.strip() == (f"Error: --ray took '{directory}' as the cluster address, but it is a path: put "
                                  f"the snapshots first (kvdbg replay {directory} --ray) or give the address "
                                  f"(--ray auto {directory})")
    res = invoke("replay", directory, "--ray", "--jobs", "2")
    assert res.exit_code == 2 and "--jobs with --ray counts tasks per GPU (--device cuda)" in res.output
    res = invoke("replay", directory, "--ray", "--device", "cuda:1")
    assert res.exit_code == 2 and "names a GPU of this machine; with --ray give --device cuda" in res.output
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    res = invoke("replay", directory, "--ray")
    assert res.exit_code == 2
    assert res.output.strip() == ("Error: --ray needs Ray, which is not installed: pip install 'kvdbg[ray]' (here "
                                  "and on every node of the cluster)")


def test_one_file_with_results_is_a_run_of_one(tmp_path):
    path = small_directory(str(tmp_path / "d"), 1)[0]
    results = tmp_path / "r.jsonl"
    res = invoke("replay", path, "--results", results, "--json")
    assert res.exit_code == 0 and len(json.loads(res.stdout)["files"]) == 1 and len(rows(str(results))) == 1
    res = invoke("replay", path, "--results", tmp_path / "s.jsonl", "--head", "0")
    assert res.exit_code == 2 and "--head applies to one snapshot" in res.output
    res = invoke("replay", "--resume")
    assert res.exit_code == 2 and res.output.strip() == ("Error: --resume needs snapshots to replay: name a "
                                                         "directory or files")


def test_ci_runs_the_ray_stage():
    """The Ray tests are skipped without Ray: the stage that installs it must stay in CI and in the README."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as fh:
        ci = fh.read().splitlines()
    assert "bash tests/fleet_ray/run.sh" in ci
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        assert "\nbash tests/fleet_ray/run.sh\n" in fh.read()
    with open(os.path.join(ROOT, "tests", "fleet_ray", "run.sh"), encoding="utf-8") as fh:
        stage = fh.read()
    assert "pip install -q -e '.[ray]'" in stage and "KVDBG_REQUIRE_RAY=1" in stage and "timeout" in stage


def test_the_progress_bar_shows_count_rate_eta_and_failures():
    import io

    from rich.console import Console

    from kvdbg.replayer.batch import FileResult
    from kvdbg.render.progress import FleetBar
    from kvdbg.fleet.results import Row

    out = io.StringIO()
    bar = FleetBar(Console(file=out, force_terminal=True, width=100, color_system=None))
    bar.begin(4, 2, "2 worker processes: cpu 2")
    for done, status in enumerate(["pass", "fail"], 1):
        bar.row(Row(f"f{done}", [], FileResult(f"f{done}", status, 0)), done, 4)
    bar._bar.refresh()
    bar.note("worker 12 on cpu died (killed by SIGKILL)")
    bar.end()
    text = out.getvalue()
    assert "4 snapshot(s) to replay; 2 kept from the results file: 2 worker processes: cpu 2" in text
    assert "2/4" in text and "ETA" in text and "1 not passing" in text
    assert "worker 12 on cpu died (killed by SIGKILL)" in text
