"""The finding registry: every code produced is registered and every registered code has a producer;
`kvdbg explain`; docs/findings.md is generated from the registry."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.judge.findings import CODES, SEVERITIES, Finding, UnknownCode, lookup, markdown
from kvdbg.snapshot.pagemap import PagingHazard

from tests.helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = sorted(p for d in ("kvdbg", "backends") for p in (ROOT / d).rglob("*.py") if p.name != "findings.py")
# Calls that build a finding, and the argument that holds its code: (keyword, position).
PRODUCERS = {"Finding": ("code", None), "_broken": (None, 0), "_finding": (None, 1)}
# Producer calls whose code is not a literal: wrappers that pass on a code their callers give as a literal.
PASSED_ON = {("kvdbg/snapshot/pagemap.py", "hazard_finding"), ("kvdbg/ts/contract.py", "_broken"),
             ("backends/flashinfer_ts/instance.py", "_finding")}


def _literals(node) -> set[str] | None:
    """The code strings an expression can take: a literal, or a conditional between literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        body, orelse = _literals(node.body), _literals(node.orelse)
        return None if body is None or orelse is None else body | orelse
    return None


def produced_codes() -> tuple[set[str], set[tuple[str, str]]]:
    """Codes the product code builds findings with, and the (file, function) of calls with no literal code."""
    codes: set[str] = set()
    dynamic: set[tuple[str, str]] = set()
    for path in PRODUCT:
        tree = ast.parse(path.read_text(), str(path))
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
                name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
                if name not in PRODUCERS or fn.name == name:
                    continue
                keyword, position = PRODUCERS[name]
                arg = next((k.value for k in call.keywords if k.arg == keyword), None) if keyword else (
                    call.args[position] if len(call.args) > position else None)
                found = _literals(arg) if arg is not None else None
                if found is None:
                    dynamic.add((path.relative_to(ROOT).as_posix(), fn.name))
                else:
                    codes |= found
    # A paging hazard names its code by kind (PagingHazard.code): both kinds, as map and flex report them.
    for kind in ("null_block", "aliased"):
        codes.add(PagingHazard(kind, 0, (0,), (0,), None, 0, 0).code)
    return codes, dynamic


def test_every_code_produced_is_registered_and_every_registered_code_is_produced():
    codes, dynamic = produced_codes()
    assert dynamic == PASSED_ON, f"a finding built from a computed code: {sorted(dynamic - PASSED_ON)}"
    assert not codes - set(CODES), f"codes produced but not registered: {sorted(codes - set(CODES))}"
    assert not set(CODES) - codes, f"codes registered that nothing produces: {sorted(set(CODES) - codes)}"


def test_a_finding_takes_its_severity_from_the_registry():
    with pytest.raises(UnknownCode, match="did you mean live_page_zero"):
        Finding(code="live_page_zro", message="x")
    with pytest.raises(ValueError, match="needs a context"):
        Finding(code="live_page_zero", message="x")  # the severity depends on the keys hidden
    with pytest.raises(ValueError, match="one severity"):
        Finding(code="nonfinite_kv", message="x", context="hides_keys")
    assert Finding(code="live_page_zero", message="x", context="hides_keys").severity == "error"
    assert Finding(code="live_page_zero", message="x", context="before_window").severity == "info"
    assert Finding(code="page_size_unsupported", message="x", context="flex").severity == "warning"
    assert Finding(code="page_size_unsupported", message="x", context="flashinfer_ts").severity == "error"
    f = Finding(code="zero_page", message="m", backend="replay", step=1, request=2, details={"traceback": "t"})
    assert f.severity == "warning" and f.requests == [2]
    assert f.to_json() == {"backend": "replay", "code": "zero_page", "severity": "warning", "step": 1,
                           "request": 2, "requests": [2], "pages": [], "message": "m", "details": {}}


def test_every_code_is_explained_in_full():
    for code in CODES.values():
        assert set(code.severities) <= set(SEVERITIES), code.name
        for part in (code.title, code.means, code.fires, code.action, code.reported_by):
            assert part.strip() and "\n" not in part, code.name
        assert code.explanation.startswith(code.means) and code.explanation.endswith(code.action)


def test_prims_ts_rules_live_in_the_registry():
    from kvdbg.ts.contract import PRECONDITIONS, check_plan

    assert PRECONDITIONS["table_too_narrow"] == (lookup("table_too_narrow").rule, lookup("table_too_narrow").source)
    (f,) = check_plan(head_dim=None, page_size=12, q_dtype=None, kv_dtype=None, mask_type="dense", window_left=-1)
    assert (f.code, f.severity, f.backend) == ("page_size_unsupported", "error", "flashinfer_ts")


def test_map_and_flex_name_a_hidden_null_block_alike():
    """One condition, one code: `kvdbg map` and the flex backend report page 0 under the same code."""
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.snapshot.pagemap import find_anomalies
    from kvdbg.replayer.runner import replay
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    snap = synth_snapshot(SynthSpec(seq_lens=(40, 70), use_page_zero=True, page_zero_request=1, num_heads=2,
                                    num_kv_heads=1, head_size=16))
    (mapped,) = [a for a in find_anomalies(snap, 0) if a.severity == "error"]
    (step,) = replay(snap, ["reference", "flex"], ReplayOptions()).steps
    (flex,) = [f for f in step.runs["flex"].findings if f.severity == "error"]
    assert (mapped.code, mapped.step, mapped.request, mapped.backend) == ("live_page_zero", 0, 1, "map")
    assert (flex.code, flex.step, flex.request, flex.backend) == ("live_page_zero", 0, 1, "flex")
    assert flex.message == mapped.message


# --------------------------------------------------------------------------- kvdbg explain


def explain(*args, width: int = 80):
    return CliRunner().invoke(cli, ["explain", *args], env={"COLUMNS": str(width), "NO_COLOR": "1"},
                              catch_exceptions=False)


def test_explain_one_code():
    res = explain("page_mapped_twice")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert text.startswith("page_mapped_twice: one physical page sits at several logical blocks of one request")
    assert "severity: error when some query token's mask shows a key" in text
    for part in ("What it means.", "When it fires.", "What to do."):
        assert part in text
    assert all(len(line) <= 80 for line in res.output.splitlines())
    data = json.loads(explain("page_mapped_twice", "--json").output)
    assert data["code"] == "page_mapped_twice" and data["severities"] == ["error", "info"]
    assert [c["name"] for c in data["contexts"]] == ["hides_keys", "before_window"]


def test_explain_lists_every_code_in_80_columns():
    res = explain()
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert "hidden at" not in res.output  # no column had to be left out
    for name in CODES:
        assert f"│ {name} " in res.output, name
    data = json.loads(explain("--json").output)
    assert [c["code"] for c in data["codes"]] == list(CODES)


def test_explain_unknown_code_is_one_line_with_a_suggestion_and_exit_2():
    res = CliRunner().invoke(cli, ["explain", "live_page_zro"])
    assert res.exit_code == 2
    assert res.output == ("Error: unknown finding code 'live_page_zro'; did you mean live_page_zero? (kvdbg explain "
                          "lists them all)\n")
    res = CliRunner().invoke(cli, ["explain", "xyzzy"])
    assert res.exit_code == 2 and res.output == "Error: unknown finding code 'xyzzy' (kvdbg explain lists them all)\n"


def test_explain_knows_former_names_but_findings_do_not_take_them():
    res = explain("null_page_masked")
    assert res.exit_code == 0 and res.output.startswith("null_page_masked is now reported as live_page_zero\n")
    assert json.loads(explain("page_reused_outside_window", "--json").output)["code"] == "page_mapped_twice"
    with pytest.raises(UnknownCode):
        Finding(code="null_page_masked", message="x")


def test_explain_does_not_import_torch():
    code = """
import sys, runpy
for argv in (["kvdbg", "explain"], ["kvdbg", "explain", "live_page_zero", "--json"]):
    sys.argv = argv
    try:
        runpy.run_module("kvdbg", run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
print("HEAVY=" + ",".join(m for m in ("torch", "numpy") if m in sys.modules))
"""
    assert run_python(code).strip().splitlines()[-1] == "HEAVY="


def test_docs_findings_md_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "findings.md").read_text()
    assert doc == markdown(), "docs/findings.md is out of date: python -m kvdbg.judge.findings --markdown > docs/findings.md"
    for name in CODES:
        assert f"\n## {name}\n" in doc


def test_findings_tables_point_to_explain(tmp_path):
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    path = str(save_snapshot(synth_snapshot(SynthSpec(seq_lens=(40, 70), use_page_zero=True, page_zero_request=1,
                                                      num_heads=2, num_kv_heads=1, head_size=16)),
                             tmp_path / "page0.safetensors"))
    env = {"COLUMNS": "80", "NO_COLOR": "1"}
    shown = CliRunner().invoke(cli, ["map", path], env=env).output
    assert "kvdbg explain live_page_zero: what it means and what to do" in shown
    shown = CliRunner().invoke(cli, ["replay", path, "--backend", "flex", "--full"], env=env).output
    assert "kvdbg explain live_page_zero: what it means and what to do" in shown
    assert all(len(line) <= 80 for line in shown.splitlines())
    shown = CliRunner().invoke(cli, ["replay", path, "--backend", "flex"], env=env).output
    assert "  kvdbg explain live_page_zero  # what it means, what to do" in shown.splitlines()
    # A next command's path longer than the line (this test's own) is shown whole, as the only word on its line.
    assert all(len(line) <= 80 for line in shown.splitlines() if not line.startswith(path))
