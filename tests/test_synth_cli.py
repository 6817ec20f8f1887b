"""`kvdbg synth` and the bundled fixtures it makes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.fixtures_path import FIXTURES as FIXTURE_NAMES
from kvdbg.fixtures_path import default_fixture, fixture_path
from kvdbg.snapshot import load_snapshot
from tests.helpers import FIXTURES, ROOT, assert_close_ulps


def test_synth_writes_and_refuses_to_clobber(tmp_path):
    out = tmp_path / "s.safetensors"
    args = ["synth", "-o", str(out), "--seq-lens", "30,70", "--query-len", "4", "--mask", "dense", "--window", "32",
            "--num-heads", "4", "--num-kv-heads", "1", "--head-size", "32", "--steps", "2", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    snap = load_snapshot(out)
    assert snap.meta.layer.sliding_window == 32 and not snap.meta.layer.causal
    assert snap.steps[1].seq_lens.tolist() == [34, 74]
    before = out.read_bytes()
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "already exists" in result.output
    assert out.read_bytes() == before
    assert CliRunner().invoke(cli, args + ["--force"]).exit_code == 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seq-lens", "10,x"], "Invalid value for '--seq-lens': 'x' is not a number"),
        (["--seq-lens", "10-20"], "Invalid value for '--seq-lens': '10-20' is a range; list single numbers here"),
        (["--seq-lens", "3", "--query-len", "8"], "must be positive and hold the request's 8 query tokens"),
        (["--num-heads", "6", "--num-kv-heads", "4"], "--num-heads 6 must be a multiple of --num-kv-heads 4"),
        (["--window", "0"], "--window must be positive"),
        (["--fp8", "--k-scale", "0"], "--k-scale must be a finite positive number"),
        (["--shared-prefix-pages", "5", "--seq-lens", "20,40"], "too short to share 5 full prefix pages"),
    ],
)
def test_synth_bad_options(tmp_path, args, message):
    result = CliRunner().invoke(cli, ["synth", "-o", str(tmp_path / "x.safetensors"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "x.safetensors").exists()


def test_synth_old_spellings_make_the_same_bytes(tmp_path):
    """OUT as an argument and --head-dim (the spellings before -o and --head-size) still work,
    hidden from --help, and make the same file."""
    new, old = tmp_path / "new.safetensors", tmp_path / "old.safetensors"
    common = ["--seq-lens", "20,40", "--num-heads", "2", "--num-kv-heads", "1"]
    assert CliRunner().invoke(cli, ["synth", "-o", str(new), *common, "--head-size", "16",
                                    "--layout", "kv-planes"]).exit_code == 0
    res = CliRunner().invoke(cli, ["synth", str(old), *common, "--head-dim", "16", "--layout", "kv-planes"])
    assert res.exit_code == 0, res.output
    assert new.read_bytes() == old.read_bytes()
    assert load_snapshot(new).meta.kv_layout == "2,pages,tokens,heads,dim"
    shown = CliRunner().invoke(cli, ["synth", "--help"]).output
    assert "--head-dim" not in shown and "[OUT]" not in shown
    assert "--head-size" in shown and "kv-planes" in shown


@pytest.mark.parametrize("args, message", [
    ([], "-o/--output: give the file to write"),
    (["a.safetensors", "-o", "b.safetensors"], "two output files (a.safetensors and -o b.safetensors)"),
])
def test_synth_needs_one_output(tmp_path, args, message):
    result = CliRunner().invoke(cli, ["synth", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_fixtures_are_small_and_valid():
    total = 0
    for name in FIXTURE_NAMES:
        path = fixture_path(name)
        size = os.path.getsize(path)
        assert size < 4 * 1024 * 1024, (name, size)
        total += size
        load_snapshot(path)
    assert total < 10 * 1024 * 1024
    assert default_fixture().endswith("dflash.safetensors")


def test_fixtures_regenerate_byte_for_byte(tmp_path):
    env = dict(os.environ, KVDBG=f"{sys.executable} -m kvdbg")
    subprocess.run(["bash", os.path.join(FIXTURES, "regenerate.sh"), str(tmp_path)], check=True, env=env,
                   cwd=ROOT, capture_output=True)
    for name in FIXTURE_NAMES:
        assert_same_snapshot(str(tmp_path / name), os.path.join(FIXTURES, name))


def assert_same_snapshot(path: str, want_path: str) -> None:
    """Generated inputs and metadata byte for byte; the engine outputs (a kernel's float output) to a few ulps.

    ``synth --engine-output`` runs a backend to make the ``output`` tensors, and a float kernel may round
    the last bit differently on another CPU (seen: 1 bf16 ulp on AMD EPYC vs Intel), so only they get a
    tolerance. Everything else is deterministic by construction and must not move a bit.
    """
    from safetensors import safe_open

    with safe_open(path, "pt") as got, safe_open(want_path, "pt") as want:
        assert got.metadata() == want.metadata(), want_path
        assert sorted(got.keys()) == sorted(want.keys()), want_path
        for key in want.keys():
            a, b = got.get_tensor(key), want.get_tensor(key)
            assert a.dtype == b.dtype and a.shape == b.shape, (want_path, key)
            if key == "output" or key.endswith(".output"):
                assert_close_ulps(a, b)
            else:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (want_path, key)
