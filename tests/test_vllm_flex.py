"""The vllm_flex column where vLLM is absent (this suite's venv): it says why, and nothing else changes.

Where vLLM is installed the engine stage runs vLLM's own code through this column
(tests/engine/vllm_flex_differential.py).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner

from kvdbg.backends import vllm_flex
from kvdbg.cli import cli
from kvdbg.fixtures_path import fixture_path

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                                reason="vLLM is installed here: the engine stage checks the column that runs")


def test_without_vllm_the_column_says_why_and_the_exit_code_is_unchanged():
    res = CliRunner().invoke(cli, ["replay", fixture_path("causal_gqa.safetensors"), "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    data = json.loads(res.output)
    status = {b["name"]: b for b in data["backends"]}["vllm_flex"]
    assert not status["available"] and "vLLM is not installed" in status["reason"]
    assert not any(c["actual"] == "vllm_flex" for c in data["comparisons"])
    assert vllm_flex.vllm_version() is None


def test_asking_for_vllm_flex_without_vllm_is_one_line_exit_2():
    res = CliRunner().invoke(cli, ["replay", fixture_path("causal_gqa.safetensors"), "--backend", "vllm_flex"])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: backend vllm_flex cannot run: vLLM is not installed")


@pytest.mark.parametrize("num_pages, null_page, want, blocks, added", [
    (4, None, [1, 2, 3, 4], 5, True),  # page 0 not stored: an empty null block is put at index 0
    (4, 0, [0, 1, 2, 3], 4, False),
    (4, 2, [1, 2, 0, 3], 4, False),  # wherever page 0 is stored, vLLM sees it at index 0
])
def test_stored_pages_are_renumbered_keeping_the_null_block_at_zero(num_pages, null_page, want, blocks, added):
    new_index, num_blocks, added_null = vllm_flex._renumber(num_pages, null_page, torch.device("cpu"))
    assert new_index.tolist() == want and num_blocks == blocks and added_null == added
