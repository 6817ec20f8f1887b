"""No write replaces one of the command's inputs, --force or not; outputs beside them are replaced as asked."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from kvdbg.util.atomic import inputs_protected, write_text_atomic
from kvdbg.cli import cli
from kvdbg.errors import OptionError
from tests.helpers import FIXTURES

FIXTURE = os.path.join(FIXTURES, "dflash.safetensors")


def digest(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@pytest.mark.parametrize("args", [
    ["report", "{s}", "-o", "{s}", "--backend", "flex"],
    ["report", "{s}", "--html", "{s}", "--backend", "flex"],
    ["replay", "{s}", "--backend", "flex", "-o", "{s}"],
    ["replay", "{s}", "--backend", "flex", "--picture", "--svg", "{s}"],
    ["window", "{s}", "--picture", "--svg", "{s}"],
    ["attention", "{s}", "--svg", "{s}"],
    ["replay", "{d}", "--backend", "reference", "--results", "{s}"],
], ids=["report-o", "report-html", "replay-o", "replay-svg", "window-svg", "attention-svg", "replay-dir-results"])
@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
def test_an_input_is_never_replaced(tmp_path, args, force):
    snapshot = tmp_path / "in.safetensors"
    shutil.copy(FIXTURE, snapshot)
    before = digest(snapshot)
    argv = [a.format(s=snapshot, d=tmp_path) for a in args] + (["--force"] if force else [])
    res = CliRunner().invoke(cli, argv, catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "is an input of this command" in res.output and len(res.output.strip().splitlines()) == 1
    assert digest(snapshot) == before
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]  # no temporary file left beside it


@pytest.mark.parametrize("args", [
    ["report", "{s}", "-o", "{o}", "--html", "{o}"],
    ["report", "{s}", "-o", "{d}/map.svg", "--svg", "{d}"],
    ["replay", "{s}", "-o", "{o}", "--picture", "--svg", "{o}"],
    ["window", "{s}", "--svg", "{o}", "--png", "{o}"],
    ["attention", "{s}", "--svg", "{o}", "--png", "{d}/./out"],
], ids=["report-o-html", "report-o-svg-dir", "replay-o-svg", "window-svg-png", "attention-svg-png"])
@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
def test_two_outputs_of_one_command_never_name_one_file(tmp_path, args, force):
    """With --force the second replaced the first; without, it was refused after the first was written."""
    snapshot = tmp_path / "in.safetensors"
    shutil.copy(FIXTURE, snapshot)
    argv = [a.format(s=snapshot, d=tmp_path, o=tmp_path / "out") for a in args] + (["--force"] if force else [])
    res = CliRunner().invoke(cli, argv, catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "writes too; give each output its own name" in res.output and len(res.output.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]  # nothing written


def test_an_output_beside_the_inputs_is_replaced_with_force(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "in.safetensors")
    results = tmp_path / "results.jsonl"
    results.write_text("old\n")
    res = CliRunner().invoke(cli, ["replay", str(tmp_path), "--backend", "reference", "--results", str(results),
                                   "--force"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert results.read_text() != "old\n"


def test_the_protection_ends_with_the_command_and_follows_links(tmp_path):
    target = tmp_path / "in.safetensors"
    shutil.copy(FIXTURE, target)
    link = tmp_path / "link.txt"
    os.symlink(target, link)
    with inputs_protected([str(target)]):
        with pytest.raises(OptionError, match="is an input of this command"):
            write_text_atomic(link, "x", overwrite=True)
    write_text_atomic(tmp_path / "other.txt", "x")
    with inputs_protected([str(tmp_path)]):  # a directory: its snapshots, at any depth, are inputs
        (tmp_path / "sub").mkdir()
        nested = tmp_path / "sub" / "b.safetensors"
        shutil.copy(FIXTURE, nested)
        with pytest.raises(OptionError, match="is an input"):
            write_text_atomic(nested, "x", overwrite=True)
        write_text_atomic(tmp_path / "other.txt", "y", overwrite=True)  # not a snapshot: an output
    write_text_atomic(nested, "x", overwrite=True)  # outside the command: the library's caller decides
    assert (tmp_path / "other.txt").read_text() == "y"
