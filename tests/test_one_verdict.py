"""One rule decides what is a failure (kvdbg.judge.verdict.judge), and every command applies it: on every
committed fixture, every command that judges a snapshot says the same verdict word with the same exit code as
`kvdbg replay` (fixtures/expected.json's exit_code)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
EXPECTED = {name: spec for name, spec in json.loads((FIXTURES / "expected.json").read_text()).items()
            if not name.startswith("_")}
WORDS = {0: "PASS", 1: "FAIL", 3: "NOTHING VERIFIED"}
STATUS = {0: "pass", 1: "fail", 3: "unverified"}

# Every command that closes on a verdict about one snapshot; sweep varies one cheap knob (the verdict is the
# baseline's whatever the knobs), shrink and report write their files under tmp_path.
JSON_COMMANDS = {
    "replay": ["replay", "{snap}", "--json"],
    "window": ["window", "{snap}", "--json"],
    "map": ["map", "{snap}", "--json"],
    "info --check": ["info", "{snap}", "--check", "--json"],
    "attention": ["attention", "{snap}", "--json"],
    "poison": ["poison", "{snap}", "--json"],
    "sweep": ["sweep", "{snap}", "--vary", "placement", "--json"],
    "shrink": ["shrink", "{snap}", "-o", "{tmp}/small.safetensors", "--json"],
}


def test_every_fixture_is_listed():
    assert sorted(EXPECTED) == sorted(p.name for p in FIXTURES.glob("*.safetensors"))


def _run(args):
    res = CliRunner().invoke(cli, [str(a) for a in args], env={"NO_COLOR": "1", "COLUMNS": "80"})
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    return res


@pytest.mark.parametrize("command", list(JSON_COMMANDS))
@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_every_command_gives_the_fixtures_verdict(fixture, command, tmp_path):
    code = EXPECTED[fixture]["exit_code"]
    args = [a.format(snap=FIXTURES / fixture, tmp=tmp_path) for a in JSON_COMMANDS[command]]
    res = _run(args)
    assert res.exit_code == code, (command, fixture, res.output[-600:])
    verdict = json.loads(res.output)["verdict"]
    assert verdict["status"] == STATUS[code] and verdict["exit_code"] == code
    assert verdict["summary"].startswith(WORDS[code] + ":"), verdict["summary"]


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_report_ends_on_the_same_verdict(fixture, tmp_path):
    code = EXPECTED[fixture]["exit_code"]
    res = _run(["report", str(FIXTURES / fixture), "-o", str(tmp_path / "r.md")])
    assert res.exit_code == code, res.output
    text = " ".join(res.output.split())
    assert re.search(rf"{WORDS[code]}: .*\(exit {code}\)$", text), text[-300:]


def test_dflash_the_documented_extra_keys_are_named_never_failed():
    """FLASHINFER_TS's page-aligned window restriction is documented behaviour: attention states the weight on
    those keys and poison the slots, as a warning; neither calls it a failure."""
    snap = str(FIXTURES / "dflash.safetensors")
    attention = json.loads(_run(["attention", snap, "--json"]).output)
    ts = next(c for c in attention["columns"] if c["backend"] == "flashinfer_ts")
    assert ts["forbidden_count"] == ts["documented_count"] == 2
    assert ts["documented_mass"] == pytest.approx(ts["forbidden_mass"], rel=1e-9) and ts["documented_mass"] > 1e-3
    codes = {(f["code"], f["severity"]) for f in attention["findings"]}
    assert codes == {("window_restriction_extra_keys", "warning")}
    assert "shows by design" in attention["verdict"]["summary"]

    poison = json.loads(_run(["poison", snap, "--backend", "flashinfer_ts", "--json"]).output)
    ts = poison["results"] if "results" in poison else poison["steps"][0]["results"]
    before = {r["region"]: r for b in ts for r in b["regions"] if b["backend"] == "flashinfer_ts"}["before_window"]
    assert before["status"] == "reads by design"
    assert [c["keys"] for c in before["culprits"]] == [[{"request": 0, "first": 4896, "last": 4896}]]
    assert [f["code"] for f in poison["findings"]] == ["window_restriction_extra_keys"]
    assert poison["verdict"]["exit_code"] == 0


def _picture(**column):
    from types import SimpleNamespace

    from kvdbg.moves.attention import ColumnWeights

    col = ColumnWeights("flashinfer_ts", "rule", [(0, 10)], [0.1] * 10, **column)
    return SimpleNamespace(step=0, request=0, head=0, token=0, query_nonfinite=False, columns=[col])


def _passing_replay():
    from types import SimpleNamespace

    compared = SimpleNamespace(actual="flashinfer_ts", expected="reference", heads=[object()], passed=True)
    return SimpleNamespace(comparisons=[compared], findings=[], result=SimpleNamespace(counted=None))


def test_attention_fails_only_the_weight_beyond_the_documented_keys():
    from kvdbg.cli.attention import attention_findings, attention_verdict

    by_design = _picture(forbidden_mass=0.01, forbidden_count=2, documented_mass=0.01, documented_count=2)
    assert [(f.code, f.severity) for f in attention_findings(by_design)] == \
        [("window_restriction_extra_keys", "warning")]
    assert attention_verdict(by_design, _passing_replay()).exit_code == 0
    beyond = _picture(forbidden_mass=0.05, forbidden_count=5, documented_mass=0.01, documented_count=2)
    found = attention_findings(beyond)
    assert [(f.code, f.severity) for f in found] == [("weights_outside_mask", "error"),
                                                     ("window_restriction_extra_keys", "warning")]
    assert "gives 4.00e-02 of its weight to 3 key(s) outside the exact mask" in found[0].message
    verdict = attention_verdict(beyond, _passing_replay())
    assert (verdict.status, verdict.exit_code) == ("fail", 1) and "weights_outside_mask" in verdict.summary


def test_the_rule_for_one_piece_of_evidence():
    from types import SimpleNamespace

    from kvdbg.judge.findings import Finding
    from kvdbg.judge.verdict import fails, inputs_verdict

    assert fails(Finding(code="tokens_missed", message="x")) and not fails(
        Finding(code="window_restriction_extra_keys", message="x"))
    assert fails(SimpleNamespace(heads=[1], passed=False)) and not fails(SimpleNamespace(heads=[], passed=False))
    # inputs only: an error of a backend that is not the snapshot's own is a what-if, as in a replay
    what_if = inputs_verdict([Finding(code="tokens_missed", message="x", backend="flashinfer_ts")],
                             {"replay", "flex"})
    assert what_if.exit_code == 0 and what_if.what_if_failures == ("flashinfer_ts",)
    assert inputs_verdict([Finding(code="tokens_missed", message="x", backend="flashinfer_ts")]).exit_code == 1
