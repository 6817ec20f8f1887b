"""`kvdbg synth` and the bundled fixtures it makes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.util.fixtures_path import FIXTURES as FIXTURE_NAMES
from kvdbg.util.fixtures_path import default_fixture, fixture_path
from kvdbg.snapshot.store import load_snapshot
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
        (["--seq-len", "10,x"], "Invalid value for '--seq-len': 'x' is not a number"),
        (["--seq-lens", "10-20"], "Invalid value for '--seq-len': '10-20' is a range; list single numbers here"),
        (["--seq-lens", "3", "--query-len", "8"], "must be positive and hold the request's 8 query tokens"),
        (["--num-heads", "6", "--num-kv-heads", "4"], "--num-heads 6 must be a multiple of --num-kv-heads 4"),
        (["--window", "0"], "--window must be positive"),
        (["--fp8", "--k-scale", "0"], "--k-scale must be a finite positive number"),
        (["--shared-prefix-pages", "5", "--seq-lens", "20,40"], "too short to share 5 full prefix pages"),
        (["--num-heads", "8", "--num-kv-heads", "100000"], "--num-kv-heads must be at most 1024, got 100000"),
        (["--seed", "-1"], "--seed must be from 0 to 2**63 - 1, got -1"),
        # 0 is not "automatic" (left out is): the format stores positive integers.
        (["--max-decode-query-len", "0"], "--max-decode-query-len must be a positive integer up to"),
        (["--max-model-len", "0"], "--max-model-len must be a positive integer up to"),
        (["--max-model-len", "99999999999999999999999"], "--max-model-len must be a positive integer up to"),
        (["--num-gpu-blocks", "0"], "--num-gpu-blocks must be a positive integer up to"),
        (["--window", "99999999999999999999"], "--window must be at most 2**40"),
    ],
)
def test_synth_bad_options(tmp_path, args, message):
    result = CliRunner().invoke(cli, ["synth", "-o", str(tmp_path / "x.safetensors"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--num-heads", "100000", "--num-kv-heads", "100000"], "--num-heads must be at most 1024, got 100000"),
        (["--head-size", "30000000", "--seq-lens", "1", "--num-heads", "2", "--num-kv-heads", "1"],
         "--head-size must be at most 1024, got 30000000"),
        (["--stale-tail", "100000000"], "--stale-tail must be at most 65536, got 100000000"),
        (["--seed", "99999999999999999999999"], "--seed must be from 0 to 2**63 - 1, got 99999999999999999999999"),
        (["--num-gpu-blocks", "4000000000"], "--num-gpu-blocks must be a positive integer up to 16777216"),
        # Each option within its bound, together past the bytes bound: refused from the options alone.
        (["--seq-lens", "4000000,4000000", "--num-heads", "32", "--num-kv-heads", "8", "--head-size", "128"],
         "limited to 8 GiB of KV cache and 1 GiB of step data; these options need 30.5 GiB"),
        (["--page-size", "99999999999999"], "limited to 8 GiB of KV cache"),
        (["--fp8", "--head-size", "1", "--num-heads", "1", "--num-kv-heads", "1", "--page-size", "1", "--seq-lens",
          ",".join(["60000"] * 4096)], "limited to 4194304 pages; these options need 245760000"),
        (["--seq-lens", ",".join(["4000"] * 4096), "--query-len", "4000", "--head-size", "64", "--num-heads", "64",
          "--num-kv-heads", "1"], "of step data; these options need 3.91 GiB and 129 GiB"),
    ],
)
def test_synth_refuses_unbounded_options_at_once(tmp_path, args, message):
    """Options past synth's bounds: one line naming the option, exit 2, before anything is allocated (the run has
    a 3 GiB address-space limit; before the bounds, each allocated gigabytes or raised a traceback)."""
    out = tmp_path / "x.safetensors"
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            "from kvdbg.cli import main\n"
            "main(sys.argv[1:])\n")
    res = subprocess.run([sys.executable, "-c", code, "synth", "-o", str(out), *args], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()


def test_synth_bytes_are_what_it_writes():
    """The bytes bound is checked on synth_bytes, computed from the options: it is the size of the tensors made."""
    from kvdbg.moves.synth import SynthSpec, synth_bytes, synth_snapshot

    for spec in (SynthSpec(), SynthSpec(fp8=True, query_len=4, steps=3, stale_tail=5),
                 SynthSpec(dtype="float32", shared_prefix_pages=2, seq_lens=(40, 80)),
                 SynthSpec(new_kv=False, steps=2)):
        snap = synth_snapshot(spec)
        step_bytes = sum(t.numel() * t.element_size() for step in snap.steps
                         for t in (step.block_table, step.seq_lens, step.query_start_loc, step.query, step.key,
                                   step.value, step.slot_mapping) if t is not None)
        assert synth_bytes(spec) == (snap.kv_cache.numel() * snap.kv_cache.element_size(), step_bytes)
    # The largest benchmark snapshot (bench/scaling.py's 8192 MiB row) stays within the bound.
    assert synth_bytes(SynthSpec(seq_lens=(32768,) * 64, num_heads=32, num_kv_heads=8, head_size=128))[0] == 8 << 30


def test_synth_stores_the_engine_values_asked_for(tmp_path):
    """--max-decode-query-len, --max-model-len and --num-gpu-blocks are stored as given (0 is refused above,
    not taken for "automatic")."""
    out = tmp_path / "s.safetensors"
    res = CliRunner().invoke(cli, ["synth", "-o", str(out), "--max-decode-query-len", "3", "--max-model-len", "4096",
                                   "--num-gpu-blocks", "500", "--seed", str(2**63 - 1), "--sinks", "auto"])
    assert res.exit_code == 0, res.output
    backend = load_snapshot(out).meta.backend
    assert (backend.max_decode_query_len, backend.max_model_len, backend.num_gpu_blocks) == (3, 4096, 500)


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
    # OUT names an output, not an input: an old script that makes the file again replaces it with --force.
    res = CliRunner().invoke(cli, ["synth", str(old), *common, "--head-dim", "16", "--layout", "kv-planes",
                                   "--force"])
    assert res.exit_code == 0, res.output
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
