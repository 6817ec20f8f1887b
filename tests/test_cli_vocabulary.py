"""One option vocabulary across subcommands (kvdbg/cli/common.py), and help that reads whole in 80 columns."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from click.testing import CliRunner

from kvdbg.cli import COMMANDS, cli
from kvdbg.cli.common import Indices, progress_printer, within
from kvdbg.errors import OptionError
from kvdbg.util.ranges import parse_ranges

from tests.helpers import FIXTURES, ROOT


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "120", "NO_COLOR": "1"})


def one_line_error(res, needle: str) -> str:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert needle in lines[0], lines[0]
    return lines[0]


def help_text(*command: str) -> str:
    # A wide terminal: help must still be laid out for 80 columns.
    res = CliRunner().invoke(cli, [*command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("command", [(), *[(name,) for name in sorted(COMMANDS)]])
def test_every_help_fits_80_columns(command):
    text = help_text(*command)
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, wide


HIDDEN = {"replay": ["--heads", "--save-outputs", "--explain"], "synth": ["--head-dim", "[OUT]", "--seq-lens",
                                                                          "--query-lens"],
          "report": ["--sweep", "--svg "], "merge": ["--kv-heads"]}
# What each old spelling is now: shown in its command's --help instead.
NOW = {"--explain": "--builder", "--seq-lens": "--seq-len", "--query-lens": "--query-len", "--sweep": "--vary",
       "--svg ": "--svg-dir DIR", "--kv-heads": "--num-kv-heads"}


@pytest.mark.parametrize("command", sorted(HIDDEN))
def test_old_spellings_are_not_shown(command):
    text = help_text(command)
    for old in HIDDEN[command]:
        assert old not in text
        if old in NOW:
            assert NOW[old] in text, (command, NOW[old])


def test_old_spellings_still_work(tmp_path):
    """Scripts written with the earlier spellings get what the new ones give."""
    dflash = FIXTURES + "/dflash.safetensors"
    old = json.loads(invoke("replay", dflash, "--backend", "flex", "--explain", "--json").output)
    new = json.loads(invoke("replay", dflash, "--backend", "flex", "--builder", "--json").output)
    assert old["verdict"] == new["verdict"] and "explain" in json.dumps(new)
    for flag in ("--seq-lens", "--seq-len"):
        out = tmp_path / f"{flag}.safetensors"
        res = invoke("synth", "-o", out, flag, "40,70", "--query-lens", "2,3")
        assert res.exit_code == 0, res.output
    ragged = tmp_path / "ragged.safetensors"
    assert invoke("synth", "-o", ragged, "--seq-len", "40,70", "--query-len", "2,3").exit_code == 0
    assert (tmp_path / "--seq-lens.safetensors").read_bytes() == (tmp_path / "--seq-len.safetensors").read_bytes() \
        == ragged.read_bytes()
    uniform = tmp_path / "uniform.safetensors"
    assert invoke("synth", "-o", uniform, "--seq-len", "40,70", "--query-len", "2").exit_code == 0
    assert uniform.read_bytes() != ragged.read_bytes()  # so the list really gave the ragged lengths
    # --kv-heads and --num-kv-heads reach the same parameter: both are checked as the layer's KV heads
    for flag in ("--kv-heads", "--num-kv-heads"):
        res = invoke("merge", dflash, "-o", tmp_path / "m.safetensors", flag, "0")
        one_line_error(res, "--num-kv-heads")
    res = invoke("report", dflash, "--sweep", "nosuch")
    one_line_error(res, "--vary")
    svg = tmp_path / "svg"
    for flag in ("--svg", "--svg-dir"):
        res = invoke("report", FIXTURES + "/causal_gqa.safetensors", "--backend", "reference", "-o",
                     tmp_path / f"r{flag}.md", flag, svg, "--force")
        assert res.exit_code == 0, res.output
    assert (svg / "replay.svg").exists()


def test_the_same_option_reads_the_same_everywhere():
    """Each shared option is declared by one factory: its metavar is the same in every command's help."""
    metavars = {"--backend": "NAME", "--device": "DEVICE", "--output": "FILE"}
    for name in sorted(COMMANDS):
        text = help_text(name).split("\nOptions:\n", 1)[1]  # the option list, not the examples
        for option, metavar in metavars.items():
            for line in text.splitlines():
                match = re.search(rf"{option} (\S+)", line)
                if match and line.lstrip().startswith(("-", option)):
                    assert match.group(1) == metavar, (name, line)


@pytest.mark.parametrize("args, needle", [
    (("map", FIXTURES + "/prefix_page0.safetensors", "--step", "0-1"),
     "--step 0-1: map shows one step (give one index, not a range)"),
    (("window", FIXTURES + "/dflash.safetensors", "--request", "0,1"),
     "--request 0,1: window analyses one request of SNAPSHOT (give one index, not a range)"),
    (("shrink", FIXTURES + "/prefix_page0.safetensors", "-o", "/tmp/never.safetensors", "--backend", "flex",
      "--backend", "flashinfer_ts"), "--backend flex,flashinfer_ts: shrink keeps one backend's failure"),
    (("poison", FIXTURES + "/dflash.safetensors", "--device", "tpu"), "--device must be cpu, cuda, cuda:N or auto"),
    (("map", FIXTURES + "/prefix_page0.safetensors", "--request", "x"),
     "Invalid value for '--request': 'x' is not a number or a range"),
    (("replay", FIXTURES + "/causal_gqa.safetensors", "--heads", "x"),
     "Invalid value for '--head': 'x' is not a number"),
])
def test_one_value_options_refuse_more(args, needle):
    one_line_error(invoke(*args), needle)


def test_cuda_n_is_an_accepted_spelling():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: cuda:N would run")
    res = invoke("replay", FIXTURES + "/causal_gqa.safetensors", "--backend", "reference", "--device", "cuda:1")
    # Parsed as a device (not refused as a spelling); refused because this machine has no CUDA.
    one_line_error(res, "--device cuda:1: ")


def test_map_request_takes_a_range():
    data = json.loads(invoke("map", FIXTURES + "/prefix_page0.safetensors", "--request", "0-1", "--json").output)
    assert [r["request"] for r in data["requests"]] == [0, 1]
    # the anomalies shown are those of the requests shown
    assert all({0, 1} & set(a["requests"]) for a in data["anomalies"])
    one = json.loads(invoke("map", FIXTURES + "/prefix_page0.safetensors", "--request", "2", "--json").output)
    assert [r["request"] for r in one["requests"]] == [2]


def test_selectors_parse_with_the_one_range_grammar():
    import click

    @click.command()
    @click.option("--step", type=Indices())
    @click.option("--one", type=Indices(one="takes one"))
    def command(step, one):
        click.echo(f"{step}|{one}")

    res = CliRunner().invoke(command, ["--step", " 5, 1-2 ,5", "--one", "3"])
    assert res.output.strip() == "1-2,5|3"
    assert within(parse_ranges("1-2,5", "--step"), 6, "--step", "six") == [1, 2, 5]
    assert within(parse_ranges("4-", "--step"), 6, "--step", "six") == [4, 5]
    assert within(None, 6, "--step", "six") is None
    with pytest.raises(OptionError, match="--step 9 is out of range: six"):
        within(parse_ranges("0,9", "--step"), 6, "--step", "six")
    res = CliRunner().invoke(command, ["--one", "2-4"])
    assert res.exit_code == 2 and "--one 2-4: takes one (give one index, not a range)" in res.output


def test_progress_is_silent_without_a_terminal():
    # pytest captures stderr: not a terminal, so no progress printer at all.
    assert progress_printer("replaying") is None


# The names of the project's own history say nothing to a user: none in product code, docs or help.
HISTORY = re.compile(r"seed[- ]?(era|000|004)|LAYOUT_SEED|layout seed", re.IGNORECASE)


def test_no_history_names_in_product_code_docs_or_help():
    paths = ["kvdbg", "backends", "docs", "README.md", os.path.join("fixtures", "README.md"),
             os.path.join("fixtures", "regenerate.sh")]
    files = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert files
    hits = []
    for name in files:
        if name.endswith((".py", ".md", ".sh", ".txt", ".toml")):
            with open(os.path.join(ROOT, name), encoding="utf-8") as handle:
                hits += [f"{name}: {line.strip()}" for line in handle if HISTORY.search(line)]
    for command in [(), *[(name,) for name in sorted(COMMANDS)]]:
        hits += [f"{' '.join(command)} --help: {line}" for line in help_text(*command).splitlines()
                 if HISTORY.search(line)]
    assert not hits, hits


def test_help_groups_every_command_once_by_what_a_user_is_doing_with_an_example():
    from kvdbg.cli import COMMANDS, GROUPS

    grouped = [name for _, rows in GROUPS for name, _, _ in rows]
    assert sorted(grouped) == sorted(COMMANDS) and len(grouped) == len(set(grouped))
    text = CliRunner().invoke(cli, ["--help"], terminal_width=80).output
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.index("Start here") < text.index("Look:") < text.index("Dig into a failure:")
    for title, rows in GROUPS:
        assert f"{title}:" in text
        for name, what, example in rows:
            assert f"  {name:<11}{what}" in text and example in text and example.startswith(f"kvdbg {name} ")


def test_one_set_of_verdict_words():
    """A verdict starts with the word of its exit code, and nothing else: no OK, SAME/DIFFER or DONE."""
    from kvdbg.judge.verdict import Verdict, simple_verdict

    for status, code, summary in (("pass", 0, "OK: header read"), ("pass", 0, "SAME: outputs agree"),
                                  ("fail", 1, "DIFFER: outputs differ"), ("pass", 0, "DONE: shrunk"),
                                  ("fail", 0, "PASS: a status that is not its word's")):
        with pytest.raises(ValueError):
            simple_verdict(status, code, summary)
    assert Verdict("unverified", 3, 0, 0, 0, "NOTHING VERIFIED: x").exit_code == 3
    causal = FIXTURES + "/causal_gqa.safetensors"
    res = invoke("info", causal)
    assert res.exit_code == 0 and res.output.rstrip().splitlines()[-1].startswith("PASS: header read")
    res = invoke("diff", causal, causal, "--json")
    verdict = json.loads(res.output)["verdict"]
    assert res.exit_code == 0 and verdict["summary"].startswith("PASS: outputs agree within tolerance")
