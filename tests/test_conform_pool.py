"""`kvdbg conform --jobs N`: cells in worker processes give the cells of one process, and a worker's death or a
mistake of kvdbg's is reported, never lost (kvdbg.fleet.conform_pool)."""

from __future__ import annotations

import pytest

from kvdbg.errors import BackendUnavailable
from kvdbg.fleet.conform_pool import PooledRunner, RunnerArgs, default_jobs
from kvdbg.moves.conform.covering import Factor
from kvdbg.moves.conform.run import FAIL, PASS, conform_backend
from tests.conform_fakes import FakeRunner

FAKE = "tests.conform_fakes:FakeRunner"
FACTORS = [Factor("window", ("none", "short")), Factor("sinks", ("off", "on")), Factor("soft_cap", ("off", "on")),
           Factor("page_size", ("32", "16")), Factor("dtype", ("bfloat16", "float16", "float32"))]


def _pool(jobs=2, backend="FAKE_ATTN"):
    return PooledRunner(RunnerArgs(backend, "cpu", runner=FAKE), jobs)


def _summary(result):
    return [(c.row_id, c.kind, c.status, c.max_abs, c.cause, c.cause_detail, c.minimal, c.probe)
            for c in result.cells]


def test_two_workers_give_the_cells_of_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    serial = conform_backend(FakeRunner(), FACTORS, kinds=("decode", "prefill"))
    with _pool() as pool:
        pooled = conform_backend(pool, FACTORS, kinds=("decode", "prefill"))
        pids = {c.kernel for c in pooled.cells if c.status == PASS}
    assert _summary(pooled) == _summary(serial)
    assert [r for r in pooled.rows] == [r for r in serial.rows]
    assert len(pids) == 2  # both workers ran cells
    causes = {c.cause for c in pooled.cells if c.status == FAIL}
    assert causes == {"semantic", "rounding"}


def test_a_worker_killed_once_is_replaced_and_the_cell_run_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    factors = [Factor("head_size", ("64", "128"))]
    with _pool() as pool:
        result = conform_backend(pool, factors, kinds=("decode", "prefill"))
    assert (tmp_path / "crashed").exists()  # the worker did die on head_size=128 prefill
    assert [c.status for c in result.cells] == [PASS, PASS, PASS, PASS]


def test_a_cell_that_kills_its_worker_twice_is_a_fail_saying_so(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    with _pool() as pool:
        result = conform_backend(pool, [Factor("page_size", ("32", "64"))], kinds=("decode",))
        assert pool.run({**result.rows[0]}, "decode").status == PASS  # the pool still works after
    died = [c for c in result.cells if c.status == FAIL]
    assert len(died) == 1 and died[0].row["page_size"] == "64"
    assert "the worker process died running this cell, twice (killed by SIGKILL)" in died[0].reason
    assert died[0].minimal == died[0].row  # nothing left to drop


def test_a_mistake_of_kvdbgs_in_a_worker_is_raised_in_the_parent(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    with _pool() as pool:
        with pytest.raises(ValueError, match="a mistake of kvdbg's own"):
            list(pool.run_many([({"dtype": "bfloat16", "gqa": "4", "page_size": "32", "head_size": "128",
                                  "kv_cache": "auto", "window": "none", "sinks": "off", "soft_cap": "off"},
                                 "mixed", False)]))


def test_a_backend_the_workers_cannot_build_is_unavailable_in_its_words():
    with pytest.raises(BackendUnavailable, match="NO_ATTN: not in the fake registry"):
        _pool(backend="NO_ATTN")


def test_default_jobs_one_per_two_cores_on_a_gpu_at_most_8_and_one_on_a_cpu():
    assert default_jobs("cuda", 16) == 8 and default_jobs("cuda", 64) == 8 and default_jobs("cuda:1", 6) == 3
    assert default_jobs("cuda", 1) == 1 and default_jobs("cpu", 16) == 1


def test_without_a_terminal_progress_is_one_plain_line_per_cell_with_an_eta():
    import io

    from kvdbg.render.conform import ConformLines

    ticks = iter([0.0, 0.0, 10.0, 20.0, 95.0])
    stream = io.StringIO()
    lines = ConformLines(stream, clock=lambda: next(ticks))
    lines(0, 0, "TRITON_ATTN loading the engine")  # silent: a backend that cannot load ends on one line
    lines(0, 4, "TRITON_ATTN 4 cells")
    lines(1, 4, "TRITON_ATTN window=short (decode): pass")
    lines(4, 4, "TRITON_ATTN done")
    assert stream.getvalue().splitlines() == [
        "conform [0/4 0:00] TRITON_ATTN 4 cells",
        "conform [1/4 0:10 ETA 0:30] TRITON_ATTN window=short (decode): pass",
        "conform [4/4 0:20] TRITON_ATTN done"]


def test_jobs_one_on_a_cpu_runs_in_this_process_and_the_rest_on_a_pool():
    from kvdbg.cli.conform import _runner_maker

    assert _runner_maker("cpu", None, 0, None, None) is None  # a CPU's default: one, here
    assert callable(_runner_maker("cpu", 2, 0, None, None))
    assert callable(_runner_maker("cuda", 1, 0, None, None))  # a GPU's float32 re-runs need a worker of their own


def test_float32_reruns_go_to_workers_started_with_ieee_products(tmp_path, monkeypatch):
    """A float32 cell failing as TF32 products fail: on a pool with IEEE workers its re-run passes (rounding); in
    one process (no such workers) it stays semantic, as it must: nothing there ran it another way."""
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    factors = [Factor("alibi", ("off", "sqrt")), Factor("dtype", ("bfloat16", "float32"))]
    with PooledRunner(RunnerArgs("FAKE_ATTN", "cpu", runner=FAKE), 2, exact_workers=True) as pool:
        assert len(pool._workers) == 3 and sum(w.exact for w in pool._workers) == 1
        pooled = conform_backend(pool, factors, kinds=("decode",))
    serial = conform_backend(FakeRunner(), factors, kinds=("decode",))
    [cell] = [c for c in pooled.cells if c.status == FAIL]
    assert cell.row["alibi"] == "sqrt" and cell.row["dtype"] == "float32"
    assert cell.cause == "rounding" and "IEEE float32 products (TRITON_F32_DEFAULT=ieee)" in cell.cause_detail
    assert "TF32" in cell.cause_detail and cell.minimal["alibi"] == "sqrt"
    [same] = [c for c in serial.cells if c.status == FAIL]
    assert same.cause == "semantic" and same.cause_detail == "fails on the float32 path itself"


def test_kernel_builds_are_counted_apart_from_the_replays_and_shown():
    """FlashInfer's JIT builds (a replay's jit_build_seconds) are summed apart from the replays' time, in the JSON
    and on the closing line of the table."""
    from rich.console import Console

    from kvdbg.render.conform import render_backend

    class Building(FakeRunner):
        def run(self, row, kind, exact=False):
            outcome = super().run(row, kind, exact)
            outcome.seconds = 2.0
            outcome.build_seconds = 1.5 if row["gqa"] == "4" else None  # the first use of a kernel family
            return outcome

    result = conform_backend(Building(), [Factor("gqa", ("1", "4"))], kinds=("decode", "prefill"))
    record = result.to_json()
    assert (record["runs"], record["cell_seconds"], record["jit_build_seconds"], record["jit_built_runs"]) == \
        (4, 8.0, 3.0, 2)
    console = Console(width=80, record=True, color_system=None)
    console.print(render_backend(result))
    assert "2 of them built kernels (JIT), 3 s of their 8 s in replays" in " ".join(console.export_text().split())


def test_an_interrupt_in_the_parent_keeps_the_answered_cells_and_stops_the_workers(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which the command turns into it) while workers run cells: the cells answered so far
    are kept, the result says it stopped, and closing the pool ends its busy workers."""
    monkeypatch.setenv("KVDBG_TEST_MARK_DIR", str(tmp_path))
    factors = [Factor("sinks", ("off", "on")), Factor("soft_cap", ("off", "on")), Factor("dtype", ("bfloat16", "float16"))]
    seen = []

    def progress(done, total, text):
        seen.append(text)
        if "): " in text and sum("): " in t for t in seen) == 3:  # the third answered cell
            raise KeyboardInterrupt

    pool = _pool()
    try:
        result = conform_backend(pool, factors, kinds=("decode",), full=True, progress=progress)
        workers = [w.process for w in pool._workers]
    finally:
        pool.close()
    assert result.interrupted and result.planned == 8
    assert len([c for c in result.cells if not c.probe]) == 3
    assert workers and all(not p.is_alive() for p in workers)
