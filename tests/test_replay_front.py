"""`kvdbg replay SNAP` without --full: one screen at 80 columns, the verdict, what is wrong, the next commands.

Every command the summary offers is run here as printed (copied whole, its
continuation lines included) and must end in a verdict (exit 0 or 1), never a
usage error.
"""

from __future__ import annotations

import json
import pathlib
import shlex

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.judge.findings import lookup
from tests.helpers import FIXTURES as CHECKOUT_FIXTURES, short_fixtures

FIXTURE_FILES = sorted(p.name for p in pathlib.Path(CHECKOUT_FIXTURES).glob("*.safetensors"))
# The fixtures by a short path: the next commands print it whole, so the page's lines do not depend on where the
# checkout lies.
FIXTURES = short_fixtures()
ENV = {"COLUMNS": "80", "NO_COLOR": "1"}


def invoke(*args: str, env=ENV):
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def hinted_commands(text: str) -> list[list[str]]:
    """The commands under ``next:``, as argv lists: a line ending `` \\`` goes on, a ``  # why`` is dropped."""
    lines = [line.rstrip() for line in text.splitlines()]
    start = lines.index("next:") + 1
    commands: list[str] = []
    going_on = False
    for line in lines[start:]:
        if not going_on and not line.startswith("  kvdbg "):  # a continuation may start anywhere on its line
            break
        body = line.strip()
        if not going_on:
            body = body.split("  # ")[0]
            commands.append("")
        going_on = body.endswith(" \\")
        commands[-1] += body.removesuffix(" \\") + (" " if going_on else "")
    return [shlex.split(c) for c in commands]


@pytest.fixture(scope="module")
def fronts():
    """Each fixture's default output at 80 columns and its --json, replayed once."""
    out = {}
    for name in FIXTURE_FILES:
        path = f"{FIXTURES}/{name}"
        out[name] = (invoke("replay", path), json.loads(invoke("replay", path, "--json").output))
    return out


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_front_door_fits_one_screen_and_names_what_is_wrong(fronts, name):
    res, data = fronts[name]
    lines = res.output.rstrip("\n").splitlines()
    assert res.exit_code == data["verdict"]["exit_code"]
    assert len(lines) <= 30, res.output
    assert max(len(line) for line in lines) <= 80, res.output
    assert "hidden at 80 columns" not in res.output  # nothing is dropped: the summary is narrow by design
    flat = " ".join(res.output.split())
    assert flat.endswith(" ".join(f"{data['verdict']['summary']} (exit {data['verdict']['exit_code']})".split()))
    # Every comparison is one row; a failing one names its failing requests and heads.
    for comp in data["comparisons"]:
        assert f"{comp['actual']} vs {comp['expected']}" in flat
        for head in comp["heads"]:
            if not head["passed"]:
                assert f"req {head['request']} head" in flat
    # Every finding: its code, the code's one-line meaning, and `kvdbg explain CODE` to read more.
    for finding in data["findings"]:
        assert f"{finding['code']}: {lookup(finding['code']).title}" in flat
        assert ["kvdbg", "explain", finding["code"]] in hinted_commands(res.output)
    # Passing heads are not listed one by one (the per-head tables are --full's).
    assert "│ ok " not in res.output and "more passing heads" not in res.output


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_every_hinted_command_runs_as_printed(fronts, name, tmp_path, monkeypatch):
    res, data = fronts[name]
    commands = hinted_commands(res.output)
    assert commands[-1] == ["kvdbg", "replay", f"{FIXTURES}/{name}", "--full"]
    failing = [c for c in data["comparisons"] if c["failed_heads"]]
    if failing:  # a failure points to `attention` on its worst head, and (a backend's) to `shrink`
        assert any(argv[1] == "attention" for argv in commands)
        assert ["kvdbg", "shrink", f"{FIXTURES}/{name}", "-o", "small.safetensors"] in commands
    else:
        assert not any(argv[1] in ("attention", "shrink") for argv in commands)
    monkeypatch.chdir(tmp_path)  # shrink writes small.safetensors here
    for argv in commands:
        assert argv[0] == "kvdbg"
        ran = CliRunner().invoke(cli, argv[1:], env=ENV, catch_exceptions=False)
        assert ran.exit_code in (0, 1), (argv, ran.output)
        assert "Error:" not in ran.output, (argv, ran.output)


def test_attention_hint_is_the_worst_failing_head(fronts):
    res, data = fronts["prefix_page0.safetensors"]
    comp = max((c for c in data["comparisons"] if c["failed_heads"]), key=lambda c: c["failed_max_abs"])
    worst = max((h for h in comp["heads"] if not h["passed"]), key=lambda h: h["max_abs"])
    [attention] = [argv for argv in hinted_commands(res.output) if argv[1] == "attention"]
    assert attention[3:] == ["--step", str(comp["step"]), "--request", str(worst["request"]),
                             "--head", str(worst["head"])]
    # The paging finding points to map, at its step and request.
    assert ["kvdbg", "map", f"{FIXTURES}/prefix_page0.safetensors", "--step", "0", "--request", "1"] in \
        hinted_commands(res.output)


def test_full_is_everything_the_default_showed_before(fronts):
    path = f"{FIXTURES}/dflash.safetensors"
    full = invoke("replay", path, "--full").output
    assert "what each backend did" in full and "pass rule:" in full
    assert full.count("│ ok ") == 5 * 8  # five comparisons, 2 requests x 4 heads each, none elided
    assert len(full.splitlines()) > 3 * len(fronts["dflash.safetensors"][0].output.splitlines())


def test_json_is_the_same_with_or_without_full():
    path = f"{FIXTURES}/causal_gqa.safetensors"

    def keys(record):
        return sorted(record) if isinstance(record, dict) else None

    brief = json.loads(invoke("replay", path, "--json").output)
    full = json.loads(invoke("replay", path, "--json", "--full").output)
    assert keys(brief) == keys(full) == ["backends", "comparisons", "findings", "passed", "rule", "snapshot", "steps",
                                          "verdict"]
    assert brief["verdict"] == full["verdict"] and brief["findings"] == full["findings"]


def test_a_long_command_breaks_between_words_and_stays_one_shell_command():
    from kvdbg.render.front import shell_lines

    command = "kvdbg attention /a/very/long/path/to/some/captures/layer7.safetensors --step 12 --request 3 --head 31"
    lines = shell_lines(command, 60)
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1])
    assert shlex.split(" ".join(line.removesuffix(" \\") for line in lines)) == shlex.split(command)
    assert shell_lines("kvdbg explain live_page_zero", 60) == ["kvdbg explain live_page_zero"]


def test_ranges():
    from kvdbg.render.front import ranges

    assert ranges([7, 0, 1, 2, 3, 9, 10]) == "0-3, 7, 9-10"
    assert ranges([]) == "" and ranges([4]) == "4"


def test_nothing_compared_says_why_and_exits_3(tmp_path):
    from kvdbg.moves.synth import SynthSpec, synth_snapshot
    from kvdbg.snapshot.store import save_snapshot

    path = str(save_snapshot(synth_snapshot(SynthSpec(seq_lens=(40, 70))), tmp_path / "bare.safetensors"))
    res = invoke("replay", path, "--backend", "reference")
    assert res.exit_code == 3
    flat = " ".join(res.output.split())
    assert "nothing to compare: no other backend produced an output to compare and the snapshot holds no " \
           "engine output" in flat
    assert hinted_commands(res.output) == [["kvdbg", "replay", path, "--full"]]


def test_a_long_path_stays_within_the_line():
    """A path that fills the line goes on its own continuation line, indented less, and still fits 80."""
    from kvdbg.render.front import Hint, HintLines
    import io

    from rich.console import Console

    path = "/tmp/" + "x" * 66 + "/s.safetensors"  # 85 characters: longer than the line
    shorter = "/tmp/" + "y" * 58 + "/s.safetensors"  # 77: fits only without the indent
    console = Console(record=True, width=80, file=io.StringIO(), color_system=None)
    console.print(HintLines([Hint(f"kvdbg replay {shorter} --full", "why"),
                             Hint(f"kvdbg replay {path} --full", "why")]), crop=False)
    text = console.export_text()
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[1:4] == ["  kvdbg replay \\", f" {shorter} \\", "      --full"]
    assert lines[5] == f"{path} \\"  # longer than the line: whole, from the first column
    assert hinted_commands(text) == [["kvdbg", "replay", shorter, "--full"], ["kvdbg", "replay", path, "--full"]]



def test_a_shell_command_breaks_only_between_the_shells_words_and_a_longer_word_stands_alone():
    """kvdbg.render.shell: the triage's `$ kvdbg replay ...` lines. Pasted whole (continuations included), each
    printed command is the same argv: a quoted path with a space is one word, and a word longer than the line is
    shown whole on a line of its own."""
    import io

    from rich.console import Console

    from kvdbg.render.shell import ShellCommand, shell_lines
    from tests.helpers import shown_commands, wider_than

    def shown(command):
        out = io.StringIO()
        Console(file=out, width=80, no_color=True).print(ShellCommand(command, "   $ "), crop=False)
        return out.getvalue()

    spaced = shlex.join(["kvdbg", "replay", "/data/my captures/" + "d" * 40 + "/layer 7.safetensors", "--full"])
    deep = shlex.join(["kvdbg", "replay", "/" + "x" * 90 + ".safetensors", "--device", "cuda"])
    short = "kvdbg replay a.safetensors"
    for command in (spaced, deep, short):
        text = shown(command)
        lines = text.splitlines()
        assert not wider_than(lines) and lines[0].startswith("   $ kvdbg replay")
        assert shown_commands(text) == [command] and shlex.split(shown_commands(text)[0]) == shlex.split(command)
    assert len(shown(short).splitlines()) == 1 and len(shown(spaced).splitlines()) > 1
    assert any(line.strip() == "/" + "x" * 90 + ".safetensors \\" for line in shown(deep).splitlines())
    # A command not in the form shlex writes (here an unbalanced quote) is never broken.
    assert shell_lines("kvdbg replay 'a b " + "c" * 80, 40) == ["kvdbg replay 'a b " + "c" * 80]
