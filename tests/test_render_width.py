"""Every command's output at 60, 80 and 120 columns on every bundled fixture: no number is ever cut.

A number cut by the layout ends in an ellipsis (``0.00…``, ``1476…``); a table
that does not fit leaves whole columns out instead, and says which.
"""

from __future__ import annotations

import io
import pathlib
import re

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvdbg.cli import cli

from tests.helpers import FIXTURES as _FIXTURES

FIXTURES = pathlib.Path(_FIXTURES)

WIDTHS = (60, 80, 120)
FIXTURE_FILES = sorted(p.name for p in FIXTURES.glob("*.safetensors"))
# A digit or a decimal point right before an ellipsis: a number rich cut to fit.
CUT_NUMBER = re.compile(r"[0-9.]…")
# rich's default box: the character a table's line starts with, and the one it must end with.
BOX_CLOSES = {"┏": "┓", "┃": "┃", "┡": "┩", "│": "│", "└": "┘", "┌": "┐", "┣": "┫", "├": "┤"}


def assert_uncut(text: str, width: int) -> None:
    cut = [line for line in text.splitlines() if CUT_NUMBER.search(line)]
    assert not cut, f"numbers cut at {width} columns:\n" + "\n".join(cut)
    too_wide = [line for line in text.splitlines() if len(line.rstrip()) > width]
    assert not too_wide, f"lines wider than {width} columns:\n" + "\n".join(too_wide)
    # rich crops a table wider than the console at its width: a row that starts a box and does not close it.
    cropped = [line for line in text.splitlines()
               if line.strip() and line.lstrip()[0] in BOX_CLOSES and line.rstrip()[-1] != BOX_CLOSES[line.lstrip()[0]]]
    assert not cropped, f"tables cropped at {width} columns:\n" + "\n".join(cropped)


def render(renderable, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def run_cli(width: int, *args: str):
    return CliRunner().invoke(cli, list(args), env={"COLUMNS": str(width), "NO_COLOR": "1"}, catch_exceptions=False)


@pytest.fixture(scope="module")
def replays():
    """Each fixture replayed once through every backend (the slow part), rendered at every width below."""
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.replayer.runner import replay
    from kvdbg.snapshot.store import load_snapshot

    return {name: replay(load_snapshot(FIXTURES / name), None, ReplayOptions(device="cpu")).judge()
            for name in FIXTURE_FILES}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_replay_numbers_are_never_cut(replays, name, width):
    from kvdbg.render.replay import render_replay

    report = replays[name]
    comparisons, verdict = report.comparisons, report.verdict
    text = render(render_replay(report, explain=True), width)
    assert_uncut(text, width)
    # The numbers that answer "how far from the truth" are there in full: each comparison's
    # worst error, and the worst head's row, in three significant digits.
    for comp in comparisons:
        if comp.max_abs == comp.max_abs and comp.max_abs > 0:
            assert f"{comp.max_abs:.2e}" in text
    # The verdict is the last thing printed (wrapped at 60 or 80 columns, as any long line).
    assert " ".join(text.split()).endswith(" ".join(f"{verdict.summary} (exit {verdict.exit_code})".split()))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_map_info_window_numbers_are_never_cut(name, width):
    path = str(FIXTURES / name)
    for args in (["map", path], ["info", path], ["info", "--check", path], ["window", path]):
        res = run_cli(width, *args)
        assert res.exit_code in (0, 1), res.output
        assert_uncut(res.output, width)
        assert re.search(r"\(exit [01]\)$", res.output.rstrip().splitlines()[-1]), args


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("args", [
    ("--seq-len", "9000", "--window", "4096", "--query-len", "8"),
    ("--seq-len", "9000", "--window", "4096", "--query-len", "8", "--mask", "causal", "--full"),
    ("--seq-len", "2000000000", "--window", "4096", "--query-len", "8", "--max-model-len", "2000000000"),
    ("--seq-len", "9000", "--window", "4096", "--page-size", "100000"),
])
def test_window_numbers_are_never_cut(args, width):
    res = run_cli(width, "window", *args)
    assert res.exit_code in (0, 1), res.output
    assert_uncut(res.output, width)
    assert "(exit " in res.output.rstrip().splitlines()[-1]


@pytest.fixture(scope="module")
def poisoned():
    """dflash poisoned through flex and flashinfer_ts (a finding with culprits), prefix_page0 (two steps)."""
    from kvdbg.moves.poisoner import poison
    from kvdbg.snapshot.store import load_snapshot

    return [poison(load_snapshot(FIXTURES / "dflash.safetensors"), ["flex", "flashinfer_ts"]),
            poison(load_snapshot(FIXTURES / "prefix_page0.safetensors"), ["reference", "flashinfer_ts"])]


@pytest.mark.parametrize("width", WIDTHS)
def test_poison_numbers_are_never_cut(poisoned, width):
    from kvdbg.cli.poison import poison_verdict
    from kvdbg.render.poison import render_poison
    from kvdbg.render.util import verdict_line

    for result in poisoned:
        text = render(render_poison(result), width) + render(verdict_line(poison_verdict(result)), width)
        assert_uncut(text, width)
        assert "(exit " in text.rstrip().splitlines()[-1]
    text = " ".join(render(render_poison(poisoned[0]), width).split())
    assert "4897" in text and "request 0 key 4896" in text


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_report_svg_tables_are_never_cut(replays, name, width):
    """`report` is Markdown (no width); its SVGs are the tables drawn at a width: the same rule holds."""
    from kvdbg.render.info import render_info
    from kvdbg.render.pagemap import render_page_map
    from kvdbg.snapshot.pagemap import page_map
    from kvdbg.snapshot.store import load_snapshot
    from kvdbg.snapshot.info import summarize

    snap = load_snapshot(FIXTURES / name)
    text = render(render_info(summarize(FIXTURES / name)), width)
    text += "".join(render(render_page_map(page_map(snap, step=s)), width) for s in range(len(snap.steps)))
    assert_uncut(text, width)


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    """shrink on each failing fixture (prefix_page0, ts_causal_window), run once."""
    from kvdbg.moves.shrinker import shrink
    from kvdbg.snapshot.store import load_snapshot

    out = {}
    for name in ("prefix_page0.safetensors", "ts_causal_window.safetensors"):
        target = tmp_path_factory.mktemp("shrink") / name
        out[name] = shrink(load_snapshot(FIXTURES / name), None, output_path=str(target))
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["prefix_page0.safetensors", "ts_causal_window.safetensors"])
def test_shrink_numbers_are_never_cut(shrunk, name, width):
    from kvdbg.render.shrink import render_shrink

    assert_uncut(render(render_shrink(shrunk[name]), width), width)


def test_piped_output_is_laid_out_for_80_columns(monkeypatch):
    """With no terminal and no COLUMNS, output is 80 columns wide, so `| less` reads whole on any screen."""
    from kvdbg.cli.common import PIPED_WIDTH, output_width

    monkeypatch.delenv("COLUMNS", raising=False)
    assert output_width() == PIPED_WIDTH == 80
    res = CliRunner().invoke(cli, ["window", "--seq-len", "9000", "--window", "4096", "--query-len", "8"],
                             env={"COLUMNS": None}, catch_exceptions=False)
    widths = [len(line) for line in res.output.splitlines()]
    assert max(widths) <= 80 and max(widths) >= 70  # laid out at 80, not 120


def test_fit_table_drops_the_least_important_column_and_names_it():
    from kvdbg.render.fit import Column, FitTable

    table = FitTable([Column("name", priority=10), Column("max abs", whole=True, priority=9),
                      Column("cosine", whole=True, priority=3), Column("note", priority=5)], title="t")
    table.add_row("reference", "7.81e-03", "0.999998", "a long explanation that wraps over several lines")
    wide, narrow = render(table, 120), render(table, 40)
    assert "0.999998" in wide and "hidden at" not in wide
    assert "7.81e-03" in narrow and "0.999998" not in narrow
    assert "hidden at 40 columns: cosine" in " ".join(narrow.split())
    assert_uncut(narrow, 40)


def test_a_table_of_rank_rows_is_never_cropped():
    """The replay DIR table with its ranks column, at the widths where rich's own squeeze left it a column wide."""
    from rich.text import Text

    from kvdbg.render.fit import Column, FitTable

    table = FitTable([Column("file", priority=10, min_width=14), Column("layer", whole=True, justify="left"),
                      Column("step", whole=True, justify="left"), Column("ranks", whole=True, justify="left"),
                      Column("verdict", whole=True, justify="left", priority=9),
                      Column("worst backend / why", priority=8), Column("max abs", whole=True, priority=7)])
    table.add_row("model.layers.11.self_attn.attn-step123-rank0-0000.safetensors", "layers.0", "0", "0-7",
                  Text("PASS"), "captured", "1.91e-03")
    for width in (60, 70, 79, 80, 81, 120):
        text = render(table, width)
        assert_uncut(text, width)
        assert "1.91e-03" in text and "captured" in text
