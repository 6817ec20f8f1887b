"""Every table command on every fixture at COLUMNS=80 with NO_COLOR: no line is wider than 80, no backend
name, file name or number is split across lines, and another identifier breaks only at a boundary (after
``_ / -``, before ``.``), never inside a word.

How a split is found: the same command is run at 400 columns, where nothing
wraps, and its identifiers and numbers collected. At 80 columns every line is
cut into its table cells; a cell's pieces on consecutive lines are joined (with
nothing between them when the upper piece fills its cell, as a folded word
does; with a space otherwise), and so are consecutive lines of plain text. A
token of the wide output that appears in those joined streams but on no single
line was split.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli
from tests.helpers import FIXTURES

pytestmark = pytest.mark.slow

FIXTURE_FILES = sorted(p.name for p in pathlib.Path(FIXTURES).glob("*.safetensors"))
WIDTH = 80
SEPARATORS = "│┃"
BACKENDS = {"reference", "flex", "flashinfer_ts", "vllm", "vllm_flex", "captured", "FLEX_ATTENTION", "FLASHINFER_TS"}
BORDERS = set("━─┏┓┗┛┡┩┢┪└┘┌┐├┤┬┴┼╇╈╋┳┻╭╮╰╯═")
# Identifiers (a name with an underscore, a file name) and numbers (an integer of two digits or more, a decimal,
# an exponent): what a reader copies or compares, and what must never be cut in two.
TOKEN = re.compile(r"[A-Za-z0-9_.+\-/]*[A-Za-z0-9]")
NUMBER = re.compile(r"^[-+]?(\d\d+|\d*\.\d+(e[-+]?\d+)?|\d+e[-+]?\d+|\d\.\d+)$")


def is_watched(token: str) -> bool:
    return len(token) >= 3 and ("_" in token or token.endswith(".safetensors") or bool(NUMBER.match(token)))


def run(width: int, *args: str):
    return CliRunner().invoke(cli, list(args), env={"COLUMNS": str(width), "NO_COLOR": "1"}, catch_exceptions=False)


def _cells(line: str) -> list[tuple[int, int]]:
    """(start, end) of each cell's interior (padding included) of a table line."""
    bars = [i for i, c in enumerate(line) if c in SEPARATORS]
    return list(zip(bars, bars[1:]))


def _join(pieces: list[tuple[str, bool]], junctions: list[str]) -> str:
    """Pieces of one cell or paragraph, top to bottom; (text, fills its room): a piece that fills its room
    goes on with the next without a space, as a folded word does, and the token across that junction is kept."""
    joined, glued = "", False
    for text, full in pieces:
        core = text.strip()
        if joined and glued and core:
            left = re.search(r"[A-Za-z0-9_.+\-/]*$", joined).group()
            right = re.match(r"[A-Za-z0-9_.+\-/]*", core).group()
            if left and right:
                junctions.append(left + ("\0" if left[-1] in "_/-" or right[0] == "." else "") + right)
        joined = core if not joined else joined + ("" if glued else " ") + core
        glued = full and bool(core)
    return joined


def streams(text: str, junctions: list[str] | None = None) -> list[str]:
    """Each table column and the plain lines, each as one string (see the module doc); the tokens that a
    glued junction made go to ``junctions``."""
    junctions = [] if junctions is None else junctions
    out: list[str] = []
    lines = text.splitlines()
    plain: list[tuple[str, bool]] = []
    index = 0
    while index < len(lines):
        if lines[index].strip()[:1] in SEPARATORS:
            block = []
            while index < len(lines) and lines[index].strip()[:1] in SEPARATORS:
                block.append(lines[index])
                index += 1
            shape = _cells(block[0])
            for start, end in shape:
                pieces = []
                for row in block:
                    if _cells(row) == shape:
                        body = row[start + 2:end - 1]  # the cell less its padding of one each side
                        pieces.append((body, len(body.rstrip()) == len(body)))
                out.append(_join(pieces, junctions))
            continue
        line = lines[index]
        if not set(line.strip()) & BORDERS:
            plain.append((line, len(line.rstrip()) >= WIDTH))
        index += 1
    out.append(_join(plain, junctions))
    return out


def split_tokens(args: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(lines wider than 80, watched tokens split across lines) of one command.

    A token is split when a glued junction at 80 columns makes a watched token of the 400-column output (two
    table rows that merely meet make a token the wide output does not have)."""
    narrow = run(WIDTH, *args)
    assert narrow.exit_code in (0, 1, 3), (args, narrow.output)
    wide = run(400, *args).output
    watched = {t for t in TOKEN.findall(wide) if is_watched(t)}
    too_wide = [line for line in narrow.output.splitlines() if len(line) > WIDTH]
    junctions: list[str] = []
    streams(narrow.output, junctions)
    split = set()
    for junction in junctions:
        at_boundary = "\0" in junction
        for token in TOKEN.findall(junction.replace("\0", "")):
            # An identifier may break where it has a boundary (after _ / -, before .); a backend name, a file
            # name or a number never breaks.
            if token in watched and (not at_boundary or token in BACKENDS or token.endswith(".safetensors")
                                     or NUMBER.match(token)):
                split.add(token)
    return too_wide, sorted(split)


def commands(name: str, tmp: pathlib.Path) -> list[tuple[str, ...]]:
    path = f"{FIXTURES}/{name}"
    out = [("replay", path), ("replay", path, "--full", "--explain"), ("map", path), ("info", path),
           ("info", "--check", path), ("window", path), ("attention", path), ("diff", path, path),
           ("report", path, "-o", str(tmp / "r.md"), "--force")]
    if name in ("prefix_page0.safetensors", "ts_causal_window.safetensors"):  # shrink needs a failure
        out.append(("shrink", path, "-o", str(tmp / "small.safetensors"), "--force"))
    if name in ("dflash.safetensors", "prefix_page0.safetensors"):  # the slowest two: on two fixtures
        out += [("poison", path), ("sweep", path, "--vary", "placement")]
    return out


@pytest.fixture
def short_tmp():
    """A directory whose paths fit a line: a path longer than 80 columns is printed whole on a line of its own
    (it must paste), which no layout can fit; pytest's own tmp_path is often that long."""
    import shutil
    import tempfile

    path = pathlib.Path(tempfile.mkdtemp(prefix="k80-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_every_table_command_reads_whole_at_80_columns(name, short_tmp):
    problems = []
    for args in commands(name, short_tmp):
        too_wide, split = split_tokens(args)
        if too_wide or split:
            problems.append(f"kvdbg {' '.join(args)}: wider than 80: {too_wide[:3]}; split: {split[:8]}")
    assert not problems, "\n".join(problems)


def test_directory_triage_and_explain_read_whole_at_80_columns(tmp_path):
    from tests.helpers import short_fixtures

    fixtures = short_fixtures()  # the triage's `$ kvdbg replay PATH` prints the path whole, as given
    results = tmp_path / "r.jsonl"
    problems = []
    for args in (("replay", fixtures), ("replay", fixtures, "--full"), ("explain",), ("explain", "live_page_zero"),
                 ("window", "--seq-len", "9000", "--window", "4096", "--query-len", "8", "--full")):
        too_wide, split = split_tokens(args)
        if too_wide or split:
            problems.append(f"kvdbg {' '.join(args)}: wider than 80: {too_wide[:3]}; split: {split[:8]}")
    run(WIDTH, "replay", fixtures, "--results", str(results))
    for args in (("triage", str(results)), ("triage", str(results), "--full")):
        too_wide, split = split_tokens(args)
        if too_wide or split:
            problems.append(f"kvdbg {' '.join(args)}: wider than 80: {too_wide[:3]}; split: {split[:8]}")
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_split_name_and_number():
    """The detector itself: a file name folded in a cell, a number cut at the end of a full line; two rows that
    merely meet, or a line that wraps at a space, are no split."""
    junctions: list[str] = []
    streams("┃ file      ┃ max abs ┃\n│ dflash.sa │ 1.0     │\n│ fetensors │         │\n", junctions)
    assert "dflash.safetensors" in junctions
    junctions = []
    streams("x" * 72 + " 7.81e-0\n3 rest\n", junctions)
    assert junctions == ["7.81e-03"]
    junctions = []  # a break at an underscore is marked as such
    streams("│ seq_len_over_ │\n│ max_kv_len    │\n", junctions)
    assert junctions == ["seq_len_over_\0max_kv_len"]
    junctions = []
    streams("x" * 60 + " 7.81e-03\nrest\n│ bfloat16 │\n│ int32    │\n", junctions)
    assert junctions == ["bfloat16int32"]  # a token no wide output holds: split_tokens ignores it


def test_words_break_at_their_boundaries_and_numbers_never():
    from kvdbg.render.fit import word_pieces

    assert word_pieces("causal_gqa.safetensors", 12) == ["causal_gqa", ".safetensors"]
    assert word_pieces("_validate_decode_run_metadata_values", 16) == ["_validate_", "decode_run_",
                                                                         "metadata_values"]
    assert word_pieces("/tmp/captures/layer-7/x.safetensors", 14) == ["/tmp/captures/", "layer-7/x",
                                                                       ".safetensors"]
    assert word_pieces("2.36e-01", 4) == ["2.36e-01"] and word_pieces("flex", 2) == ["flex"[:2], "ex"]


def test_a_narrow_text_column_keeps_names_whole_and_breaks_long_ones_at_boundaries():
    import io

    from rich.console import Console

    from kvdbg.render.fit import Column, FitTable

    table = FitTable([Column("backend", priority=10), Column("kernel", priority=9), Column("note", priority=8)])
    table.add_row("flashinfer_ts", "flex_attention (eager)", "x " * 40)
    table.add_row("vllm_flex", "_validate_decode_run_metadata_values failed", "y")
    console = Console(record=True, width=40, file=io.StringIO(), color_system=None)
    console.print(table)
    text = console.export_text()
    assert all(len(line) <= 40 for line in text.splitlines())
    lines = [line.split("│")[1:3] for line in text.splitlines() if line.startswith("│")]
    assert any(cells[0].strip() == "flashinfer_ts" for cells in lines)  # whole, not flashinfer_t / s
    assert any(cells[1].strip() == "flex_attention" for cells in lines)
    kernel = [cells[1].strip() for cells in lines if cells[1].strip()]
    assert ["_validate_decode_", "run_metadata_values", "failed"] == kernel[-3:]  # broken after an underscore
