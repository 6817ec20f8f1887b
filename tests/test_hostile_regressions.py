"""Inputs the fuzzer (tests/fuzz) found: each one must end in exit 0/1 or one "Error: " line, quickly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from tests.helpers import FIXTURES, write_raw


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "120"})


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_replay_huge_head_range_is_an_option_error():
    path = os.path.join(FIXTURES, "fp8_dense.safetensors")
    assert_one_line_error(invoke("replay", path, "--backend", "reference", "--heads", "0-100000000000"),
                          "--heads 100000000000 is out of range")
    assert_one_line_error(invoke("replay", path, "--backend", "reference", "--request", "0-100000000000"),
                          "--request 100000000000 is out of range")


def test_window_huge_query_len_is_an_option_error():
    assert_one_line_error(invoke("window", "--seq-len", 2**31, "--query-len", 10**9, "--full"),
                          "--query-len 1000000000 is over 4096")
    assert invoke("window", "--seq-len", 9000, "--window", 4096, "--query-len", 4096).exit_code in (0, 1)
