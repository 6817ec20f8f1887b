"""`kvdbg conform --jobs`: what a worker sends back -- answers that carry tensors, a worker leaving right after
its answer, a mistake that cannot be pickled -- and a closed pool."""

from __future__ import annotations

import os

import pytest

from kvdbg.fleet.conform_pool import PooledRunner, RunnerArgs
from kvdbg.moves.conform.covering import Factor
from kvdbg.moves.conform.matrix import full_row
from kvdbg.moves.conform.run import FAIL, PASS, conform_backend
from tests.conform_fakes import SnapshotRunner

ROW = full_row({"window": "short", "sinks": "on"})


def _pool(runner, jobs=1):
    return PooledRunner(RunnerArgs("FAKE_ATTN", "cpu", runner=f"tests.conform_fakes:{runner}"), jobs)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_failing_cells_snapshot_is_copied_back_not_held_open_in_shared_memory(tmp_path, monkeypatch):
    """Each tensor a worker sends must come back as a copy: shared through file descriptors, every failing outcome
    the driver keeps holds one open per tensor, and a long conform runs out of them."""
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    with _pool("SnapshotRunner") as pool:
        pool.run(ROW, "decode")  # the pool's own descriptors, once
        before = _open_fds()
        outcomes = [o for _, o in pool.run_many([({**ROW, "mask": m}, k, False)
                                                for m in ("causal", "dense") for k in ("decode", "prefill", "mixed")])]
        assert all(o.status == FAIL and o.snapshot is not None for o in outcomes)
        assert _open_fds() - before < 3


def test_a_cell_that_breaks_the_context_keeps_its_answer_and_its_snapshot(tmp_path, monkeypatch):
    """The worker answers, then leaves (its context is broken): its answer is the cell's, never a retry."""
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    with _pool("BrokenContextRunner") as pool:
        for attempt in range(3):
            outcome = pool.run({**ROW, "gqa": "14"[attempt % 2], "mask": ("causal", "dense", "causal")[attempt]}, "decode")
            assert outcome.status == FAIL, outcome.reason
            assert outcome.snapshot is not None
            assert "the CUDA context was lost after this cell" in (outcome.reason or "")
        assert pool.run(full_row({"window": "short"}), "decode").status == PASS  # a fresh worker took its place


def test_out_dir_gets_the_snapshots_of_cells_run_in_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    factors = [Factor("window", ("none", "short")), Factor("sinks", ("off", "on"))]
    serial = conform_backend(SnapshotRunner(), factors, kinds=("decode",), out_dir=str(tmp_path / "one"))
    with _pool("SnapshotRunner", 2) as pool:
        pooled = conform_backend(pool, factors, kinds=("decode",), out_dir=str(tmp_path / "pool"))
    names = lambda d: sorted(os.listdir(d))  # noqa: E731
    assert names(tmp_path / "pool") == names(tmp_path / "one") and names(tmp_path / "one")
    assert [c.snapshot_path is not None for c in pooled.cells] == [c.snapshot_path is not None for c in serial.cells]


def test_a_mistake_that_cannot_be_pickled_is_still_raised_not_called_a_death(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    with _pool("UnpicklableErrorRunner") as pool:
        with pytest.raises(Exception, match="a mistake of kvdbg's own, holding a lock") as raised:
            print(pool.run(ROW, "decode"))
    assert "holding a lock" in str(raised.value)



def test_a_closed_pool_refuses_work_instead_of_waiting_forever(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    pool = _pool("FakeRunner")
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(ROW, "decode")


def _exact_pool(runner):
    return PooledRunner(RunnerArgs("FAKE_ATTN", "cpu", runner=f"tests.conform_fakes:{runner}"), 2,
                        exact_workers=True)


def test_an_ieee_worker_that_cannot_start_does_not_throw_away_the_backends_cells(tmp_path, monkeypatch):
    """Every cell passes, so no float32 re-run is needed: the optional IEEE worker dying as it starts must not
    turn the backend into 'could not start'; a re-run that needed it is explained as unknown, saying why."""
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    with _exact_pool("NoIeeeRunner") as pool:
        result = conform_backend(pool, [Factor("gqa", ("1", "4"))], kinds=("decode", "prefill"))
        assert [c.status for c in result.cells] == [PASS] * 4
        failing = conform_backend(pool, [Factor("window", ("none", "short")), Factor("sinks", ("off", "on"))],
                                  kinds=("decode",))
    [cell] = [c for c in failing.cells if c.status == FAIL]
    assert cell.cause == "unknown" and "IEEE" in cell.cause_detail
