"""`kvdbg info`: header-only summary, JSON twin, and no torch at start-up."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

from kvdbg.cli import cli
from tests.helpers import FIXTURES, run_python


def test_info_table_shows_layer_backend_lengths_and_sizes():
    path = os.path.join(FIXTURES, "dflash.safetensors")
    result = CliRunner().invoke(cli, ["info", path], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Hq 4 / Hkv 1 (group 4), head_size 64" in out
    assert "dense (non-causal), sliding window 4096" in out
    assert "FLASHINFER_TS: page_size 16" in out
    assert "626 stored pages" in out
    assert "9000" in out and "1000" in out


def test_info_json_matches_the_snapshot():
    path = os.path.join(FIXTURES, "prefix_page0.safetensors")
    result = CliRunner().invoke(cli, ["info", path, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["num_steps"] == 2
    assert data["kv_layout"] == "2,pages,tokens,heads,dim"
    assert [r["seq_len"] for r in data["steps"][0]["requests"]] == [100, 120, 150]
    assert [r["seq_len"] for r in data["steps"][1]["requests"]] == [101, 121, 151]
    assert data["stored_pages"] * data["page_bytes"] == data["referenced_page_bytes"]
    assert data["file_size"] == os.path.getsize(path)
    assert data["overhead_bytes"] < 64 * 1024
    assert data["capture"]["engine"] == "kvdbg synth"


def test_info_check_validates_values_of_a_good_file():
    path = os.path.join(FIXTURES, "fp8_dense.safetensors")
    result = CliRunner().invoke(cli, ["info", path, "--check", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["layer"]["kv_cache_dtype"] == "fp8_e4m3"


def test_help_and_info_do_not_import_torch():
    path = os.path.join(FIXTURES, "causal_gqa.safetensors")
    code = f"""
import sys, runpy
for argv in (["kvdbg", "--help"], ["kvdbg", "info", {path!r}, "--json"], ["kvdbg", "synth", "--help"]):
    sys.argv = argv
    try:
        runpy.run_module("kvdbg", run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
print("HEAVY=" + ",".join(m for m in ("torch", "numpy", "flashinfer", "vllm") if m in sys.modules))
"""
    out = run_python(code)
    assert out.strip().splitlines()[-1] == "HEAVY=", out[-300:]


def test_version_and_module_entry_point():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and "kvdbg, version" in result.output
    assert "Usage" in run_python("import runpy, sys; sys.argv=['kvdbg','--help']\ntry:\n runpy.run_module('kvdbg', run_name='__main__')\nexcept SystemExit: pass")


def test_info_prints_user_text_verbatim(tmp_path):
    """Notes and names are data: rich markup or emoji codes in them are printed as written."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    notes = "[bold]kept[/bold] :smile: [red]"
    path = str(tmp_path / "notes.safetensors")
    save_snapshot(synth_snapshot(SynthSpec(notes=notes)), path)
    result = CliRunner().invoke(cli, ["info", path], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert notes in result.output


def test_info_check_counts_its_errors_in_the_verdict():
    res = CliRunner().invoke(cli, ["info", os.path.join(FIXTURES, "prefix_page0.safetensors"), "--check", "--json"])
    data = json.loads(res.output)
    assert res.exit_code == 1 and data["check_errors"]
    assert data["verdict"]["error_findings"] == len(data["check_errors"])  # map's count, not lost on the way


def test_info_check_without_torch_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch in this environment')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    path = os.path.join(FIXTURES, "causal_gqa.safetensors")
    done = subprocess.run([sys.executable, "-m", "kvdbg", "info", path, "--check"], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("Error: --check reads the pages with torch") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    plain = subprocess.run([sys.executable, "-m", "kvdbg", "info", path], env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr  # the header alone needs no torch
