"""The sentinel's checker process (kvdbg.sentinel.remote) on a CPU: the same verdicts as a check in the engine's
process, the check's own errors reported and survived, and a child that does not start, dies or hangs said so by
name. CPU tensors travel by value here; the CUDA buffers' sharing is tests/test_sentinel_cuda.py's."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import sys
import types
import weakref

import pytest

from kvdbg.errors import OptionError
from kvdbg.sentinel.checker import CheckResult, PassedCheck, Sentinel, check_layers
from kvdbg.sentinel.config import SentinelConfig
from kvdbg.sentinel.child import behind_the_engine, main
from kvdbg.sentinel.remote import CheckerProcess, CheckerProcessError
from tests.test_sentinel import ALL_PAIRS, D, HQ, LAYER_KINDS, _in_whole_buffers, _one_step_of_layers, _stacked


@pytest.fixture(scope="module")
def checker():
    process = CheckerProcess("cpu")
    yield process
    process.close()


def _verdicts(results) -> list:
    return [(r.layer, r.tolerance, None if r.nonfinite is None else (r.nonfinite.request, r.nonfinite.head),
             [(p.request, p.head, p.passed) for p in r.pairs]) for r in results]


def _check(process, entries, *, pairs, seed, step):
    """One check in the child, waited for: its CheckResults, or its own error raised as RuntimeError."""
    process.submit(entries, pairs=pairs, seed=seed, step=step)
    [(kind, value)] = process.answers(process.check_seconds + 1.0)
    if kind == "error":
        raise RuntimeError(f"in the checker process: {value}")
    return value


@LAYER_KINDS
@pytest.mark.parametrize("stacked", [False, True], ids=["apart", "stacked"])
def test_the_process_finds_what_the_engines_process_finds(checker, kw, stacked):
    entries = _one_step_of_layers(3, **kw)
    entries[1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5  # layer 1: request 1, head 2
    entries[2][1].output.view(-1, HQ, D)[5, 3] = float("nan")  # layer 2: request 2's token, head 3
    entries = _stacked(entries) if stacked else entries
    here = check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(7), step=4)
    there = _check(checker, entries, pairs=ALL_PAIRS, seed=7, step=4)
    assert _verdicts(there) == _verdicts(here)
    assert [type(r) for r in there] == [PassedCheck, CheckResult, CheckResult]  # a wrong layer's comes whole
    assert [(p.request, p.head) for p in there[1].failed_pairs] == [(1, 2)]
    assert (there[2].nonfinite.request, there[2].nonfinite.head) == (2, 3)
    for a, b in zip(here, there):
        for p, q in zip(a.pairs, b.pairs):
            if p.diff is not None:  # the same arithmetic on the same values: a few ulps at most
                assert q.diff.max_abs == pytest.approx(p.diff.max_abs, rel=1e-5, abs=1e-5, nan_ok=True)


def test_a_seed_draws_the_same_pairs_in_the_process_and_here(checker):
    entries = _one_step_of_layers(2)
    for seed in (0, 1, 2**63 + 5):
        here = check_layers(entries, pairs=2, rng=random.Random(seed), step=1)
        there = _check(checker, entries, pairs=2, seed=seed, step=1)
        assert [[(p.request, p.head) for p in r.pairs] for r in there] == \
            [[(p.request, p.head) for p in r.pairs] for r in here]


def test_a_check_that_raises_is_reported_by_name_and_the_process_goes_on(checker):
    entries = _stacked(_one_step_of_layers(3))
    tokens = int(entries[0][1].query_start_loc[-1])
    cut = [(layer, dataclasses.replace(inputs, query=inputs.query[:tokens - 1], output=inputs.output[:tokens - 1]))
           for layer, inputs in entries]
    with pytest.raises(RuntimeError, match=f"^in the checker process: ValueError: layer model.layers.0.self_attn.attn: "
                       f"the step has {tokens} token"):
        _check(checker, cut, pairs=ALL_PAIRS, seed=1, step=1)
    assert checker.alive()
    assert all(r.passed for r in _check(checker, entries, pairs=ALL_PAIRS, seed=1, step=1))


def test_a_child_that_dies_is_said_with_its_exit_code():
    process = CheckerProcess("cpu")
    process._process.kill()
    process._process.wait()
    with pytest.raises(CheckerProcessError, match=r"checker process \(pid \d+\) (exited with code -9|is gone)"):
        _check(process, _one_step_of_layers(1), pairs=1, seed=0, step=0)
    assert not process.alive()
    process.close(0.0)


def test_a_child_that_cannot_start_or_hangs_is_said_and_ended():
    with pytest.raises(CheckerProcessError, match="exited with code 3 before it was ready to start"):
        CheckerProcess("cpu", command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(CheckerProcessError, match="took over 1 s to start; it was ended"):
        CheckerProcess("cpu", start_seconds=1.0, command=[sys.executable, "-c", "import time; time.sleep(30)"])


def test_a_check_not_answered_in_time_ends_the_process():
    process = CheckerProcess("cpu", check_seconds=1.0)
    # The child stopped (not killed): it holds its socket open and answers nothing.
    import os
    import signal

    os.kill(process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(CheckerProcessError, match="took over 1 s to answer a check; it was ended"):
            _check(process, _one_step_of_layers(1), pairs=1, seed=0, step=0)
    finally:
        process.close(5.0)
    assert not process.alive()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's scheduling policies")
def test_the_child_and_every_thread_it_started_are_scheduled_as_batch_work(checker):
    # Woken by a check, a thread of the default policy may take the core of the engine's thread that sent it
    # (bench/sentinel_send.py --load); a batch one does not.
    if os.sched_getscheduler(0) != os.SCHED_OTHER:  # the child starts under this process's policy, and keeps some
        pytest.skip("this test process does not run under the default scheduling policy")
    assert checker.info["scheduling"] == "batch"
    _check(checker, _one_step_of_layers(1), pairs=1, seed=0, step=0)  # its reader started and busy by now
    threads = os.listdir(f"/proc/{checker.pid}/task")
    assert len(threads) >= 2  # its main thread and its socket's reader at least
    assert {os.sched_getscheduler(int(tid)) for tid in threads} == {os.SCHED_BATCH}


def test_the_childs_scheduling_is_said_as_it_is_when_it_cannot_or_need_not_be_batch(monkeypatch):
    """Never called for real here: it would make this test process batch work. The system's calls stand in."""
    policy = {"now": 0}
    for name, value in (("SCHED_OTHER", 0), ("SCHED_BATCH", 3), ("SCHED_IDLE", 5), ("SCHED_FIFO", 1)):
        monkeypatch.setattr(os, name, value, raising=False)
    monkeypatch.setattr(os, "sched_param", lambda priority: priority, raising=False)
    monkeypatch.setattr(os, "sched_getscheduler", lambda pid: policy["now"], raising=False)

    def refused(pid, new, param):
        raise PermissionError(1, "Operation not permitted")

    def granted(pid, new, param):
        policy["now"] = new

    monkeypatch.setattr(os, "sched_setscheduler", refused, raising=False)
    assert behind_the_engine() == "default (SCHED_BATCH refused: Operation not permitted)"
    policy["now"] = 1
    assert behind_the_engine() == "fifo (SCHED_BATCH refused: Operation not permitted)"
    # An engine run as idle or batch work: its policy already takes no core on waking, and is kept (batch would
    # outrank an idle engine).
    monkeypatch.setattr(os, "sched_setscheduler", granted, raising=False)
    policy["now"] = 5
    assert behind_the_engine() == "idle (the engine's, kept)" and policy["now"] == 5
    policy["now"] = 3
    assert behind_the_engine() == "batch (the engine's, kept)"
    policy["now"] = 0
    assert behind_the_engine() == "batch" and policy["now"] == 3

    def unreadable(pid):
        raise OSError(38, "Function not implemented")

    policy["now"] = 7
    assert behind_the_engine() == "batch" and policy["now"] == 3  # a policy it has no name for: said by number
    monkeypatch.setattr(os, "sched_setscheduler", refused)
    policy["now"] = 7
    assert behind_the_engine() == "policy 7 (SCHED_BATCH refused: Operation not permitted)"
    monkeypatch.setattr(os, "sched_getscheduler", unreadable)
    assert behind_the_engine() == "unknown (its policy could not be read: Function not implemented)"
    monkeypatch.delattr(os, "SCHED_BATCH")
    assert behind_the_engine() == "default (this system has no SCHED_BATCH)"


def test_the_module_run_by_hand_says_how_it_is_started(capsys):
    assert main([]) == 2
    assert "started by kvdbg's sentinel" in capsys.readouterr().err


def test_the_module_refuses_a_reference_place_it_does_not_know(capsys):
    assert main(["3", "cpu", "gpu"]) == 2
    assert "[host|device]" in capsys.readouterr().err


def test_where_the_process_works_out_its_reference_is_read_from_the_environment():
    base = {"KVDBG_SENTINEL": "0.5", "KVDBG_SENTINEL_DIR": "/x"}
    assert SentinelConfig.from_env(base).reference == "host"
    assert SentinelConfig.from_env({**base, "KVDBG_SENTINEL_REFERENCE": " Device "}).reference == "device"
    assert "reference=host" in SentinelConfig.from_env(base).describe(1)
    assert "reference" not in SentinelConfig.from_env({**base, "KVDBG_SENTINEL_PROCESS": "0"}).describe(1)
    with pytest.raises(OptionError, match="KVDBG_SENTINEL_REFERENCE must be host or device"):
        SentinelConfig.from_env({**base, "KVDBG_SENTINEL_REFERENCE": "gpu"})
    with pytest.raises(OptionError, match="reference must be one of host, device"):
        SentinelConfig(directory="/x", reference="cuda")


def test_the_child_works_a_cuda_steps_reference_out_where_it_is_told():
    import torch

    from kvdbg.sentinel.remote import reference_device

    assert reference_device(torch.device("cuda", 0), "host") == torch.device("cpu")
    assert reference_device(torch.device("cuda", 0), "device") is None
    assert reference_device(torch.device("cpu"), "host") is None  # a CPU step's reference is on the host anyway
    with pytest.raises(ValueError, match="reference must be host or device, got 'gpu'"):
        CheckerProcess("cpu", reference="gpu", command=["/nonexistent"])  # refused before anything starts


@pytest.mark.parametrize("reference", ["host", "device"])
def test_a_child_told_where_to_work_out_its_reference_answers_as_any(reference):
    # On a CPU both places are the host; the place reaches the child on its command line, which it accepts.
    process = CheckerProcess("cpu", reference=reference)
    try:
        assert process._process.args[-1] == reference
        entries = _one_step_of_layers(2)
        entries[1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5
        there = _check(process, entries, pairs=ALL_PAIRS, seed=7, step=4)
        here = check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(7), step=4)
        assert _verdicts(there) == _verdicts(here)
        assert [r.passed for r in there] == [True, False]
    finally:
        process.close()


def test_the_process_switch_is_read_from_the_environment():
    base = {"KVDBG_SENTINEL": "0.5", "KVDBG_SENTINEL_DIR": "/x"}
    assert SentinelConfig.from_env(base).process
    assert not SentinelConfig.from_env({**base, "KVDBG_SENTINEL_PROCESS": "0"}).process
    assert SentinelConfig.from_env({**base, "KVDBG_SENTINEL_PROCESS": "on"}).process
    assert "process=off" in SentinelConfig.from_env({**base, "KVDBG_SENTINEL_PROCESS": "off"}).describe(1)
    with pytest.raises(OptionError, match="KVDBG_SENTINEL_PROCESS must be on or off"):
        SentinelConfig.from_env({**base, "KVDBG_SENTINEL_PROCESS": "maybe"})


def test_host_tensors_travel_as_their_bytes_once_each_and_come_back_equal():
    import io
    import pickle
    import types

    import torch

    from kvdbg.sentinel.remote import _Pickler

    table = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    values = [table, table[:, ::2], torch.tensor(3.5, dtype=torch.bfloat16), torch.empty(0, 5),
              torch.tensor([True, False]), torch.randn(3, 4).to(torch.float8_e4m3fn),
              torch.randn(2, 3, requires_grad=True), torch.arange(6, dtype=torch.int64).reshape(2, 3).t()]
    payload = io.BytesIO()
    _Pickler(payload, types.SimpleNamespace(_torch=torch), []).dump({"a": values, "again": table})
    assert payload.getvalue().count(table.numpy().tobytes()) == 1  # the table's bytes once, though named twice
    back = pickle.loads(payload.getvalue())
    assert back["again"] is back["a"][0]  # one tensor, as the check's grouping by identity needs
    for sent, got in zip(values, back["a"]):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8),
                           sent.detach().contiguous().reshape(-1).view(torch.uint8))


def test_the_childs_loader_makes_views_of_the_storages_it_holds_one_per_tensor():
    # A CUDA tensor travels as (storage key, offset, shape, stride, dtype); the child's loader makes it a view of
    # the storage it opened, under whatever name its module runs (python -m runs it as __main__).
    import io
    import pickle
    import types

    import torch

    from kvdbg.sentinel.remote import _Loader, _Pickler

    pages = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    layer = pages[1].t()  # a strided view into the middle of the storage

    class Owner:
        _torch = torch

        def reference(self, tensor, first):
            return (7, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype)[6:])

    class AsIfOnTheDevice(_Pickler):
        def reducer_override(self, obj):
            if obj is pages or obj is layer:  # these two as a CUDA tensor would go
                from kvdbg.sentinel.remote import _from_storage
                return _from_storage, self._owner.reference(obj, self._first)
            return super().reducer_override(obj)

    payload = io.BytesIO()
    AsIfOnTheDevice(payload, Owner(), []).dump((pages, layer, layer))
    shared = torch.zeros(24).untyped_storage()
    shared.copy_(pages.untyped_storage())
    got_pages, got_layer, again = _Loader(payload.getvalue(), {7: shared}, {}, torch.device("cpu")).load()
    assert torch.equal(got_pages, pages) and torch.equal(got_layer, layer) and again is got_layer
    assert got_layer.untyped_storage().data_ptr() == shared.data_ptr()  # a view, nothing copied
    with pytest.raises(pickle.UnpicklingError, match="storage 7 was never shared"):
        _Loader(payload.getvalue(), {}, {}, torch.device("cpu")).load()
    with pytest.raises(pickle.UnpicklingError, match="only by the checker process's loader"):
        pickle.loads(payload.getvalue())


def test_checks_submitted_without_waiting_are_answered_in_order_and_read_when_asked(checker):
    # The engine's thread sends a staged step's check and goes on; each later hook reads whatever answers came back
    # (nothing blocks), oldest first.
    steps = [_one_step_of_layers(2), _one_step_of_layers(3)]
    steps[1][2][1].output.view(-1, HQ, D)[5, 1] += 0.5  # the second step's layer 2: request 2's token, head 1
    assert checker.answers() == [] and checker.outstanding == 0
    for step, entries in enumerate(steps):
        checker.submit(entries, pairs=ALL_PAIRS, seed=step, step=step)
    assert checker.outstanding == 2
    got = checker.answers(30.0)
    assert [kind for kind, _ in got] == ["ok", "ok"] and checker.outstanding == 0
    for (kind, there), entries, seed in zip(got, steps, (0, 1)):
        here = check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(seed), step=seed)
        assert _verdicts(there) == _verdicts(here)
    assert [r.passed for r in got[1][1]] == [True, True, False]
    # A check that raises is answered as an error, in its place.
    cut = [(layer, dataclasses.replace(inputs, query=inputs.query[:1], output=inputs.output[:1]))
           for layer, inputs in _stacked(_one_step_of_layers(2))]
    checker.submit(cut, pairs=1, seed=0, step=0)
    checker.submit(steps[0], pairs=1, seed=0, step=0)
    got = checker.answers(30.0)
    assert [kind for kind, _ in got] == ["error", "ok"] and got[0][1].startswith("ValueError: layer ")


def test_a_submitted_check_whose_child_dies_or_hangs_is_said_by_answers():
    import os
    import signal

    process = CheckerProcess("cpu", check_seconds=1.0)
    os.kill(process.pid, signal.SIGSTOP)  # stopped: its socket open, nothing answered
    try:
        process.submit(_one_step_of_layers(1), pairs=1, seed=0, step=0)
        assert process.answers() == []  # not yet late: nothing, at once
        with pytest.raises(CheckerProcessError, match="took over 1 s to answer a check; it was ended"):
            process.answers(5.0)
    finally:
        process.close(5.0)
    process = CheckerProcess("cpu")
    os.kill(process.pid, signal.SIGSTOP)  # never answering before it dies (a quick check could, between two lines)
    process.submit(_one_step_of_layers(1), pairs=1, seed=0, step=0)
    process._process.kill()
    process._process.wait()
    with pytest.raises(CheckerProcessError, match=r"exited with code -9|closed its end"):
        process.answers(5.0)
    process.close(0.0)


def _deferred(process: bool):
    import torch

    from kvdbg.sentinel.checker import DeferredChecks, Sentinel

    sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0, pairs=len(ALL_PAIRS), seed=3))
    deferred = DeferredChecks(sentinel, torch.device("cpu"), process=process)
    assert deferred.process_ready(60) is process
    return sentinel, deferred


def _collected(deferred, jobs, seconds: float = 30.0):
    import time

    deadline = time.monotonic() + seconds
    while not all(job.done.is_set() for job in jobs) and time.monotonic() < deadline:
        deferred.poll_remote(0.1)  # what the engine's thread does at each hook while checks are out
        time.sleep(0.01)
    assert all(job.done.is_set() for job in jobs)
    return [job.results for job in jobs]


def test_staged_jobs_go_to_the_process_from_the_engines_thread_with_the_threads_pairs_and_verdicts():
    # Handed over, a staged job is sent by the engine's thread itself (no thread of the engine's process takes part)
    # and read back at a later poll; its pairs come from the seed drawn when it was handed over, so the same
    # sentinel seed gives the same pairs and verdicts as checks in the worker thread.
    steps = [_stacked(_one_step_of_layers(3)) for _ in range(3)]
    steps[1][1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5  # step 1, layer 1: request 1, head 2
    results = {}
    for process in (False, True):
        sentinel, deferred = _deferred(process)
        jobs = [deferred.submit_staged(entries, step, None) for step, entries in enumerate(steps)]
        assert deferred.remote_out is process
        results[process] = _collected(deferred, jobs)
        assert sentinel.staged_checks == {("process" if process else "thread"): 3}
        deferred.close()
    for there, here in zip(results[True], results[False]):
        assert _verdicts(there) == _verdicts(here)
    assert [[r.passed for r in step] for step in results[True]] == [[True] * 3, [True, False, True], [True] * 3]


def test_staged_jobs_whose_process_dies_are_checked_in_the_thread_and_said_once(caplog):
    steps = [_stacked(_one_step_of_layers(2)) for _ in range(2)]
    sentinel, deferred = _deferred(True)
    remote = deferred.remote
    remote._process.kill()
    remote._process.wait()
    jobs = [deferred.submit_staged(entries, step, None) for step, entries in enumerate(steps)]
    results = _collected(deferred, jobs)
    assert deferred.remote is None and not deferred.remote_out
    assert all(r.passed for step in results for r in step) and sentinel.staged_checks == {"thread": 2}
    assert caplog.text.count("its checks run in a thread of the engine's process from now on") == 1
    deferred.close()


def test_staged_jobs_the_process_never_answered_are_errors_once_the_sentinel_closes():
    import os
    import signal

    sentinel, deferred = _deferred(True)
    os.kill(deferred.remote.pid, signal.SIGSTOP)
    job = deferred.submit_staged(_stacked(_one_step_of_layers(1)), 0, None)
    deferred.poll_remote()
    assert not job.done.is_set() and deferred.remote_out
    deferred.close(1.0)
    assert job.done.is_set() and "closed before its checker process answered" in str(job.error)


def test_a_staged_job_that_cannot_be_sent_fails_alone_and_the_next_goes(monkeypatch):
    # A job whose inputs would not go to the process (here: its pickling raises) is done with that error, said
    # where it is collected; the process stays, and the next job is checked there.
    from kvdbg.sentinel import remote

    sentinel, deferred = _deferred(True)
    real = remote._Pickler.reducer_override
    broken = [True]

    def reducer_override(self, obj):
        if broken[0]:
            broken[0] = False
            raise TypeError("cannot pickle this")
        return real(self, obj)

    monkeypatch.setattr(remote._Pickler, "reducer_override", reducer_override)
    first = deferred.submit_staged(_stacked(_one_step_of_layers(1)), 0, None)
    second = deferred.submit_staged(_stacked(_one_step_of_layers(1)), 1, None)
    _collected(deferred, [first, second])
    assert isinstance(first.error, TypeError) and second.error is None and deferred.remote is not None
    assert sentinel.staged_checks == {"process": 1}
    deferred.close()


def test_a_check_that_fails_to_pickle_leaves_no_storage_counted_as_the_childs(monkeypatch):
    # A storage is counted as the child's when its share is made; a check whose pickling then fails sends nothing,
    # so that storage must be shared again by the next check that names it (else the child never has it).
    from kvdbg.sentinel import remote

    process = CheckerProcess("cpu")
    try:
        process._shared[1000] = ("kept", 3)  # shared by an earlier check: stays

        def reducer_override(self, obj):
            self._owner._shared[2000] = ("new", 4)  # as reference() does for a storage it shares
            self._first.append(("share", 4, b"handle"))
            self._owner.shares += 1
            raise TypeError("cannot pickle this")

        monkeypatch.setattr(remote._Pickler, "reducer_override", reducer_override)
        with pytest.raises(TypeError):
            process.submit(_one_step_of_layers(1), pairs=1, seed=0, step=0)
        assert process._shared == {1000: ("kept", 3)} and process.outstanding == 0 and process.shares == 0
    finally:
        process.close()


def test_a_passed_layer_is_answered_in_a_compact_form_that_reads_as_its_check_result():
    entries = _one_step_of_layers(2)
    entries[1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5  # layer 1: request 1, head 2
    passed, failed = check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(7), step=4)
    compact = pickle.loads(pickle.dumps(PassedCheck.of(passed), protocol=pickle.HIGHEST_PROTOCOL))
    assert len(pickle.dumps(compact)) < len(pickle.dumps(passed)) / 2
    for name in ("layer", "step", "tolerance", "num_tokens", "nonfinite", "passed", "failed_pairs", "pairs",
                 "pair_count"):
        assert getattr(compact, name) == getattr(passed, name), name
    assert compact.pair_count == len(ALL_PAIRS) and compact.finding() is None
    counts = []
    for result in (passed, compact):
        sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0))
        sentinel.record(result)
        counts.append(dict(sentinel.counts))
    assert counts[0] == counts[1] == {"checked": 1, "pairs": len(ALL_PAIRS)}
    # What it cannot hold travels whole: a failed layer, a non-finite one, a passed pair's kept statistics (its
    # layer's other pairs failed the quick test), anything that is not a CheckResult.
    kept = [p for p in failed.pairs if p.passed and p.diff is not None]
    assert kept
    for whole in (failed, dataclasses.replace(passed, nonfinite=failed.nonfinite or object()),
                  dataclasses.replace(passed, pairs=kept), "checked"):
        assert PassedCheck.of(whole) is None


def _slow_child(seconds: float) -> str:
    """A checker process whose every check takes ``seconds`` (its serve loop is kvdbg's own)."""
    return ("import sys, time\n"
            "from multiprocessing.connection import Connection\n"
            "from kvdbg.sentinel.remote import serve\n"
            "def check_layers(entries, **kwargs):\n"
            f"    time.sleep({seconds})\n"
            "    return ['checked']\n"
            "sys.exit(serve(Connection(int(sys.argv[1])), sys.argv[2], check_layers))\n")


def test_a_checks_time_limit_counts_from_the_answer_it_waited_behind():
    # Three checks sent at once, 0.8 s each in the child, under a 1.5 s limit: the last is answered 2.4 s after it
    # was sent, but 0.8 s after the one before it, so nothing is ended (0.7 s of margin for a slow machine).
    process = CheckerProcess("cpu", check_seconds=1.5, command=[sys.executable, "-c", _slow_child(0.8)])
    try:
        for step in range(3):
            process.submit([], pairs=1, seed=0, step=step)
        assert process.answers(20.0) == [("ok", ["checked"])] * 3 and process.alive()
    finally:
        process.close()


def test_a_hooks_look_asks_the_socket_only_once_an_answer_may_be_there(monkeypatch):
    # Each hook of the engine's thread looks for answers while a check is out (answers(None)): the socket's poll and
    # the child's are two system calls a step. Within half the last check's time in the child (at most TOO_SOON_NS)
    # a look asks nothing; a read with a timeout, even 0, always asks (the sentinel's close reads so what came back).
    import time

    from kvdbg.sentinel import remote

    monkeypatch.setattr(remote, "TOO_SOON_NS", 300_000_000)  # wide, for a loaded machine
    process = CheckerProcess("cpu", command=[sys.executable, "-c", _slow_child(0.8)])
    try:
        asked = []
        real = process._conn.poll
        process._conn.poll = lambda timeout=0.0: asked.append(timeout) or real(timeout)
        process.submit([], pairs=1, seed=0, step=0)
        assert process.answers(None) == [] and len(asked) == 1  # no check answered yet: nothing known, asked
        assert process.answers(20.0) == [("ok", ["checked"])]
        assert process._too_soon == remote.TOO_SOON_NS  # half of 0.8 s, over the bound
        asked.clear()
        process.submit([], pairs=1, seed=0, step=1)
        assert process.answers(None) == [] and asked == []  # too soon: not asked
        assert process.answers(0.0) == [] and len(asked) == 1  # a read asks, however soon
        time.sleep(remote.TOO_SOON_NS / 1e9 + 0.01)
        assert process.answers(None) == [] and len(asked) == 2  # a look asks now; the check still runs
        assert process.answers(20.0) == [("ok", ["checked"])] and process.outstanding == 0
    finally:
        process.close()


def test_a_check_larger_than_the_sockets_buffer_is_sent_while_the_child_checks_another():
    # The child reads messages as they come, also during a check: the engine's thread never waits on a full socket
    # for a check to end. Here each check takes 2 s in the child; the second, 8 MiB of host data, is sent at once.
    import time

    import torch

    process = CheckerProcess("cpu", command=[sys.executable, "-c", _slow_child(2.0)])
    try:
        process.submit(_one_step_of_layers(1), pairs=1, seed=0, step=0)
        time.sleep(0.5)  # the child is in its first check
        began = time.monotonic()
        [(layer, inputs)] = _one_step_of_layers(1)
        big = dataclasses.replace(inputs, query=torch.zeros(1 << 20, dtype=torch.int64))
        process.submit([(layer, big)], pairs=1, seed=1, step=1)
        sent = time.monotonic() - began
        got = process.answers(30.0)
    finally:
        process.close()
    assert got == [("ok", ["checked"]), ("ok", ["checked"])]
    assert sent < 1.0, f"the send waited {sent:.2f} s for the child's check"


def _sending(process) -> list:
    """The kinds of the messages ``process`` sends from now on (each still sent)."""
    kinds, real = [], process._send

    def send(message):
        kinds.append(message[0])
        real(message)

    process._send = send
    return kinds


def test_a_checks_layers_are_given_to_the_child_once_and_named_by_their_key_after():
    # A layer's constants (its engine layout, per-head values) travel with the first check that names it; later
    # checks name it by key, with the same verdicts. Another object is another layer, even with equal constants.
    process = CheckerProcess("cpu")
    try:
        kinds = _sending(process)
        entries = _one_step_of_layers(2, sinks=[0.5, -1.0, 2.0, 0.0])
        entries[1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5  # layer 1: request 1, head 2
        for step in (1, 2):
            process.submit(entries, pairs=ALL_PAIRS, seed=step, step=step)
        got = process.answers(30.0)
        assert kinds == ["define", "define", "check", "check"]
        for (kind, there), seed in zip(got, (1, 2)):
            assert kind == "ok"
            assert _verdicts(there) == _verdicts(check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(seed),
                                                              step=seed))
        assert [r.passed for r in got[1][1]] == [True, False]
        copies = [(dataclasses.replace(layer), inputs) for layer, inputs in entries]
        kinds.clear()
        assert [r.passed for r in _check(process, copies, pairs=ALL_PAIRS, seed=1, step=1)] == [True, False]
        assert kinds == ["define", "define", "check"] and len(process._layers) == 4
    finally:
        process.close()


def test_a_layer_let_go_is_forgotten_by_the_child_when_its_id_comes_back():
    process = CheckerProcess("cpu")
    try:
        layer = _one_step_of_layers(1)[0][0]
        gone = type("Gone", (), {})()
        process._layers[id(layer)] = (weakref.ref(gone), 5)  # an earlier layer at the same address, let go
        del gone
        kinds, first = _sending(process), []
        key = process.layer_key(layer, first)
        assert kinds == ["forget"] and [(m[0], m[1]) for m in first] == [("define", key)] and key != 5
        assert process.layer_key(layer, first) == key and len(first) == 1  # known now: nothing more to send
    finally:
        process.close()


def test_a_check_that_fails_to_pickle_leaves_no_layer_counted_as_given():
    # A layer is counted as given when its definition is made; a check whose pickling then fails sends nothing, so the
    # next check that names the layer must give it again (else the child answers that it never had it).
    from kvdbg.sentinel import remote

    process = CheckerProcess("cpu")
    real = remote._Pickler.reducer_override
    broken = [True]

    def reducer_override(self, obj):
        got = real(self, obj)
        if broken[0] and self._first and getattr(obj, "__class__", None) is not self._layer:
            broken[0] = False  # the layer defined, then the next object fails
            raise TypeError("cannot pickle this")
        return got

    try:
        remote._Pickler.reducer_override = reducer_override
        entries = _one_step_of_layers(1)
        with pytest.raises(TypeError):
            process.submit(entries, pairs=1, seed=0, step=0)
        assert process._layers == {} and process.outstanding == 0 and process.defines == 0
        remote._Pickler.reducer_override = real
        assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0))
        assert process.defines == 1
    finally:
        remote._Pickler.reducer_override = real
        process.close()


def test_the_childs_loader_refuses_a_layer_it_was_never_given():
    import io
    import pickle

    import torch

    from kvdbg.sentinel.remote import _defined, _Loader

    class Named:  # stands for a layer the engine gave as key 9
        pass

    class Naming(pickle.Pickler):
        def reducer_override(self, obj):
            return (_defined, (9,)) if isinstance(obj, Named) else NotImplemented

    payload = io.BytesIO()
    Naming(payload).dump([Named()])
    layer = _one_step_of_layers(1)[0][0]
    assert _Loader(payload.getvalue(), {}, {9: layer}, torch.device("cpu")).load() == [layer]
    with pytest.raises(pickle.UnpicklingError, match="layer 9 was never given to the checker process"):
        _Loader(payload.getvalue(), {}, {}, torch.device("cpu")).load()


class _HostCopies:
    """A HostCopiesReady (kvdbg.capture.buffers) whose copies complete when the test says."""

    def __init__(self):
        import threading

        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(30)


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_a_staged_jobs_metadata_copied_to_the_host_is_read_only_once_its_copies_are_done(process):
    # A staged step's lengths and offsets are the build's host copies, issued on the device: the check reads them
    # only once they are written (the process is sent them then; the thread waits for them).
    import time

    entries = _stacked(_one_step_of_layers(2))
    offsets = entries[0][1].query_start_loc
    real = offsets.clone()
    offsets.zero_()  # not written yet: a check that read it now would see no tokens, and compare nothing
    sentinel, deferred = _deferred(process)
    copies = _HostCopies()
    job = deferred.submit_staged(entries, 0, None, host_ready=[copies])
    time.sleep(0.3)
    deferred.poll_remote()
    assert not job.done.is_set() and (deferred.remote is None or deferred.remote.outstanding == 0)
    offsets.copy_(real)
    copies.done.set()
    [results] = _collected(deferred, [job])
    assert [len(r.pairs) for r in results] == [len(ALL_PAIRS)] * 2 and all(r.passed for r in results)
    deferred.close()


def test_a_layer_the_child_cannot_read_is_named_with_why_by_each_check_of_it():
    process = CheckerProcess("cpu")
    try:
        entries = _one_step_of_layers(1)
        process._send(("define", 0, b"not a pickle"))  # as if the layer's definition did not load there
        process._layers[id(entries[0][0])] = (weakref.ref(entries[0][0]), 0)
        process._next_key = 1
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"layer 0 given to the checker process could not be read there "
                                                   r"\(UnpicklingError: "):
                _check(process, entries, pairs=1, seed=0, step=0)
        assert process.alive()
    finally:
        process.close()


@pytest.fixture
def sharing():
    """A checker process whose templates' host tensors are shared buffers, as a CUDA step's staged buffers are:
    host storages shared through files, which a process that is no multiprocessing child can open (torch's other
    strategy hands descriptors over multiprocessing's own connections)."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    process = CheckerProcess("cpu", share_host=True)
    yield process
    process.close()
    mp.set_sharing_strategy(before)


def _staged_step(count: int = 3, **kw) -> list:
    """A staged step's layers as the engine hands them over: their copies in one stack (the same objects step after
    step), their requests' pages one after another with no block table."""
    entries = _stacked(_one_step_of_layers(count, **kw))
    counts = [-(-n // 8) for n in entries[0][1].seq_lens.tolist()]
    layout = []
    for r, c in enumerate(counts):
        layout += entries[0][1].block_table[r, :c].tolist()
    pages = entries[0][1].stack[0].pages[:, layout]  # each layer's pages in request order
    stack = types.SimpleNamespace(pages=pages, query=entries[0][1].stack[0].query,
                                  output=entries[0][1].stack[0].output)
    return [(layer, dataclasses.replace(inputs, kv_cache=stack.pages[i], stack=(stack, i), block_table=None,
                                        max_pages=counts, seq_lens=inputs.seq_lens.clone()))
            for i, (layer, inputs) in enumerate(entries)]


def test_a_step_staged_inside_the_graph_goes_with_its_rule_for_pages_and_the_child_works_them_out(sharing):
    # A step staged inside vLLM's graph: the engine's thread sends the rule the device counted pages by, not the counts
    # (it never reads them back); the child's verdicts are those of the counts themselves.
    from kvdbg.sentinel.checker import PagesOfLengths

    process = sharing
    entries = _staged_step(3)
    counts = entries[0][1].max_pages
    width = max(counts) + 1
    ruled = [(layer, dataclasses.replace(inputs, max_pages=PagesOfLengths(8, width, sum(counts))))
             for layer, inputs in entries]
    entries[0][1].stack[0].output[1].view(-1, HQ, D)[2, 1] += 0.5
    there = _check(process, ruled, pairs=ALL_PAIRS, seed=1, step=1)
    here = check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(1), step=1)
    assert _verdicts(there) == _verdicts(here) and [r.passed for r in there] == [True, False, True]


def test_a_staged_steps_layers_go_once_as_a_template_and_each_check_carries_its_metadata_alone(sharing):
    # A staging program's buffers are the same objects step after step: their views go to the child once (a
    # template); each check then sends the step's metadata alone, and the child reads the buffers as they are now.
    process = sharing
    kinds = _sending(process)
    entries = _staged_step(3)
    out = entries[0][1].stack[0].output
    right = out[1].clone()
    answers = []
    for step, (row, head) in enumerate([(2, 1), (5, 3)]):  # a wrong head of layer 1, another each step
        out[1].copy_(right)
        out[1].view(-1, HQ, D)[row, head] += 0.5
        # The step's own metadata: new tensors every step (by value), the same buffers' views (the template).
        seq_lens = entries[0][1].seq_lens.clone()
        entries = [(layer, dataclasses.replace(inputs, seq_lens=seq_lens)) for layer, inputs in entries]
        answers.append((_check(process, entries, pairs=ALL_PAIRS, seed=step, step=step), (row, head)))
        here = check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(step), step=step)
        assert _verdicts(answers[-1][0]) == _verdicts(here)
    assert kinds.count("template") == 1 and kinds.index("template") < kinds.index("check")
    assert kinds[kinds.index("check") + 1:] == ["check"]  # the second step: its metadata alone
    assert process.templates == 1 and len(process._templates) == 1
    for results, (row, head) in answers:
        assert [r.passed for r in results] == [True, False, True]
        assert [(p.request, p.head) for p in results[1].failed_pairs] == [(1 if row < 5 else 2, head)]
    # Other layer objects: another template; the first is kept (its objects are alive).
    kinds.clear()
    copies = [(dataclasses.replace(layer), inputs) for layer, inputs in entries]
    assert [r.passed for r in _check(process, copies, pairs=ALL_PAIRS, seed=0, step=0)] == [True, False, True]
    assert kinds.count("template") == 1 and process.templates == 2 and len(process._templates) == 2
    kinds.clear()
    assert [r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0)] == [True, False, True]
    assert kinds == ["check"]


def test_a_template_whose_objects_went_is_forgotten_and_made_again(sharing):
    process = sharing
    kinds = _sending(process)
    entries = _staged_step(2)
    assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0))
    [(ids, (_, key, named))] = list(process._templates.items())
    assert named  # the storages and layers it names
    # Its layers let go and others made at the same ids: the template does not answer for them.
    gone, refs = entries, process._templates[ids][0]
    gone_layer = type("Gone", (), {})()
    dead = weakref.ref(gone_layer)
    del gone_layer
    process._templates[ids] = ([dead] + refs[1:], key, named)
    kinds.clear()
    assert all(r.passed for r in _check(process, gone, pairs=ALL_PAIRS, seed=0, step=0))
    assert kinds[:2] == ["forget", "template"] and process.templates == 2 and len(process._templates) == 1
    # A storage it names forgotten (its address another's): the template too.
    kinds.clear()
    [(_, (_, key, named))] = list(process._templates.items())
    process._forget_named(next(iter(named)))
    assert kinds == ["forget"] and not process._templates


def test_templates_past_their_bound_are_forgotten_least_recently_used_first(monkeypatch, sharing):
    # A template per staging program and number of graph rows: an engine that cycles through its graphs' sizes
    # keeps the ones it uses.
    from kvdbg.sentinel import remote

    monkeypatch.setattr(remote, "TEMPLATES_KEPT", 2)
    process = sharing
    sent, real = [], process._send
    process._send = lambda message: (sent.append(message[:2]), real(message))
    a, b, c = _staged_step(1), _staged_step(1), _staged_step(1)
    keys = {}
    for name, entries in (("a", a), ("b", b), ("a", a), ("c", c), ("a", a)):
        sent.clear()
        assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0))
        made = [key for kind, key in sent if kind == "template"]
        assert bool(made) == (name not in keys), name
        keys.setdefault(name, made[0] if made else None)
        if name == "c":  # past the bound: b, used least recently, goes; a stays
            assert ("forget", keys["b"]) in sent and ("forget", keys["a"]) not in sent
    assert process.templates == 3 and len(process._templates) == 2


def test_a_storage_or_layer_forgotten_takes_the_templates_that_name_it(sharing):
    # The child holds a template's views of the storages it names: when the engine finds one of those storages, or
    # one of its layers, let go and its address or id another's (a "forget"), the templates naming it go too.
    import torch

    process = sharing
    entries = _staged_step(2)
    assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0))
    [(_, key, named)] = list(process._templates.values())
    layer_key = process._layers[id(entries[0][0])][1]
    assert layer_key in named
    # A layer of the same id as one given, that one let go: its key is forgotten, and the template with it.
    gone = type("Gone", (), {})()
    process._layers[id(entries[0][0])] = (weakref.ref(gone), layer_key)
    del gone
    kinds, first = _sending(process), []
    process.layer_key(entries[0][0], first)
    assert kinds == ["forget", "forget"] and not process._templates
    for message in first:  # the layer given again, as a check's send would
        process._send(message)
    # A storage at the address of one shared, that one let go: the same.
    assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=1, step=1))
    [(_, key, named)] = list(process._templates.values())
    pages = entries[0][1].stack[0].pages
    address = pages.untyped_storage().data_ptr()
    storage_key = process._shared[address][1]
    assert storage_key in named
    other = torch.zeros(4)
    process._shared[address] = (type(process._shared[address][0])(other.untyped_storage()), storage_key)
    del other
    kinds.clear()
    process._refs.clear()  # the view's reference worked out again, as for a view not seen before
    process.reference(pages, [])
    assert kinds[:2] == ["forget", "forget"] and not process._templates


def test_the_child_forgets_a_template_it_is_told_to(sharing):
    # Told to forget a template, the child lets its views go: a check that named it after would be answered as
    # one it never had.
    process = sharing
    entries = _staged_step(1)
    assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0))
    [(ids, known)] = list(process._templates.items())
    process._forget_template(ids)
    process._templates[ids] = known  # the engine's side as if it had not
    process.submit(entries, pairs=ALL_PAIRS, seed=0, step=0)
    [(kind, value)] = process.answers(30.0)
    assert kind == "error" and f"template {known[1]} was never given" in value


def test_the_same_buffers_at_another_stack_index_or_length_bound_are_another_template(sharing):
    process = sharing
    entries = _staged_step(2)
    assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0))
    bound = [(layer, dataclasses.replace(inputs, max_model_len=4096)) for layer, inputs in entries]
    assert all(r.passed for r in _check(process, bound, pairs=ALL_PAIRS, seed=0, step=0))
    swapped = [(entries[0][0], dataclasses.replace(entries[0][1], stack=(entries[0][1].stack[0], 1),
                                                   kv_cache=entries[1][1].kv_cache,
                                                   query=entries[1][1].query, output=entries[1][1].output))]
    _check(process, swapped, pairs=ALL_PAIRS, seed=0, step=0)
    assert process.templates == 3


def test_one_programs_buffers_read_to_another_number_of_rows_are_one_template(sharing):
    # vLLM records a graph per batch size, and one staging program serves them all: its buffers are the same objects
    # whatever the rows, so a check of another graph's step sends its rows alone, not another template.
    process = sharing
    kinds = _sending(process)
    entries = _in_whole_buffers(_staged_step(2), extra=6)
    rows = entries[0][1].rows
    for step, cut in enumerate([rows + 3, rows]):
        step_entries = [(layer, dataclasses.replace(inputs, rows=cut)) for layer, inputs in entries]
        there = _check(process, step_entries, pairs=ALL_PAIRS, seed=step, step=step)
        here = check_layers(step_entries, pairs=ALL_PAIRS, rng=random.Random(step), step=step)
        assert _verdicts(there) == _verdicts(here) and all(r.passed for r in there)
    # Each check's own rows: a graph's fewer than the step's tokens is refused there, as here.
    with pytest.raises(RuntimeError, match=r"in the checker process: ValueError: .* its query and output hold"):
        _check(process, [(layer, dataclasses.replace(inputs, rows=rows - 1)) for layer, inputs in entries],
               pairs=ALL_PAIRS, seed=0, step=2)
    assert kinds.count("template") == 1 and process.templates == 1


def test_a_template_is_made_only_of_buffers_the_child_holds(checker, sharing):
    # Host tensors not shared travel by value, their values the step's: no template. Nor with a part missing (a
    # layer with no output copy): its check goes whole, and the child says what is wrong with it.
    assert all(r.passed for r in _check(checker, _staged_step(2), pairs=ALL_PAIRS, seed=0, step=0))
    assert checker.templates == 0 and not checker._templates
    entries = _staged_step(2)
    entries[1] = (entries[1][0], dataclasses.replace(entries[1][1], output=None))
    with pytest.raises(RuntimeError, match="in the checker process: .*the step's output was not given to the check"):
        _check(sharing, entries, pairs=ALL_PAIRS, seed=0, step=0)
    assert sharing.templates == 0 and not sharing._templates


def test_a_check_naming_a_template_the_child_never_had_is_answered_as_an_error(sharing):
    process = sharing
    entries = _staged_step(1)
    real = process._send
    process._send = lambda message: None if message[0] == "template" else real(message)
    process.submit(entries, pairs=ALL_PAIRS, seed=0, step=0)
    [(kind, value)] = process.answers(30.0)
    assert kind == "error" and "was never given to the checker process" in value and process.alive()


def test_a_check_that_fails_to_pickle_after_its_template_was_made_leaves_no_template(sharing, monkeypatch):
    # The template is made first; should the check's own pickling then fail, nothing was sent: the next check must
    # make the template again (else the child answers that it never had it).
    import torch

    from kvdbg.sentinel import remote

    process, real = sharing, remote._Pickler.reducer_override

    def reducer_override(self, obj):
        if not self._shared and isinstance(obj, torch.Tensor):  # the check's metadata, after the template
            raise TypeError("cannot pickle this")
        return real(self, obj)

    entries = _staged_step(2)
    monkeypatch.setattr(remote._Pickler, "reducer_override", reducer_override)
    with pytest.raises(TypeError):
        process.submit(entries, pairs=ALL_PAIRS, seed=0, step=0)
    assert process.templates == 0 and not process._templates and process.outstanding == 0
    monkeypatch.setattr(remote._Pickler, "reducer_override", real)
    kinds = _sending(process)
    assert all(r.passed for r in _check(process, entries, pairs=ALL_PAIRS, seed=0, step=0))
    assert "template" in kinds and process.templates == 1
