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


def test_control_characters_in_a_file_name_are_written_out(tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    shutil.copy(FIXTURE, directory / "x\x1b[41mRED\x1b[0m.safetensors")
    out = run("replay", str(directory), "--backend", "reference")
    assert_shown_not_acted_on(out)
    assert "x\\x1b[41mRED" in out.replace("\n", "").replace("│", "").replace(" ", "")


def test_an_error_naming_a_hostile_path_is_one_line_without_escapes(tmp_path):
    out = run("info", str(tmp_path / "no\x1b[2Jsuch.safetensors"))
    assert "\x1b" not in out and "no\\x1b[2Jsuch" in out and len(out.strip().splitlines()) == 1
