"""A snapshot's text (names, notes) and a directory's file names are shown, never acted on by the terminal."""

from __future__ import annotations

import json
import os
import shutil

from click.testing import CliRunner
from safetensors import safe_open

from kvdbg.cli import cli
from tests.helpers import FIXTURES, write_raw
from tests.test_render_width import assert_uncut

FIXTURE = os.path.join(FIXTURES, "causal_gqa.safetensors")
HOSTILE = "evil\x1b]0;PWNED\x07\x1b[31mRED\x1b[0m\x9b2J"


def renamed(path, name: str) -> str:
    with safe_open(FIXTURE, "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(metadata["kvdbg.meta"])
    meta["layer"]["name"] = name
    return write_raw(str(path), tensors, meta, fmt=metadata["kvdbg.format"])


def run(*args: str) -> str:
    res = CliRunner(env={"NO_COLOR": "1", "COLUMNS": "80"}).invoke(cli, list(args), catch_exceptions=False)
    return res.output


def assert_shown_not_acted_on(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert_uncut(text, 80)  # laid out as shown: every box closes within 80 columns


def test_control_characters_in_a_layer_name_are_written_out(tmp_path):
    path = renamed(tmp_path / "s.safetensors", HOSTILE)
    for command in (["info", path], ["map", path], ["replay", path, "--backend", "reference"]):
        out = run(*command)
        assert_shown_not_acted_on(out)
    assert "evil\\x1b]0;PWNED\\x07\\x1b[31mRED" in run("info", path)
    report = tmp_path / "r.md"
    run("report", path, "--backend", "reference", "-o", str(report))
    assert "\x1b" not in report.read_text() and "evil\\x1b]0;PWNED" in report.read_text()


def test_invisible_formatting_is_written_out_and_tables_keep_their_width(tmp_path):
    """A right-to-left override can turn the rest of a line around, and it and the line separator take no
    column: shown raw, they made rows 82 characters wide at 80 columns."""
    path = renamed(tmp_path / "s.safetensors", "a \u202eRLO b \u2028ls c")
    out = run("info", path)
    assert "\u202e" not in out and "\u2028" not in out and "a \\u202eRLO b \\u2028ls c" in out
    assert_uncut(out, 80)


def test_the_html_report_writes_controls_out_and_quotes_its_check_line(tmp_path):
    path = renamed(tmp_path / "it's.safetensors", HOSTILE + "\u202e")
    page = tmp_path / "r.html"
    run("report", path, "--backend", "reference", "-o", str(tmp_path / "r.md"), "--html", str(page))
    text = page.read_text()
    assert not {c for c in text if ord(c) < 32 and c not in "\n\t" or c in "\x9b\u202e"}
    assert "evil\\x1b]0;PWNED" in text
    # The check line is shell-quoted as the Markdown report's: the name's quote does not end the string.
    import html
    import shlex

    check = next(line for line in html.unescape(text).splitlines() if "sha256sum -c" in line)
    words = shlex.split(check.rsplit(">", 1)[-1].split("|")[0])  # the line opens the page's <pre> block
    assert words[0] == "echo" and words[1].endswith("  it's.safetensors")


def test_control_characters_in_a_file_name_are_written_out(tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    shutil.copy(FIXTURE, directory / "x\x1b[41mRED\x1b[0m.safetensors")
    out = run("replay", str(directory), "--backend", "reference", "--full")
    assert_shown_not_acted_on(out)
    assert_shown_not_acted_on(run("replay", str(directory), "--backend", "reference"))
    assert "x\\x1b[41mRED" in out.replace("\n", "").replace("│", "").replace(" ", "")


def test_an_error_naming_a_hostile_path_is_one_line_without_escapes(tmp_path):
    out = run("info", str(tmp_path / "no\x1b[2Jsuch.safetensors"))
    assert "\x1b" not in out and "no\\x1b[2Jsuch" in out and len(out.strip().splitlines()) == 1
