"""`kvdbg triage` on a damaged results file: every bad field is a one-line error naming the line and the field."""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from kvdbg.replayer.batch import STATUS_BAD_INPUT, STATUS_FAIL, STATUS_PASS, BatchOptions, FileResult, Worst
from kvdbg.cli import cli
from kvdbg.fleet.results import (FileKey, Placement, ResultsError, Row, end_record, options_record, read_results,
                           row_record, run_record)

# Values a hand edit or a damaged disk may leave in any field.
HOSTILE = [None, "x", -1, 10**30, 1.5, float("nan"), float("inf"), [], {}, [1, "a"], {"a": 1}, True]


def _comparison(actual: str, expected: str, *, passed: bool, failed: list[int]) -> dict:
    return {"actual": actual, "expected": expected, "step": 0, "passed": passed, "counted": True,
            "max_abs": 0.5 if failed else 0.001, "failed_heads": len(failed), "heads": 8, "not_compared": 0,
            "failed_head_ids": failed, "query_heads": 4, "actual_nonfinite": 0, "unwritten": 0,
            "expected_nonfinite": 0}


def _records() -> list[dict]:
    """A results file as `kvdbg replay DIR --results` writes it: a failing, a bad-input and a passing row."""
    failing = FileResult("d/fail.safetensors", STATUS_FAIL, 1, layer="model.layers.0.self_attn.attn", steps=[0],
                         worst=Worst("flex", "reference", 0, False, 0.5, 2, 8, True), error_findings=["live_page_zero"],
                         summary="FAIL: flex vs reference", seconds=0.25,
                         comparisons=[_comparison("flex", "reference", passed=False, failed=[0, 3]),
                                      _comparison("captured", "reference", passed=True, failed=[])])
    bad = FileResult("d/bad.safetensors", STATUS_BAD_INPUT, 2, summary="d/bad.safetensors: not a snapshot")
    passing = FileResult("d/pass.safetensors", STATUS_PASS, 0, steps=[0], summary="PASS",
                         worst=Worst("flex", "reference", 0, True, 0.001, 0, 8, True),
                         comparisons=[_comparison("flex", "reference", passed=True, failed=[])])
    rows = [Row(r.path, [FileKey("/abs/" + r.path, 1000 + i, 5)], r, ranks=[0], step=7,
                placement=Placement("cpu", pid=42), attempts=1, finished="2026-01-01T00:00:00.000+00:00")
            for i, r in enumerate((failing, bad, passing))]
    options = options_record(BatchOptions(backends=("flex",), atol=0.01), "cpu")
    return [run_record(options, planned=3, skipped=0, executor={"kind": "jobs", "workers": 1}, resumed=False),
            *(row_record(row, None) for row in rows),
            end_record(rows=3, exit_code=2, interrupted=False)]


def _write(tmp_path, records) -> str:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # json.dumps writes NaN, as a hand edit may
    return str(path)


def _set(records, where: tuple, value) -> list[dict]:
    records = copy.deepcopy(records)
    obj = records
    for key in where[:-1]:
        obj = obj[key]
    obj[where[-1]] = value
    return records


def _field_paths(obj, prefix=()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield prefix + (key,)
            yield from _field_paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj[:2]):
            yield prefix + (i,)
            yield from _field_paths(value, prefix + (i,))


def _triage(path: str, *extra: str):
    return CliRunner().invoke(cli, ["triage", path, *extra])


def test_the_unharmed_file_is_read(tmp_path):
    found = read_results(_write(tmp_path, _records()))
    assert [r.result.status for r in found.rows] == [STATUS_FAIL, STATUS_BAD_INPUT, STATUS_PASS]
    assert found.rows[0].placement == Placement("cpu", pid=42) and found.finished
    res = _triage(_write(tmp_path, _records()), "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["groups"][0]["kind"] == "fail"


@pytest.mark.parametrize("where, value, message", [
    ((1, "path"), None, "line 2: row record field path must be a string, got null"),
    ((2, "path"), 5, "line 3: row record field path must be a string, got 5"),
    ((1, "status"), float("nan"), "line 2: row record field status must be a string, got NaN"),
    ((1, "status"), "exploded", 'row record field status must be one of pass, fail, unverified, bad input, '
                                'crashed, got "exploded"'),
    ((1, "exit_code"), 7, "line 2: row record field exit_code must be 0, 1, 2 or 3, got 7"),
    ((1, "comparisons"), ["x"], 'line 2: row record field comparisons[0] must be an object, got "x"'),
    ((1, "comparisons", 0, "query_heads"), "x", "field comparisons[0].query_heads must be a non-negative integer"),
    ((1, "comparisons", 0, "failed_head_ids"), [0, -3], "field comparisons[0].failed_head_ids[1] must be a non"),
    ((1, "worst", "max_abs"), "x", 'line 2: row record field worst.max_abs must be a finite number, got "x"'),
    ((1, "worst", "max_abs"), float("inf"), "field worst.max_abs must be a finite number, got Infinity"),
    ((1, "error_findings"), [None], "field error_findings[0] must be a string, got null"),
    ((1, "files"), [], "line 2: row record field files is empty"),
    ((1, "files", 0, "size"), "big", 'field files[0].size must be an integer, got "big"'),
    ((1, "placement"), {"pid": 3}, "line 2: row record has no field 'placement.device'"),
    ((1, "seconds"), float("nan"), "field seconds must be a finite number, got NaN"),
    ((0, "options", "backends"), [1, "a"], "line 1: run record field options.backends[0] must be a string, got 1"),
    ((0, "options", "steps"), 1.5, "line 1: run record field options.steps must be a string, got 1.5"),
    ((0, "planned"), -1, "line 1: run record field planned must be a non-negative integer, got -1"),
    ((0, "version"), True, "results format version True"),
    ((4, "interrupted"), "no", 'line 5: end record field interrupted must be true or false, got "no"'),
])
def test_a_bad_field_is_one_line_naming_it(tmp_path, where, value, message):
    path = _write(tmp_path, _set(_records(), where, value))
    for extra in ([], ["--json"]):
        res = _triage(path, *extra)
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert message in res.output and len(res.output.strip().splitlines()) == 1, res.output
    with pytest.raises(ResultsError, match="line"):
        read_results(path)


def test_a_missing_field_is_named(tmp_path):
    records = _records()
    del records[1]["files"][0]["mtime_ns"]
    res = _triage(_write(tmp_path, records))
    assert res.exit_code == 2 and "line 2: row record has no field 'files[0].mtime_ns'" in res.output


def test_json_nested_too_deep_is_not_a_json_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_records()[0]) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    res = _triage(str(path))
    assert res.exit_code == 2 and "line 2: not a JSON line" in res.output


def test_every_field_mutated_gives_a_verdict_or_a_one_line_error(tmp_path):
    """The reviewer's fuzz: each field of each line set to each hostile value; no Python exception escapes,
    and --json stays strict JSON."""
    records = _records()
    path = str(tmp_path / "r.jsonl")
    problems = []
    for line, record in enumerate(records):
        for where in _field_paths(record):
            for value in HOSTILE:
                with open(path, "w") as fh:
                    fh.write("".join(json.dumps(r) + "\n" for r in _set(records, (line, *where), value)))
                for extra in ([], ["--json"]):
                    res = _triage(path, *extra)
                    shown = f"line {line + 1} {where} = {value!r} {extra}"
                    if res.exception is not None and not isinstance(res.exception, SystemExit):
                        problems.append(f"{shown}: {type(res.exception).__name__}: {res.exception}")
                    elif res.exit_code == 2 and res.output.startswith("Error:"):
                        if len(res.output.strip().splitlines()) != 1:
                            problems.append(f"{shown}: not one line: {res.output!r}")
                    elif extra:
                        try:
                            json.loads(res.stdout, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
                        except ValueError as exc:
                            problems.append(f"{shown}: not strict JSON: {exc}")
    assert not problems, "\n".join(problems[:20])
