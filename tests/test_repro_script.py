"""`kvdbg shrink --emit-script`: a standalone script (torch + safetensors only) that reproduces a mismatch."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from kvdbg.backends.base import ReplayOptions
from kvdbg.backends import get_backend
from kvdbg.cli import cli
from kvdbg.replayer.runner import common_metadata
from kvdbg.moves.repro_script import emit_repro_script, script_text
from kvdbg.snapshot.store import load_snapshot

from tests.helpers import FIXTURES, assert_close_ulps

# Runs a script with kvdbg made unimportable: any `import kvdbg` in it raises ImportError.
NO_KVDBG = ("import sys, runpy; sys.modules['kvdbg'] = None; sys.argv = [sys.argv[1]] + sys.argv[2:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")


def run_isolated(script, *args, cwd=None):
    """The script in an isolated interpreter (-I: no PYTHONPATH, no user site, no cwd on the path), kvdbg blocked."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([sys.executable, "-I", "-c", NO_KVDBG, str(script), *args], capture_output=True,
                          text=True, cwd=cwd or os.path.dirname(str(script)), env=env, timeout=600)


def fixture(name):
    return os.path.join(FIXTURES, name)


def test_shrunk_prefix_page0_script_reproduces_without_kvdbg(tmp_path):
    script = tmp_path / "repro.py"
    res = CliRunner().invoke(cli, ["shrink", fixture("prefix_page0.safetensors"), "-o", str(tmp_path / "s.safetensors"),
                                   "--emit-script", str(script), "--json"], catch_exceptions=False)
    assert res.exit_code == 1, res.output  # the snapshot's verdict (FAIL), as replay gives it
    record = json.loads(res.output)["script"]
    assert record["embedded"] and record["data_file"] is None and record["backend"] == "flex"
    assert record["verified_exit"] == 1 and record["reproduces"] is True
    text = script.read_text()
    assert not [line for line in text.splitlines() if "kvdbg" in line and "import" in line.split("#")[0].split()]
    done = run_isolated(script)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "REPRODUCED: 8 (request, head) pair(s) fail" in done.stdout
    assert "agrees with kvdbg's replay of flex: yes" in done.stdout
    assert "the null block (engine page 0)" in done.stdout


def test_flex_index_maps_are_the_backend_s(tmp_path, make_snapshot):
    """The script's hand-written maps equal kvdbg's flex builder's, on a batch with every rule in play."""
    path, snap = make_snapshot(seq_lens=(70, 45, 130, 20), query_lens=(3, 1, 20, 2), sliding_window=40,
                               shared_prefix_pages=1, use_page_zero=True, page_zero_request=2, stale_tail=2)
    script = tmp_path / "maps.py"
    emit_repro_script(load_snapshot(path), "flex", str(script), data="embed")
    space = runpy.run_path(str(script), run_name="not_main")
    p2l, counts, indices, doc = space["flex_maps"](space["load_tensors"]())
    common = common_metadata(snap, 0)
    md = get_backend("flex").create(snap.meta, ReplayOptions()).builder.build(common)
    assert torch.equal(p2l, md.physical_to_logical)
    assert torch.equal(counts, md.kv_num_blocks)
    assert torch.equal(indices, md.kv_indices)
    assert torch.equal(doc, md.doc_ids)


def test_flex_output_matches_kvdbg_and_passing_case_exits_0(tmp_path, make_snapshot):
    path, _ = make_snapshot(seq_lens=(50, 90), query_len=3, sliding_window=32, causal=False)
    script = tmp_path / "pass.py"
    emitted = emit_repro_script(load_snapshot(path), "flex", str(script))
    assert emitted.kvdbg_failing_heads == []
    space = runpy.run_path(str(script), run_name="not_main")
    tensors = space["load_tensors"]()
    actual, written, _ = space["backend_output"](tensors)
    assert bool(written.all())
    assert_close_ulps(actual.to(torch.bfloat16), tensors["kvdbg_output"])
    done = run_isolated(script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "does not reproduce" in done.stdout


@pytest.mark.parametrize("name, code", [("dflash.safetensors", 0), ("ts_causal_window.safetensors", 1),
                                        ("fp8_dense.safetensors", 0)])
def test_flashinfer_ts_script_on_fixtures(tmp_path, name, code):
    """The builder and kernel contract written out: the window restriction (dflash), a request the kernel leaves
    unwritten (ts_causal_window), FP8 scales and P rounding (fp8_dense) -- each as kvdbg replays it."""
    script = tmp_path / "ts.py"
    emit_repro_script(load_snapshot(fixture(name)), "flashinfer_ts", str(script))
    done = run_isolated(script)
    assert done.returncode == code, done.stdout + done.stderr
    assert "agrees with kvdbg's replay of flashinfer_ts: yes" in done.stdout
    if name == "dflash.safetensors":
        assert "window restriction: request 0: keys from 4896" in done.stdout
    if name == "ts_causal_window.safetensors":
        assert "not computed (precondition broken): request 0: seq_len 1000 > max_kv_len 276" in done.stdout
        assert "REPRODUCED: 4 (request, head) pair(s) fail" in done.stdout


def test_data_file_beside_the_script_and_missing_data(tmp_path, make_snapshot):
    path, _ = make_snapshot(seq_lens=(40,), use_page_zero=True, page_zero_request=0)
    out = tmp_path / "out"
    out.mkdir()
    script = out / "repro.py"
    emitted = emit_repro_script(load_snapshot(path), "flex", str(script), data="file")
    assert not emitted.embedded and emitted.data_file == str(out / "repro.safetensors")
    assert "DATA_FILE = 'repro.safetensors'" in script.read_text()
    done = run_isolated(script, cwd=str(tmp_path))  # run from elsewhere: the data is found beside the script
    assert done.returncode == 1, done.stdout + done.stderr
    os.unlink(emitted.data_file)
    done = run_isolated(script)
    assert done.returncode == 2 and "cannot read the tensors" in done.stderr


def test_a_crash_is_exit_2_never_a_reproduction(tmp_path, make_snapshot):
    path, _ = make_snapshot(seq_lens=(40,))
    script = tmp_path / "broken.py"
    emit_repro_script(load_snapshot(path), "flex", str(script))
    script.write_text(script.read_text().replace("def flex_maps(t):", "def flex_maps(t):\n    raise RuntimeError('x')"))
    done = run_isolated(script)
    assert done.returncode == 2 and "RuntimeError" in done.stderr


def test_no_clobbering_without_force(tmp_path):
    script = tmp_path / "repro.py"
    script.write_text("# mine\n")
    args = ["shrink", fixture("prefix_page0.safetensors"), "-o", str(tmp_path / "s.safetensors"),
            "--emit-script", str(script)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2
    assert res.output.strip() == f"Error: --emit-script: {script} already exists; pass --force to replace it"
    assert script.read_text() == "# mine\n" and not (tmp_path / "s.safetensors").exists()
    res = CliRunner().invoke(cli, ["shrink", fixture("prefix_page0.safetensors"), "-o", str(tmp_path / "s.safetensors"),
                                   "--emit-script", str(tmp_path / "r.txt")])
    assert res.exit_code == 2 and "name the script *.py" in res.output
    res = CliRunner().invoke(cli, ["shrink", fixture("prefix_page0.safetensors"), "-o", str(tmp_path / "s.safetensors"),
                                   "--emit-script", str(script), "--backend", "vllm_flex"])
    assert res.exit_code == 2 and "writes out flex and flashinfer_ts only" in res.output


def test_script_text_names_where_the_tensors_are():
    config = {"backend": "flex", "source": "x.safetensors", "step": 0}
    assert "Tensors: embedded below" in script_text(config, b"abc", None)
    assert "Tensors: read from x.safetensors beside this script" in script_text(config, None, "x.safetensors")
