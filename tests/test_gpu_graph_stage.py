"""The GPU graph stage's logic that runs anywhere (tests/gpu/graph_plan.py, graph_checks.py, graph_stage.py).

The stage itself needs a GPU and vLLM 0.33 (tests/vllm033/test_graph_stage_033.py holds its probes to vLLM's
classes); here: that its workloads make the batches the proof needs, that its comparisons and checks say what
they should on snapshots and records made up for the purpose.
"""

from __future__ import annotations

import inspect
import os
import types

import pytest
import torch

from kvdbg import api
from kvdbg.snapshot.store import save_snapshot
from kvdbg.util.ranges import parse_ranges
from tests.gpu import graph_checks, graph_plan, graph_stage
from tests.helpers import ROOT

FIXTURE = os.path.join(ROOT, "fixtures", "causal_gqa.safetensors")


# --------------------------------------------------------------------------- the workloads


def test_the_comparison_workload_makes_the_batches_the_proof_needs():
    shapes = graph_plan.simulate(graph_plan.COMPARE_PLAN)
    assert graph_plan.coverage_gaps(shapes) == []
    cov = graph_plan.coverage(shapes)
    assert cov["padded_decode_sizes"] == [3, 5, 6, 7] and (5, 8) in cov["mixed_padded"]
    assert all(s.num_tokens <= max(graph_plan.CAPTURE_SIZES) for s in shapes)  # every batch fits a graph
    wanted = graph_plan.wanted_steps("compare")
    assert len(wanted) >= graph_checks.MIN_GRAPH_STEPS
    assert graph_plan.coverage_gaps([shapes[s] for s in wanted]) == []  # the wanted steps alone cover it
    assert any(0 < u < len(shapes) - 1 for u in graph_plan.COMPARE_UNWANTED)  # an unwanted step between wanted
    # The sliding model (window 32, pages of 16): a request outgrows the window by more than a page.
    window = graph_stage.MODELS["sliding"].sliding_window
    assert max(r.seq_len for s in shapes for r in s.rows) > window + graph_stage.BLOCK_SIZE


def test_the_fault_workload_sends_only_decode_batches_through_the_faulty_graph():
    shapes = graph_plan.simulate(graph_plan.FAULT_PLAN)
    faulty = [s for s in shapes if graph_plan.padded(s.num_tokens) == graph_plan.FAULT_GRAPH_SIZE]
    assert faulty and all(s.kind == "decode" for s in faulty)  # a stale length below a prefill's query is NaN
    # Every request of a faulty step is longer than the length vLLM sets while recording (1): all are stale.
    assert all(r.seq_len > 1 for s in faulty for r in s.rows)
    others = {graph_plan.padded(s.num_tokens) for s in shapes} - {graph_plan.FAULT_GRAPH_SIZE}
    assert others == {1, 2, 4, 16}


def test_simulate_models_chunked_prefill_under_the_token_budget():
    plan = (graph_plan.Arrival("X", 20, 2, 0, 1), graph_plan.Arrival("Y", 3, 1, 0, 2))
    shapes = graph_plan.simulate(plan, budget=16)
    assert [[(r.name, r.tokens, r.seq_len, r.decode) for r in s.rows] for s in shapes] == [
        [("X", 16, 16, False)], [("X", 4, 20, False), ("Y", 3, 3, False)], [("X", 1, 21, True)]]


def test_the_wanted_steps_are_written_in_kvdbgs_range_grammar():
    wanted = graph_plan.wanted_steps("compare")
    text = graph_plan.ranges_text(wanted, 7)
    parsed = parse_ranges(text, "KVDBG_CAPTURE_STEPS")
    assert [s for s in range(200) if s in parsed] == [s + 7 for s in wanted]
    assert graph_plan.ranges_text([5, 1, 2, 3]) == "1-3,5" and graph_plan.ranges_text([]) == ""


def test_first_divergence():
    assert graph_plan.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert graph_plan.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert graph_plan.first_divergence([1, 2], [1, 2, 3]) == 2


# --------------------------------------------------------------------------- floats in units in the last place


def test_float_comparison_counts_units_in_the_last_place():
    x = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float16)
    same = graph_plan.compare_floats(x, x.clone())
    assert (same.equal, same.max_ulps) == (4, 0.0)
    up = x.clone()
    up[0] = 1.0 + 2.0 ** -10  # one fp16 step above 1
    one = graph_plan.compare_floats(up, x)
    assert one.equal == 3 and one.max_ulps == pytest.approx(1.0)
    # Near zero, judged at the tensor's scale: a tiny absolute difference is not thousands of units.
    small = torch.tensor([4.0, 1e-5], dtype=torch.float16)
    moved = torch.tensor([4.0, -1e-5], dtype=torch.float16)
    assert graph_plan.compare_floats(moved, small).max_ulps < 4
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float16)
    assert graph_plan.compare_floats(nan, torch.tensor([0.0, 1.0], dtype=torch.float16)).max_ulps == float("inf")


def test_float_comparison_reads_fp8_bytes_as_e4m3():
    values = torch.tensor([1.0, 2.0, -0.5], dtype=torch.float8_e4m3fn)
    nudged = torch.tensor([1.125, 2.0, -0.5], dtype=torch.float8_e4m3fn)  # one e4m3 step above 1
    got = graph_plan.compare_floats(nudged.view(torch.uint8), values.view(torch.uint8))
    assert got.equal == 2 and got.max_ulps == pytest.approx(1.0)


# --------------------------------------------------------------------------- the checks on records and snapshots


def _step(rel, rows, graph=None, forward_calls=0, layer_hooks=0, graph_hooks=0, base=10):
    return {"index": rel, "kvdbg_step": base + rel, "rows": rows,
            "graphs": [] if graph is None else [{"kind": "replay", "num_tokens": graph, "num_reqs": 8,
                                                  "uniform": False, "mode": "FULL"}],
            "forward_calls": forward_calls, "forward_in_replay": 0, "layer_hooks": layer_hooks,
            "graph_hooks": graph_hooks}


def test_no_python_per_layer_while_a_graph_replays():
    record = {"base": 10, "steps": [_step(0, [["A", 1, 5, True]], graph=1, graph_hooks=1),
                                    _step(1, [["A", 1, 6, True]], forward_calls=2, layer_hooks=4)]}
    problems, counts = graph_checks.python_per_layer(record, layers=2)
    assert problems == [] and counts["replayed_steps"] == 1 and counts["eager_steps"] == 1
    record["steps"][0]["forward_calls"] = 2
    record["steps"][0]["graph_hooks"] = 0
    problems, _ = graph_checks.python_per_layer(record, layers=2)
    assert problems == ["step 0 (replayed from the 1-token graph): 2 attention forward(s), 0 per-layer kvdbg hook "
                        "call(s), 0 graph hook call(s) (want 0, 0, 1)"]


def test_exactly_the_wanted_steps_on_disk():
    record = {"base": 10, "layers": ["l0", "l1"], "wanted_rel": [0, 2]}
    index = {(layer, step): "p" for layer in ("l0", "l1") for step in (10, 12)}
    assert graph_checks.files_check(record, index, []) == []
    extra = {**index, ("l0", 11): "p"}
    assert graph_checks.files_check(record, extra, []) == ["1 snapshot(s) of unwanted steps: [('l0', 11)]"]
    del extra[("l1", 12)]
    assert len(graph_checks.files_check(record, extra, ["x.tmp"])) == 3


def test_tokens_and_batches_of_two_engines():
    eager = {"outputs": {"A": [5, 6, 7], "B": [1]}, "base": 0,
             "steps": [_step(0, [["A", 3, 3, False], ["B", 1, 1, False]], base=0)]}
    graph = {"outputs": {"A": [5, 9, 7], "B": [1]}, "base": 4,
             "steps": [_step(0, [["A", 3, 3, False], ["B", 1, 1, False]], graph=4, base=4)]}
    problems, diverged = graph_checks.token_check(eager, graph)
    assert diverged == {"A": 1} and problems == ["request A: tokens differ from generated token 1 on ([6, 7] vs [9, 7])"]
    problems, warnings = graph_checks.schedule_check(eager, graph, "compare")
    assert problems == [] and warnings  # the same batches (not the plan's: a made-up record)
    graph["steps"][0]["rows"][0][1] = 2
    assert graph_checks.schedule_check(eager, graph, "compare")[0]


def test_the_sentinel_line_pattern_reads_the_sentinels_own_line():
    from kvdbg.vllm_plugin import sentinel_hooks

    source = inspect.getsource(sentinel_hooks.SentinelHooks._announce)
    fmt = source.split('logger.warning("', 1)[1].split('",', 1)[0]
    line = fmt % ("model.layers.1.self_attn.attn", 12, "output disagrees with the exact reference", 3, 2,
                  "snapshot /tmp/x.safetensors")
    match = graph_checks.LOG_PATTERN.search(line)
    assert match.groups()[:2] == ("model.layers.1.self_attn.attn", "12") and match.group(4) == "3"


def _fixture_rows(snap, names="abcd", decode=True):
    return [[n, int(b - a), int(s), decode] for n, a, b, s in zip(
        names, snap.steps[0].query_start_loc[:-1], snap.steps[0].query_start_loc[1:], snap.steps[0].seq_lens)]


def test_two_snapshots_of_one_batch_compare_byte_for_byte_and_in_ulps(tmp_path):
    snap = api.load(FIXTURE)
    rows = _fixture_rows(snap)
    same = graph_checks.compare_snapshots(FIXTURE, FIXTURE, rows, rows, {}, {}, from_graph=False)
    assert same["problems"] == [] and all(same["byte_exact"].values()) and same["max_ulps"] == 0.0
    # The graph's snapshot: its output one unit off in one element; another request's length wrong.
    other = api.load(FIXTURE)
    output = other.steps[0].output.clone()
    output.view(torch.int16).view(-1)[5] += 1  # one bf16 step
    other.steps[0].output = output
    other.kv_cache = other.kv_cache.clone()
    path = save_snapshot(other, str(tmp_path / "graph.safetensors"))
    res = graph_checks.compare_snapshots(FIXTURE, path, rows, rows, {}, {}, from_graph=False)
    assert res["problems"] == [] and res["floats"]["output"]["max_ulps"] == pytest.approx(1.0, abs=0.01)
    wrong = [list(r) for r in rows]
    wrong[2][2] += 1  # the scheduler counted another length than kvdbg recorded
    res = graph_checks.compare_snapshots(FIXTURE, path, wrong, wrong, {}, {}, from_graph=False)
    assert any("the scheduler counted" in p for p in res["problems"])
    # A request whose tokens parted between the engines is left out of the float comparison.
    res = graph_checks.compare_snapshots(FIXTURE, path, rows, rows, {"b": 0}, {"b": 1}, from_graph=False)
    assert res["excluded_rows"] == 1


def test_a_fault_snapshot_fails_naming_requests_whose_length_was_stale(tmp_path):
    snap = api.load(FIXTURE)
    rows = _fixture_rows(snap)
    step = {"rows": rows}
    stale = [1, 1, 1, 1, 1, 1, 1, 1]
    ok = graph_checks.fault_verdict(FIXTURE, step, stale, "cpu", expect_fail=False)
    assert ok == {"outcome": "PASS as expected"}
    bad = api.load(FIXTURE)
    output = bad.steps[0].output.clone()
    a, b = bad.steps[0].query_start_loc[1:3].tolist()
    output[a:b] += 1.0
    bad.steps[0].output = output
    bad.kv_cache = bad.kv_cache.clone()
    path = save_snapshot(bad, str(tmp_path / "bad.safetensors"))
    caught = graph_checks.fault_verdict(path, step, stale, "cpu", expect_fail=True)
    assert caught == {"outcome": "FAIL as expected", "named": ["b"]}
    # Not stale (the length vLLM set while recording is the request's own): a failure there is not the fault's.
    assert "not stale" in graph_checks.fault_verdict(path, step, [9, 77, 200, 333], "cpu", True)["problem"]
    assert "another graph" in graph_checks.fault_verdict(path, step, stale, "cpu", False)["problem"]
    cli = graph_checks.cli_replay(path, "cpu")
    assert cli["exit"] == 1 and any("req 1" in row for row in cli["rows"])


# --------------------------------------------------------------------------- the runs


def test_every_run_has_its_engine_arguments():
    for cpu in (False, True):
        for spec in graph_stage.all_specs(cpu).values():
            kwargs = graph_stage.engine_kwargs(spec, "/m", cpu)
            assert kwargs["enable_prefix_caching"] is False and kwargs["async_scheduling"] is False
            assert ("enforce_eager" in kwargs) == (spec.mode == "eager")
            if spec.mode != "eager":
                assert kwargs["compilation_config"]["cudagraph_capture_sizes"] == list(graph_plan.CAPTURE_SIZES)
                assert kwargs["compilation_config"]["mode"] == (3 if spec.compile else 0)
    specs = graph_stage.all_specs()
    assert specs["fp8-graph"].kv_cache_dtype == "fp8" and specs["fault-graph"].fault
    assert graph_stage.request_name("A-1a2b3c4d") == "A" and graph_stage.request_name("A") == "A"


def test_the_summary_prints_one_line_per_part():
    summary = {"passed": False, "engines": [{"name": "x"}], "parts": {"fault": {"a": 1}, "pair:plain": {}},
               "problems": ["p1", "p2"], "warnings": []}
    text = graph_stage.compact(summary)
    import json

    assert json.loads(text) == summary
    assert text.count("\n") == 11


def test_the_dag_runs_each_task_after_its_dependencies():
    order = []

    def task(name):
        return lambda: order.append(name) or {"name": name}

    results = graph_stage.run_dag({"check": (["a", "b"], task("check"), "checks"), "a": ([], task("a"), "engines"),
                                   "b": ([], task("b"), "engines"),
                                   "orphan": (["missing"], task("orphan"), "checks")}, jobs=2)
    assert order.index("check") > max(order.index("a"), order.index("b"))
    assert results["orphan"] == {"problems": ["orphan: not run (its engines did not)"]}


def test_a_check_of_records_of_engines_that_never_ran_is_problems_not_an_error(tmp_path):
    args = types.SimpleNamespace(cpu=True, allow_token_divergence=False, deadline=0, judge_max=1)
    result = graph_checks.check_pair(str(tmp_path), "plain", "plain-eager", "plain-graph", args)
    assert result["problems"] == ["plain-eager: no record: the engine did not run",
                                  "plain-graph: no record: the engine did not run"]
    assert graph_checks.check_fault(str(tmp_path), "fault-graph", args)["problems"]
    assert graph_checks.check_piecewise(str(tmp_path), "piecewise-PIECEWISE", args)["served"] is False


def test_problems_that_differ_only_in_layer_and_step_are_said_once():
    lines = [f"model.layers.{i}.self_attn.attn step {s}: floats differ by up to {s}.5 units" for i in (0, 1)
             for s in (3, 4)] + ["request A: tokens differ"]
    assert graph_checks.collapse(lines) == ["model.layers.0.self_attn.attn step 3: floats differ by up to 3.5 units "
                                            "(and 3 more like it)", "request A: tokens differ"]


def test_the_checker_process_is_given_each_layer_once_and_shares_kvdbgs_buffers_not_each_steps():
    record = {"checks": {"process": 5}, "shares": 6, "layers_given": 4, "shares_by_check": [3, 3, 6, 6, 6]}
    summary, problems = graph_checks.checker_check(record, 4)
    assert problems == [] and summary["checks_that_shared"] == 2  # the first check, and a new program's
    summary, problems = graph_checks.checker_check({**record, "shares_by_check": [5, 7, 9, 11]}, 4)
    assert summary["checks_that_shared"] == 4 and len(problems) == 1
    assert problems[0].startswith("every check sent to the checker process shared storages with it (by check: "
                                  "[5, 2, 2, 2])")
    assert graph_checks.checker_check({**record, "layers_given": 8}, 4)[1] == [
        "the checker process was given 8 layers for 4"]
