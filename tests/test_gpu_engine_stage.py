"""The GPU engine stage's own logic, on a CPU: what it runs, in what order, within what time, and how the sentinel
runs are judged (tests/gpu/engine_stage.py, tests/gpu/engine_sentinel.py; the engines themselves need a GPU)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.engine import sentinel_case
from tests.gpu import engine_sentinel, engine_stage


def _plan(argv):
    args = engine_stage.parse_args(["out", *argv])
    return [run.one for run in engine_stage.plan(args.parts, args.models, args.modes, args.sentinel_runs)]


def test_the_default_is_the_capture_part_with_the_soft_capped_model_under_graphs_only():
    assert _plan([]) == ["plain:eager", "plain:FULL_DECODE_ONLY", "sliding:eager", "sliding:FULL_DECODE_ONLY",
                         "softcap:FULL_DECODE_ONLY"]
    assert _plan(["--parts", "sentinel"]) == ["sentinel:faults", "sentinel:clean", "sentinel:clean_graphs"]
    assert _plan(["--parts", "capture,sentinel", "--models", "softcap", "--sentinel-runs", "clean_graphs"]) == [
        "softcap:FULL_DECODE_ONLY", "sentinel:clean_graphs"]
    assert _plan(["--models", "softcap,plain", "--modes", "eager"]) == ["softcap:eager", "plain:eager"]


@pytest.mark.parametrize("argv, message", [
    (["--parts", "capture,graphs"], "--parts: unknown ['graphs']"),
    (["--models", "gemma"], "--models: unknown ['gemma']"),
    (["--modes", "PIECEWISE"], "--modes: unknown ['PIECEWISE']"),
    (["--sentinel-runs", ""], "--sentinel-runs: unknown ''"),
    (["--parts", "sentinel", "--without-kvdbg"], "leave out --parts sentinel"),
    (["--backend", "FLASH_ATTN"], "--backend: unknown 'FLASH_ATTN' .known: TRITON_ATTN, FLASHINFER."),
    (["--backend", "FLASHINFER", "--parts", "capture,sentinel"], "the sentinel part's faults are TRITON_ATTN's"),
])
def test_an_unknown_name_is_refused_naming_the_known_ones(argv, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine_stage.parse_args(["out", *argv])


def test_each_model_gets_the_window_case_only_when_it_has_a_window():
    assert engine_stage.cases_of("sliding") == list(engine_stage.CASES)
    assert engine_stage.cases_of("softcap") == engine_stage.cases_of("plain") == [
        "prefill_decode", "chunked_mixed", "prefix_hit"]


# --------------------------------------------------------------------------- the stage's loop, with fake engines


def _fake_engines(monkeypatch, events, seconds=0.0):
    """Engines that print their record after ``seconds``; launches and judgements are noted in ``events``."""
    import subprocess

    def launch(self, run):
        events.append(f"launch {run.one}")
        record = json.dumps({"problems": [], "cases": {}})
        code = f"import time; time.sleep({seconds}); print({engine_stage.RECORD + record!r})"
        with open(f"{self.logs}/{run.name}.out", "w") as out, open(f"{self.logs}/{run.name}.err", "w") as err:
            return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, start_new_session=True)

    def judge(self, run, record, text):
        events.append(f"judge {run.one}")
        assert engine_stage.RECORD in text and record["run"] == run.one

    monkeypatch.setattr(engine_stage.Stage, "launch", launch)
    monkeypatch.setattr(engine_stage.Stage, "judge", judge)


def test_each_engine_is_judged_while_the_next_one_serves(tmp_path, monkeypatch, capsys):
    events = []
    _fake_engines(monkeypatch, events)
    args = engine_stage.parse_args([str(tmp_path), "--models", "plain", "--without-kvdbg"])
    assert engine_stage.Stage(args).run(engine_stage.plan(args.parts, args.models, args.modes, [])) == 0
    assert events == ["launch plain:eager", "launch plain:FULL_DECODE_ONLY", "judge plain:eager",
                      "judge plain:FULL_DECODE_ONLY"]
    assert json.loads(capsys.readouterr().out)["passed_all"]


def test_the_faults_replays_are_not_judged_while_an_engine_starts(tmp_path, monkeypatch, capsys):
    events = []
    _fake_engines(monkeypatch, events)
    args = engine_stage.parse_args([str(tmp_path), "--parts", "sentinel", "--sentinel-runs",
                                    "clean,faults,clean_graphs"])
    assert engine_stage.Stage(args).run(engine_stage.plan(args.parts, args.models, args.modes,
                                                          args.sentinel_runs)) == 0
    assert events == ["launch sentinel:clean", "launch sentinel:faults", "judge sentinel:clean",
                      "judge sentinel:faults", "launch sentinel:clean_graphs", "judge sentinel:clean_graphs"]


def test_an_engine_that_would_not_finish_within_the_budget_is_not_started_and_fails_the_stage(tmp_path, monkeypatch,
                                                                                             capsys):
    events = []
    _fake_engines(monkeypatch, events)
    monkeypatch.setattr(engine_stage, "RUN_ESTIMATE_S", 5)
    args = engine_stage.parse_args([str(tmp_path), "--models", "plain", "--without-kvdbg", "--budget", "4"])
    assert engine_stage.Stage(args).run(engine_stage.plan(args.parts, args.models, args.modes, [])) == 1
    assert events == []
    summary = json.loads(capsys.readouterr().out)
    assert summary["not_run"] == ["plain:eager", "plain:FULL_DECODE_ONLY"]
    assert summary["problems"] == ["not run within the 4 s budget: plain:eager, plain:FULL_DECODE_ONLY (run them "
                                   "with --parts/--models)"]


def test_an_engine_past_its_time_is_stopped_and_named(tmp_path, monkeypatch, capsys):
    _fake_engines(monkeypatch, [], seconds=60)

    def judge(self, run, record, text):
        self.summary["problems"] += [f"{run.one}: {p}" for p in record["problems"]]

    monkeypatch.setattr(engine_stage.Stage, "judge", judge)
    args = engine_stage.parse_args([str(tmp_path), "--models", "plain", "--modes", "eager", "--without-kvdbg",
                                    "--timeout", "1"])
    assert engine_stage.Stage(args).run(engine_stage.plan(args.parts, args.models, args.modes, [])) == 1
    (problem,) = json.loads(capsys.readouterr().out)["problems"]
    assert problem.startswith("plain:eager: engine run stopped after 1 s (its time or the stage's budget ran out)")


def test_the_engines_get_the_environment_the_stage_started_with(tmp_path, monkeypatch):
    """A replay in the stage's process imports vLLM's backends, which set VLLM_CONFIGURE_LOGGING=0 there; an engine
    started after it must still say the plugin's lines (the sentinel's exit line is one)."""
    child = tmp_path / "child.py"
    child.write_text("import json, os\n"
                     f"print({engine_stage.RECORD!r} + json.dumps({{'problems': [], 'logging': "
                     "os.environ.get('VLLM_CONFIGURE_LOGGING')}))\n")
    monkeypatch.setattr(engine_stage, "__file__", str(child))
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")
    stage = engine_stage.Stage(engine_stage.parse_args([str(tmp_path / "out")]))
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")  # what the vllm column does to this process
    run = engine_stage.Run("sentinel", "sentinel:clean")
    record, _ = stage.wait(run, stage.launch(run), time.monotonic())
    assert record["logging"] == "1" and record["problems"] == []


def test_the_backend_reaches_the_engines_through_their_environment(tmp_path, monkeypatch):
    child = tmp_path / "child.py"
    child.write_text("import json, os, sys\n"
                     f"sys.path.insert(0, {engine_stage.ROOT!r})\n"
                     "from tests.gpu.engine_stage import backend\n"
                     f"print({engine_stage.RECORD!r} + json.dumps({{'problems': [], 'backend': backend()}}))\n")
    monkeypatch.setattr(engine_stage, "__file__", str(child))
    monkeypatch.delenv(engine_stage.BACKEND_ENV, raising=False)
    assert engine_stage.backend() == "TRITON_ATTN"
    stage = engine_stage.Stage(engine_stage.parse_args([str(tmp_path / "out"), "--backend", "FLASHINFER"]))
    run = engine_stage.Run("capture", "plain:eager")
    record, _ = stage.wait(run, stage.launch(run), time.monotonic())
    assert record["backend"] == "FLASHINFER" and stage.summary["backend"] == "FLASHINFER"


def test_a_planted_wrong_output_must_fail_where_it_was_planted(tmp_path, monkeypatch):
    """The stage's planted fault, on a CPU: a correct snapshot with +0.5 on one request and head fails exactly
    there; a replay that named other heads too (here: a reference made to differ everywhere) is a problem."""
    from kvdbg import api
    from kvdbg.moves.synth import SynthSpec, synth_snapshot
    from kvdbg.snapshot.store import save_snapshot

    spec = SynthSpec(seq_lens=(40, 9, 70), query_lens=(1, 1, 5), num_heads=4, num_kv_heads=2, head_size=32,
                     page_size=16, seed=3, engine_output="reference")
    snap = synth_snapshot(spec)
    path = save_snapshot(snap, str(tmp_path / "good.safetensors"))
    assert api.replay(path, ["reference"]).verdict.exit_code == 0
    assert engine_stage.planted_fault(path, device="cpu") == []
    bad = synth_snapshot(spec)
    bad.steps[0].output = bad.steps[0].output + 1.0  # wrong everywhere already
    problems = engine_stage.planted_fault(save_snapshot(bad, str(tmp_path / "bad.safetensors")), device="cpu")
    assert problems and "replay named" in problems[0]


# --------------------------------------------------------------------------- the sentinel runs' judgement

EXIT = "WARNING [kvdbg] kvdbg sentinel in pid 7: checked {checked} step(s) ({pairs} (request, head) pairs), 0 wrong, " \
       "0 captured"


def _clean(run, tmp_path, checked=44, steps=44, handed=30, without=0, errors=0):
    record = {"run": f"sentinel:{run}", "problems": [], "dir": str(tmp_path / run), "steps": steps,
              "generated": [sentinel_case.TOKENS] * sentinel_case.PROMPTS,
              "counts": {"checked": checked, "pairs": 8 * checked, "errors": errors},
              "graph_steps": {"handed": handed, "without_metadata": without}}
    return run, record, "generated [16, 16, 16, 16]\n" + EXIT.format(checked=checked, pairs=8 * checked) + "\n"


def test_a_clean_graph_run_passes_when_every_counted_step_was_checked_and_graph_steps_were_handed_over(tmp_path):
    problems, line = engine_sentinel.judge(*_clean("clean_graphs", tmp_path))
    assert problems == []
    assert line.endswith("0 captured; 30 of the 44 steps from CUDA graphs; 0 snapshot(s)")


@pytest.mark.parametrize("run, changes, expected", [
    ("clean_graphs", dict(handed=0), "sentinel clean_graphs: no step replayed from a CUDA graph was handed to the "
                                     "sentinel"),
    ("clean_graphs", dict(checked=14), "sentinel clean_graphs: the sentinel checked 14 of the 44 steps the plugin "
                                       "counted (every step, at KVDBG_SENTINEL=1)"),
    ("clean_graphs", dict(without=2), "sentinel clean_graphs: 2 graph step(s) came without the metadata of their "
                                      "build (not checked)"),
    ("clean", dict(handed=3), "sentinel clean: 3 step(s) handed over from CUDA graphs in an eager engine"),
    ("clean", dict(handed=0, errors=1), "sentinel clean: 1 check(s) failed or did not come back (see the warning)"),
])
def test_a_clean_run_fails_naming_what_went_wrong(tmp_path, run, changes, expected):
    problems, _ = engine_sentinel.judge(*_clean(run, tmp_path, **changes))
    assert expected in problems


def test_a_clean_run_that_wrote_a_snapshot_fails(tmp_path):
    run, record, text = _clean("clean", tmp_path, handed=0)
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "model.layers.0.self_attn.attn-step3-rank0-0000.safetensors").write_bytes(b"")
    problems, _ = engine_sentinel.judge(run, record, text)
    assert problems and problems[0].startswith("sentinel clean: expected no snapshot")


def test_a_failed_engine_is_reported_once_by_the_stage_not_again_by_the_judgement(tmp_path):
    record = {"run": "sentinel:faults", "problems": ["engine stopped: boom"], "dir": str(tmp_path)}
    assert engine_sentinel.judge("faults", record, "") == ([], "not judged: the engine run failed")
