"""`kvdbg replay`: exit codes, messages, JSON, unavailable backends, -o (the outputs file)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import kvdbg.backends as backends_pkg
from kvdbg.cli import cli

from tests.helpers import run_python


def invoke(*args):
    return CliRunner().invoke(cli, ["replay", *args], catch_exceptions=False)


def test_clean_snapshot_exits_0_and_shows_what_ran(make_snapshot):
    path, _ = make_snapshot(query_len=2, sliding_window=40)
    res = invoke(path, "--backend", "flex", "--full")
    assert res.exit_code == 0, res.output
    assert "flex_attention (eager)" in res.output
    assert "step 0: flex vs reference — PASS" in res.output
    assert "|a - e| <= atol + rtol·|e|" in res.output
    assert "atol 0.016, rtol 0.016 (default for bfloat16)" in res.output


def test_null_page_exits_1_with_finding_and_failing_heads_first(make_snapshot):
    path, snap = make_snapshot(use_page_zero=True, page_zero_request=2, query_len=2)
    res = invoke(path, "--backend", "flex", "--json")
    assert res.exit_code == 1
    data = json.loads(res.output)
    assert not data["passed"]
    assert [f["code"] for f in data["findings"]] == ["live_page_zero"]
    (comp,) = data["comparisons"]
    assert comp["failed_heads"] == snap.meta.layer.num_heads
    assert {h["request"] for h in comp["heads"] if not h["passed"]} == {2}
    table = invoke(path, "--backend", "flex", "--full").output
    rows = [line for line in table.splitlines() if "│" in line and ("FAIL" in line or " ok " in line)]
    assert "FAIL" in rows[0] and " ok " in rows[-1]
    assert table.rstrip().splitlines()[-1].startswith("FAIL: 1 of 1 comparison(s) failed (flex vs reference)")


def test_unknown_backend_lists_valid_names(make_snapshot):
    path, _ = make_snapshot()
    res = invoke(path, "--backend", "flash")
    assert res.exit_code == 2
    assert res.output.strip() == (
        "Error: --backend: unknown backend 'flash'; did you mean flashinfer_ts? (choose from: reference, flex, "
        "flashinfer_ts, vllm, vllm_flex; engine names FLEX_ATTENTION and FLASHINFER_TS work too)")


def test_cuda_unavailable_is_bad_input(make_snapshot):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    path, _ = make_snapshot()
    res = invoke(path, "--device", "cuda")
    assert res.exit_code == 2
    assert res.output.startswith("Error: --device cuda: ") and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--head", "3-1"], "Invalid value for '--head': range '3-1' ends before it starts"),
    (["--head", "0,,2"], "Invalid value for '--head': '0,,2' has an empty item between commas"),
    (["--request", "4-"], "--request 4 is out of range: the snapshot has 4 requests"),
    (["--step", "0-1"], "--step 1 is out of range: the snapshot has 1 step(s)"),
    (["--head", "8"], "--head 8 is out of range: the layer has 8 heads"),
    (["--heads", "8"], "--head 8 is out of range: the layer has 8 heads"),  # the old spelling still parses
    (["--heads", "3-1"], "Invalid value for '--head': range '3-1' ends before it starts"),
    (["--device", "gpu"], "--device must be cpu, cuda, cuda:N or auto, got 'gpu'"),
    (["--request", "9"], "--request 9 is out of range: the snapshot has 4 requests"),
    (["--step", "1"], "--step 1 is out of range: the snapshot has 1 step(s)"),
    (["--atol", "-1"], "Invalid value for '--atol': must be a non-negative number, got '-1'"),
])
def test_bad_options_exit_2_with_one_line(make_snapshot, args, message):
    path, _ = make_snapshot()
    res = invoke(path, "--backend", "reference", *args)
    assert res.exit_code == 2
    assert res.output.strip() == f"Error: {message}"


def test_missing_file_exit_2(tmp_path):
    res = invoke(str(tmp_path / "nope.safetensors"), "--backend", "reference")
    assert res.exit_code == 2 and res.output.startswith("Error: ")


def test_broken_optional_backend_is_an_unavailable_column(make_snapshot, monkeypatch):
    monkeypatch.setitem(backends_pkg.BACKEND_MODULES, "flashinfer_ts", "kvdbg.backends.no_such_module_for_test")
    path, _ = make_snapshot(query_len=2)
    res = invoke(path, "--json")
    # The snapshot's own backend (FLASHINFER_TS) could not run and there is no engine output: flex, a
    # what-if column here, passes, but nothing about the snapshot's backend was verified.
    assert res.exit_code == 3, res.output
    assert "what-if column(s) flex pass too" in json.loads(res.output)["verdict"]["summary"]
    status = {b["name"]: b for b in json.loads(res.output)["backends"]}
    assert not status["flashinfer_ts"]["available"]
    assert "cannot be imported: ModuleNotFoundError" in status["flashinfer_ts"]["reason"]
    assert status["flex"]["available"] and status["flex"]["run"]["kernel"] == "flex_attention (eager)"
    # asked for by name, it is an error rather than a silent gap
    res = invoke(path, "--backend", "flashinfer_ts")
    assert res.exit_code == 2 and "backend flashinfer_ts cannot run: kvdbg.backends.flashinfer_ts cannot be imported" \
        in res.output


def test_output_writes_once_and_refuses_to_overwrite(make_snapshot, tmp_path):
    path, snap = make_snapshot(query_len=2)
    out = tmp_path / "outputs.safetensors"
    assert invoke(path, "--backend", "flex", "-o", str(out)).exit_code == 0
    tensors = load_file(str(out))
    assert set(tensors) == {"step.0.reference", "step.0.flex"}
    assert tensors["step.0.flex"].shape == snap.steps[0].query.shape
    res = invoke(path, "--backend", "flex", "--output", str(out))
    assert res.exit_code == 2 and "already exists; pass --force" in res.output
    # --save-outputs, the old spelling, still works
    assert invoke(path, "--backend", "flex", "--save-outputs", str(out), "--force").exit_code == 0


def test_steps_and_backends_take_lists(make_snapshot):
    path, _ = make_snapshot(query_len=2, steps=3)
    data = json.loads(invoke(path, "--backend", "reference,FLEX_ATTENTION", "--step", "0,2", "--json").output)
    assert [b["name"] for b in data["backends"]] == ["reference", "flex"]
    assert sorted({c["step"] for c in data["comparisons"]}) == [0, 2]


def test_explain_and_full(make_snapshot):
    path, snap = make_snapshot(query_len=2, num_heads=16, num_kv_heads=4)
    # --explain adds the builder decisions to the one-screen summary, which has no per-head table.
    res = invoke(path, "--backend", "flex", "--explain")
    assert "step 0, request 0: builder decisions" in res.output and "decode_offset" in res.output
    assert "step 0: flex vs reference —" not in res.output
    # --full: every table, every head of every request, none elided; with --explain, the decisions too.
    full = invoke(path, "--backend", "flex", "--full").output
    assert "more passing heads" not in full and "step 0: flex vs reference — PASS" in full
    head_rows = [line for line in full.splitlines() if re.match(r"│\s+\d+ │\s+\d+ │ ok", line)]
    assert len(head_rows) == 16 * snap.steps[0].num_reqs
    assert "builder decisions" not in full
    assert "builder decisions" in invoke(path, "--backend", "flex", "--full", "--explain").output


def test_default_fixture_when_no_argument():
    res = invoke("--backend", "reference", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["snapshot"].endswith("dflash.safetensors")


def test_step_request_and_heads_take_ranges(make_snapshot):
    path, _ = make_snapshot(seq_lens=(20, 40, 60), num_heads=4, num_kv_heads=2, head_size=16, steps=3)
    data = json.loads(invoke(path, "--backend", "flex", "--step", "1-", "--request", "1-", "--heads", "0,2-3",
                             "--json").output)
    assert [s["step"] for s in data["steps"]] == [1, 2]
    assert sorted({c["step"] for c in data["comparisons"]}) == [1, 2]
    heads = {(h["request"], h["head"]) for c in data["comparisons"] for h in c["heads"]}
    assert heads == {(r, h) for r in (1, 2) for h in (0, 2, 3)}
    one = json.loads(invoke(path, "--backend", "flex", "--step", " 2 ", "--json").output)
    assert [s["step"] for s in one["steps"]] == [2]


def test_help_does_not_import_torch():
    out = run_python("import sys\nfrom kvdbg.cli import main\ntry:\n    main(['replay', '--help'])\n"
                     "except SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules)\n")
    assert "TORCH False" in out and "--output" in out
    assert "--save-outputs" not in out  # old spellings parse but are not shown


def test_outputs_file_keeps_its_metadata_key(tmp_path):
    """`replay -o` files name their metadata "kvdbg.replay" (a file-format name, not a module path)."""
    import json

    from safetensors import safe_open

    out = tmp_path / "out.safetensors"
    from tests.helpers import FIXTURES

    fixture = f"{FIXTURES}/causal_gqa.safetensors"
    assert invoke(fixture, "--backend", "flex", "-o", str(out)).exit_code in (0, 1)
    with safe_open(str(out), framework="pt") as f:
        meta = json.loads(f.metadata()["kvdbg.replay"])
    assert "kernels" in meta and "steps" in meta


def test_a_backend_that_chose_its_kernel_per_step_says_so_for_each():
    from kvdbg.backends.base import RunInfo
    from kvdbg.replayer.runner import steps_run_info

    triton = RunInfo("flashinfer_ts", "prims_ts contract, emulated in Triton", "cuda", "bfloat16", emulated=True,
                     notes=["one note every step has"])
    loop = RunInfo("flashinfer_ts", "prims_ts contract, emulated in torch", "cuda", "bfloat16", emulated=True,
                   notes=["one note every step has", "torch loop chosen by size (2 requests)"])
    assert steps_run_info([(0, triton), (1, triton)]) == triton
    merged = steps_run_info([(0, triton), (1, loop), (2, loop)])
    assert merged.kernel == ("prims_ts contract, emulated in Triton (step 0); "
                             "prims_ts contract, emulated in torch (steps 1, 2)")
    assert merged.notes == ["one note every step has", "steps 1, 2: torch loop chosen by size (2 requests)"]
    compiled = RunInfo("flex", "flex_attention (compiled)", "cuda", "bfloat16", compiled=True)
    eager = RunInfo("flex", "flex_attention (eager)", "cuda", "bfloat16")
    mixed = steps_run_info([(0, compiled), (1, eager)])
    assert not mixed.compiled and not mixed.emulated  # compiled only when every step was
    assert steps_run_info([(0, compiled), (1, compiled)]).compiled


# --------------------------------------------------------------------------- issue 44


def test_a_fail_states_its_failing_heads_error_never_a_passing_heads(tmp_path):
    """Issue 44: on ts_causal_window, flashinfer_ts's 4 failing heads are unwritten (no finite error), yet the
    FAIL title read `FAIL: 4 of 12 heads (max abs 1.79e-03, 1024 unwritten)`: the error of a passing head. The
    title, the error map's summary and the `replay DIR` row now take the error from the failing heads, and say
    when those have none."""
    import shutil

    from tests.helpers import FIXTURES

    path = f"{FIXTURES}/ts_causal_window.safetensors"
    res = CliRunner().invoke(cli, ["replay", path, "--picture", "--full"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 1
    text = " ".join(res.output.split())
    assert ("step 0: flashinfer_ts vs reference — FAIL: 4 of 12 heads (failing heads: no finite error, "
            "1024 unwritten)") in text
    assert "flashinfer_ts vs reference, step 0: 4 of 12 heads fail, failing heads: no finite error" in text
    # A passing comparison keeps its number.
    assert "step 0: flex vs reference — PASS (max abs " in text

    data = json.loads(invoke(path, "--json").output)
    (comp,) = [c for c in data["comparisons"] if c["actual"] == "flashinfer_ts"]
    assert comp["failed_max_abs"] is None and comp["max_abs"] == pytest.approx(1.79e-3, rel=0.05)

    # `replay DIR`: the file's row is its worst comparison, with the failing heads' error (none: null, "nan").
    folder = tmp_path / "snaps"
    folder.mkdir()
    shutil.copy(path, folder / "ts.safetensors")
    shutil.copy(f"{FIXTURES}/causal_gqa.safetensors", folder / "gqa.safetensors")
    files = {f["path"].rsplit("/", 1)[-1]: f for f in json.loads(invoke(str(folder), "--json").output)["files"]}
    worst = files["ts.safetensors"]["worst"]
    assert (worst["actual"], worst["passed"], worst["failed_heads"], worst["max_abs"]) == \
        ("flashinfer_ts", False, 4, None)
    assert files["gqa.safetensors"]["worst"]["passed"] and files["gqa.safetensors"]["worst"]["max_abs"] > 0
