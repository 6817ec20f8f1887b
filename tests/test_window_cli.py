"""`kvdbg window`: exit codes, messages, --json numbers, and no torch on its path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli


def run(*args):
    return CliRunner().invoke(cli, ["window", *args], env={"NO_COLOR": "1", "COLUMNS": "160"})


def test_issue_example_tables():
    res = run("--seq-len", "9000", "--window", "4096", "--query-len", "8")
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())  # column padding depends on the widest cell
    assert "first kept │ page 306, token 4896" in out
    assert "306 dropped, 257 kept of 563" in out
    assert "restricted seq_len │ 4104" in out
    assert "plan max_kv_len │ 4120" in out
    assert "worst extra tokens │ 8 " in out and "shared-start drift │ 7 tokens" in out
    assert "│ 7 │ 8999 │ [4904, 9000) │ [4896, 9000) │ 8 │ 0 │" in out
    # Without colour the strip still reads through its letters.
    assert "303 304 305 306 307 308 309 310-560 561 562 … D D D P K K K … K Q" in out
    assert "no findings" in out


def test_json_has_the_same_numbers():
    res = run("--seq-len", "9000", "--window", "4096", "--query-len", "8", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    r = data["restriction"]
    assert (r["span"], r["start_page"], r["restricted_seq_len"], r["table_width"]) == (4103, 306, 4104, 258)
    assert data["builder"]["max_kv_len"] == 4120 and data["builder"]["mask_type"] == "dense"
    assert [t["extra"] for t in data["visibility"]["tokens"]] == list(range(1, 9))
    assert data["visibility"]["drift"] == 7 and data["findings"] == []


def test_causal_window_past_max_kv_len_exits_1():
    res = run("--seq-len", "9000", "--window", "4096", "--query-len", "8", "--mask", "causal")
    assert res.exit_code == 1, res.output
    assert "does not apply — causal mask" in res.output
    assert "seq_len 9000 exceeds the plan's max_kv_len 4120" in res.output
    assert "seq_len 9000 needs 563 pages of 16 but the block table has 258 columns" in res.output
    assert "X" in res.output  # pages the kernel needs but never got


def test_short_sequence_says_why_and_still_checks():
    res = run("--seq-len", "1000", "--window", "4096", "--query-len", "4", "--json")
    assert res.exit_code == 0
    data = json.loads(res.output)
    assert data["applies"] is False and "nothing is dropped" in data["reason"]
    assert data["builder"]["seq_len"] == 1000 and data["builder"]["max_kv_len"] == 4096 + 4 + 16


def test_no_window_full_attention():
    res = run("--seq-len", "9000", "--query-len", "8", "--json")
    assert res.exit_code == 0
    data = json.loads(res.output)
    assert data["reason"].startswith("no sliding window")
    assert data["builder"]["max_kv_len"] == 32768 and data["builder"]["buffer_width"] == 2048


def test_unsupported_page_size_is_a_finding():
    res = run("--seq-len", "9000", "--window", "4096", "--page-size", "24")
    assert res.exit_code == 1
    assert "page_size 24 is not supported by prims_ts" in res.output


def test_long_query_block_is_elided_unless_full():
    short = run("--seq-len", "9000", "--window", "4096", "--query-len", "40")
    assert short.exit_code == 0 and "32 more (--full)" in short.output and "8975" not in short.output
    full = run("--seq-len", "9000", "--window", "4096", "--query-len", "40", "--full")
    assert "more (--full)" not in full.output and "8975" in full.output


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "0", "--window", "4096"], "Error: --seq-len must be >= 1, got 0"),
    (["--seq-len", "100", "--window", "-5"], "Error: --window must be >= 1, got -5"),
    (["--seq-len", "100", "--page-size", "0"], "Error: --page-size must be >= 1, got 0"),
    (["--seq-len", "4", "--query-len", "8"], "Error: --query-len 8 is longer than --seq-len 4"),
    (["--seq-len", "40000", "--max-model-len", "32768"], "Error: --seq-len 40000 exceeds --max-model-len 32768"),
    (["--seq-len", "100", "--max-decode-query-len", "0"], "Error: --max-decode-query-len must be >= 1, got 0"),
])
def test_bad_options_exit_2_with_one_line(args, message):
    res = CliRunner().invoke(cli, ["window", *args])
    assert res.exit_code == 2
    assert res.output.strip() == message


def test_window_cli_does_not_import_torch():
    code = ("import runpy, sys\n"
            "sys.argv = ['kvdbg', 'window', '--seq-len', '9000', '--window', '4096', '--query-len', '8']\n"
            "try:\n"
            "    runpy.run_module('kvdbg', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    assert not exc.code, exc.code\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "306 dropped" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "TORCH False"


DFLASH = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "fixtures" / "dflash.safetensors")
TS_CAUSAL = DFLASH.replace("dflash", "ts_causal_window")


def test_window_from_a_snapshot_reads_the_longest_request():
    res = run(DFLASH)
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert res.output.splitlines()[0].endswith("step 0 of 1, request 0 of 2 (the longest)")
    # The same tables as typing the numbers by hand (dflash: L=9000, w=4096, q=8, dense, page 16).
    assert "first kept │ page 306, token 4896" in out and "plan max_kv_len │ 4120" in out
    by_hand = run("--seq-len", "9000", "--window", "4096", "--query-len", "8", "--max-decode-query-len", "8")
    # The same tables; the snapshot's verdict judges its inputs (every request) and says outputs were not compared.
    assert res.output.split("\n", 1)[1].split("PASS:")[0] == by_hand.output.split("PASS:")[0]
    assert "(and up to 8 extra, by design)" in by_hand.output and "outputs not compared" in out


def test_window_from_a_snapshot_request_and_json_source():
    res = run(DFLASH, "--request", "1", "--step", "0", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["seq_len"] == 1000 and data["query_len"] == 8 and data["window"] == 4096
    assert data["source"]["request"] == 1 and data["source"]["longest"] is False
    assert data["source"]["max_decode_query_len"] == 8 and data["source"]["causal"] is False


def test_window_from_a_causal_snapshot_reads_its_mask():
    res = run(TS_CAUSAL, "--json")
    assert res.exit_code == 1
    data = json.loads(res.output)
    assert data["causal"] is True and data["seq_len"] == 1000 and data["window"] == 256
    assert "seq_len 1000 exceeds the plan's max_kv_len" in res.output


@pytest.mark.parametrize("args, message", [
    ([DFLASH, "--window", "3"], "Error: --window cannot be combined with SNAPSHOT, which gives it (give one or the other)"),
    ([DFLASH, "--request", "2"], "Error: --request 2 is out of range: step 0 has 2 request(s)"),
    ([DFLASH, "--step", "1"], "Error: --step 1 is out of range: the snapshot has 1 step(s)"),
    (["--request", "1"], "Error: --request needs SNAPSHOT (it picks a request of a snapshot)"),
    ([], "Error: give SNAPSHOT, or --seq-len (with --window, --query-len, ...)"),
])
def test_window_snapshot_bad_input_exits_2(args, message):
    res = CliRunner().invoke(cli, ["window", *args])
    assert res.exit_code == 2
    assert res.output.strip() == message


def test_window_snapshot_does_not_import_torch():
    code = ("import runpy, sys\n"
            f"sys.argv = ['kvdbg', 'window', {DFLASH!r}, '--request', '1']\n"
            "try:\n"
            "    runpy.run_module('kvdbg', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    assert not exc.code, exc.code\n"
            "print('HEAVY', [m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "request 1 of 2" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"


def _synth(tmp_path, name, **fields):
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    return str(save_snapshot(synth_snapshot(SynthSpec(**fields)), tmp_path / name))


@pytest.mark.parametrize("fields, reason", [
    (dict(query_len=8, max_decode_query_len=4), "exceeds max_decode_query_len 4"),
    (dict(query_lens=(8, 4)), "query lengths 4..8 are not one uniform block"),
], ids=["prefill-shaped", "ragged"])
def test_a_batch_flashinfer_ts_never_runs_is_not_applicable_as_replay_says(tmp_path, fields, reason):
    path = _synth(tmp_path, "batch.safetensors", seq_lens=(300, 200), causal=False, sliding_window=64, **fields)
    res = run(path, "--json")
    data = json.loads(res.output)
    replayed = CliRunner().invoke(cli, ["replay", path, "--backend", "flashinfer_ts"])
    assert res.exit_code == replayed.exit_code == 3, (data["verdict"], replayed.output)
    assert reason in data["verdict"]["summary"] and reason in data["source"]["not_applicable"]
    # With the engine's own FLASHINFER_TS output, the engine did run it: judged, as replay judges it.
    owned = _synth(tmp_path, "owned.safetensors", seq_lens=(300, 200), causal=False, sliding_window=64,
                   engine_output="reference", backend="FLASHINFER_TS", **fields)
    assert run(owned).exit_code == CliRunner().invoke(cli, ["replay", owned]).exit_code == 1


def test_lengths_replay_refuses_are_refused_here_too(tmp_path):
    from tests.helpers import FIXTURES
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = f"{FIXTURES}/dflash.safetensors"
    with safe_open(source, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for name, index, value, message in (("seq_lens", 0, 20000, "seq_lens[0] = 20000 needs 1250 pages"),
                                        ("query_start_loc", 1, 20, "query_start_loc decreases at index 2")):
        changed = dict(tensors, **{name: tensors[name].clone()})
        changed[name].view(-1)[index] = value
        path = str(tmp_path / f"{name}.safetensors")
        save_file(changed, path, metadata=metadata)
        for command in (["window", path], ["replay", path]):
            res = CliRunner().invoke(cli, command)
            assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, \
                (command, res.output)


@pytest.mark.parametrize("step", [0, 1])
def test_a_table_naming_a_page_that_is_not_stored_is_refused_as_replay_refuses_it(tmp_path, step):
    """Issue 44: window said PASS (exit 0) on a file whose live block-table entry names a page the file does not
    store, which replay refuses (exit 2). Both hold the file to kvdbg.snapshot.rules now: same line, exit 2;
    every step, as a replay loads them all (window analyses step 0)."""
    from kvdbg import open_snapshot
    from kvdbg.snapshot.format import read_index_tensor
    from tests.nan_snapshot import with_index_entry
    from tests.helpers import FIXTURES

    header = open_snapshot(f"{FIXTURES}/prefix_page0.safetensors")
    assert 12 not in read_index_tensor(header, "page_ids") and 12 < header.meta.backend.num_gpu_blocks
    # Request 0 (100 tokens, then 101: live columns 0..6) reads engine page 12 at column 2.
    path = with_index_entry(tmp_path / "unstored.safetensors", f"step.{step}.block_table", 2, 12)
    message = f"Error: {path}: step.{step}.block_table[0, 2] = 12 is not among the 21 stored pages (page_ids)"
    for command in (["window", path], ["window", path, "--picture"], ["replay", path]):
        res = CliRunner().invoke(cli, command)
        assert res.exit_code == 2 and res.output.strip() == message, (command, res.output)
    # Still without torch: the rule is plain Python over the index tensors.
    code = ("import runpy, sys\n"
            f"sys.argv = ['kvdbg', 'window', {path!r}]\n"
            "try:\n"
            "    runpy.run_module('kvdbg', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    print('EXIT', exc.code)\n"
            "print('HEAVY', [m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-2:] == ["EXIT 2", "HEAVY []"], out
    assert out.stderr.strip() == message
