"""Each bundled fixture replays to exactly what fixtures/expected.json says."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli
from tests.helpers import FIXTURES

EXPECTED = json.load(open(os.path.join(FIXTURES, "expected.json")))
NAMES = sorted(k for k in EXPECTED if not k.startswith("_"))


VLLM_COLUMNS = ("vllm", "vllm_flex")


def _without_vllm_columns(got: dict) -> dict:
    """The vllm column runs only where vLLM can run the snapshot's backend (checked by the engine stage), so
    the fixtures' expectations, which hold on every machine, leave it out."""
    got["backends"] = [b for b in got["backends"] if b["name"] not in VLLM_COLUMNS]
    got["comparisons"] = [c for c in got["comparisons"] if c["actual"] not in VLLM_COLUMNS]
    got["findings"] = [f for f in got["findings"] if f["backend"] not in VLLM_COLUMNS]
    return got


@pytest.mark.parametrize("name", NAMES)
def test_fixture_replays_as_expected(name):
    want = EXPECTED[name]
    result = CliRunner().invoke(cli, ["replay", os.path.join(FIXTURES, name), "--json"])
    assert result.exit_code == want["exit_code"], result.output[-2000:]
    got = _without_vllm_columns(json.loads(result.output))
    assert sorted(b["name"] for b in got["backends"] if not b["available"]) == want["unavailable"]
    comparisons: dict[str, list] = {}
    for c in got["comparisons"]:
        key = f"{c['actual']} vs {c['expected']}"
        failing = [[c["step"], h["request"], h["head"]] for h in c["heads"] if not h["passed"]]
        comparisons.setdefault(key, []).extend(failing)
    assert {k: sorted(v) for k, v in comparisons.items()} == want["comparisons"]
    findings = [[f["backend"], f["code"], f["severity"], f["step"], f["request"]] for f in got["findings"]]
    assert sorted(findings, key=json.dumps) == sorted(want["findings"], key=json.dumps)
