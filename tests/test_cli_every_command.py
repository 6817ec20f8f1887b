"""Every command of `kvdbg --help` against the three inputs users get wrong most: a required option or argument left
out, a snapshot with NaN in a live page, and a file that does not exist.

Whatever the command, it ends without a traceback and with a documented exit code (README.md, "Exit codes":
0, 1, 2, 3); bad input is one line on stderr, ``Error: …``, exit 2, and nothing on stdout. On the NaN snapshot
each command's exit code is pinned, so that none turns a NaN into a PASS. The commands come from
``kvdbg.cli.COMMANDS`` (what `kvdbg --help` lists): a command added without a row in ``CASES`` fails here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable

import pytest
from click.testing import CliRunner

from kvdbg.cli import COMMANDS, cli

from tests.helpers import FIXTURES

DOCUMENTED_EXITS = (0, 1, 2, 3)
CLEAN = os.path.join(FIXTURES, "prefix_page0.safetensors")  # the NaN snapshot's own source, clean
MISSING = "/nonexistent-kvdbg-dir/missing.safetensors"


@dataclass(frozen=True)
class Case:
    """How one command is called in each column of the matrix (None: the column does not apply, and why)."""

    # Arguments that leave out what the command requires, and a word the one error line must hold.
    missing: tuple[tuple[str, ...], str] | None
    # Arguments given the NaN snapshot path (and a scratch directory for outputs), and the exit code they give.
    nan: tuple[Callable[[str, str], list[str]], int] | None
    # Arguments naming a file that does not exist, and a word the error line must hold.
    nonexistent: tuple[tuple[str, ...], str]
    why_not: str = ""  # why a column does not apply


# The replaying commands run one backend (flex) over the small prefix_page0 snapshot: seconds, not minutes.
CASES: dict[str, Case] = {
    "attention": Case(
        missing=None, why_not="SNAPSHOT is optional (the bundled dflash fixture); nothing else is required",
        nan=(lambda snap, out: [snap, "--backend", "flex"], 1),  # its worst head reads the NaN key
        nonexistent=((MISSING,), MISSING)),
    "conform": Case(
        missing=None, why_not="every option has a default (the engine's backends, the whole feature matrix)",
        nan=None, nonexistent=(("--out", "/nonexistent-kvdbg-dir/out"), "/nonexistent-kvdbg-dir")),
    "diff": Case(
        missing=((CLEAN,), "Missing argument 'B'"),
        nan=(lambda snap, out: [snap, CLEAN], 3),  # the KV pages differ; no output is held by both to compare
        nonexistent=((MISSING, CLEAN), MISSING)),
    "explain": Case(
        missing=None, why_not="CODE is optional (without it, every code is listed); it takes no snapshot",
        nan=None, nonexistent=((MISSING,), "unknown finding code")),
    "import": Case(
        missing=((), "Missing argument 'PATH'"),
        nan=None, why_not="it reads a FlashInfer dump or a flashinfer-bench dataset, not a snapshot",
        nonexistent=((MISSING,), MISSING)),
    "info": Case(
        missing=((), "Missing argument 'SNAPSHOT'"),
        nan=(lambda snap, out: [snap, "--check"], 1),  # --check reads the live pages: NaN is an error finding
        nonexistent=((MISSING,), MISSING)),
    "map": Case(
        missing=((), "Missing argument 'SNAPSHOT'"),
        nan=(lambda snap, out: [snap], 1),  # nonfinite_kv
        nonexistent=((MISSING,), MISSING)),
    "merge": Case(
        missing=((CLEAN, CLEAN), "Missing option '-o' / '--output'"),
        nan=(lambda snap, out: [snap, CLEAN, "-o", os.path.join(out, "merged.safetensors")], 2),  # not two ranks
        nonexistent=((MISSING, CLEAN, "-o", "/tmp/kvdbg-never-merged.safetensors"), MISSING)),
    "poison": Case(
        missing=None, why_not="SNAPSHOT is optional (the bundled dflash fixture); nothing else is required",
        # Flex reads no slot it must not (the outputs already NaN are left out, and it says so), but the verdict
        # is the snapshot's, as replay gives it (kvdbg.judge.verdict's one rule): the NaN fails it.
        nan=(lambda snap, out: [snap, "--backend", "flex", "--step", "0"], 1),
        nonexistent=((MISSING,), MISSING)),
    "replay": Case(
        missing=None, why_not="SNAPSHOT is optional (the bundled dflash fixture); nothing else is required",
        nan=(lambda snap, out: [snap, "--backend", "flex"], 1),
        nonexistent=((MISSING,), MISSING)),
    "report": Case(
        missing=((), "Missing argument 'SNAPSHOT'"),
        nan=(lambda snap, out: [snap, "--backend", "flex", "-o", os.path.join(out, "r.md"), "--html",
                                os.path.join(out, "r.html")], 1),
        nonexistent=((MISSING,), MISSING)),
    "shrink": Case(
        missing=((CLEAN,), "Missing option '-o' / '--output'"),
        # the snapshot's verdict (FAIL: the NaN), then what was shrunk
        nan=(lambda snap, out: [snap, "--backend", "flex", "-o", os.path.join(out, "small.safetensors")], 1),
        nonexistent=((MISSING, "-o", "/tmp/kvdbg-never-shrunk.safetensors"), MISSING)),
    "sweep": Case(
        missing=None, why_not="SNAPSHOT is optional (the bundled dflash fixture) and --vary defaults to every knob",
        nan=(lambda snap, out: [snap, "--backend", "flex", "--vary", "placement", "--step", "0"], 1),
        nonexistent=((MISSING,), MISSING)),
    "synth": Case(
        missing=(("--seq-lens", "9"), "-o/--output"),
        nan=None, why_not="it writes a snapshot and reads none",
        nonexistent=(("-o", MISSING, "--seq-lens", "9"), "/nonexistent-kvdbg-dir")),
    "triage": Case(
        missing=((), "Missing argument 'RESULTS'"),
        nan=None, why_not="it reads a results file, not a snapshot",
        nonexistent=(("/nonexistent-kvdbg-dir/results.jsonl",), "no such results file")),
    "window": Case(
        missing=((), "give SNAPSHOT, or --seq-len"),
        # it reads lengths and the header, never a page: the NaN is not seen, but the live page 0 this snapshot
        # (prefix_page0's) hides keys with is an error finding of its FLEX_ATTENTION inputs, as map says
        nan=(lambda snap, out: [snap], 1),
        nonexistent=((MISSING,), MISSING)),
}

TABLE_COMMANDS = {"attention", "diff", "info", "map", "poison", "replay", "shrink", "sweep", "window"}


def invoke(command: str, args) -> "CliRunner.Result":
    return CliRunner().invoke(cli, [command, *map(str, args)], env={"COLUMNS": "80", "NO_COLOR": "1"})


def assert_ended_cleanly(res, what: str) -> None:
    """No traceback (an exception other than click's exit), and a documented exit code."""
    assert res.exception is None or isinstance(res.exception, SystemExit), (what, repr(res.exception), res.output)
    assert "Traceback" not in res.output, (what, res.output)
    assert res.exit_code in DOCUMENTED_EXITS, (what, res.exit_code, res.output)


def assert_one_error_line(res, needle: str, what: str) -> None:
    assert_ended_cleanly(res, what)
    assert res.exit_code == 2, (what, res.exit_code, res.output)
    assert res.stdout == "", (what, res.stdout)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], (what, res.stderr)


def test_every_command_has_a_row():
    assert sorted(CASES) == sorted(COMMANDS)
    listed = CliRunner().invoke(cli, ["--help"]).output
    assert all(f"  {name} " in listed or f"  {name}\n" in listed for name in COMMANDS)
    for name, case in CASES.items():
        assert (case.missing is not None and case.nan is not None) or case.why_not, name


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_required_option_or_argument_left_out(command):
    case = CASES[command]
    if case.missing is None:
        pytest.skip(case.why_not)
    args, needle = case.missing
    assert_one_error_line(invoke(command, args), needle, f"{command} {' '.join(args)}")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_file_that_does_not_exist(command, tmp_path):
    args, needle = CASES[command].nonexistent
    assert_one_error_line(invoke(command, args), needle, f"{command} {' '.join(args)}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_snapshot_with_nan_in_a_live_page(command, nan_k_snapshot, tmp_path):
    case = CASES[command]
    if case.nan is None:
        pytest.skip(case.why_not)
    make_args, expected = case.nan
    # Output files in a directory whose paths fit a line (a longer path is printed whole, on a line of its own).
    out_dir = tempfile.mkdtemp(prefix="knan-")
    try:
        args = make_args(nan_k_snapshot, out_dir)
        res = invoke(command, args)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    what = f"{command} {' '.join(args)}"
    assert_ended_cleanly(res, what)
    assert res.exit_code == expected, (what, res.exit_code, res.output)
    if expected == 2:
        assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("Error: "), (what, res.stderr)
        return
    out = res.stdout.rstrip().splitlines()
    verdict = " ".join(" ".join(out[-3:]).split())  # the verdict line, wrapped at 80 columns
    assert verdict.endswith(f"(exit {expected})"), (what, verdict)
    assert ("FAIL" if expected == 0 else "PASS") not in verdict, (what, verdict)  # a NaN never passes
    if command in TABLE_COMMANDS:
        wide = [line for line in out if len(line) > 80]
        assert not wide, (what, wide)  # piped output is laid out for 80 columns
