"""Inputs the fuzzer (tests/fuzz) found: each one must end in exit 0/1 or one "Error: " line, quickly."""

from __future__ import annotations

import json
import os
import subprocess

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
    assert_one_line_error(invoke("replay", path, "--backend", "reference", "--head", "0-100000000000"),
                          "--head 100000000000 is out of range")
    assert_one_line_error(invoke("replay", path, "--backend", "reference", "--request", "0-100000000000"),
                          "--request 100000000000 is out of range")


def test_window_huge_query_len_is_an_option_error():
    assert_one_line_error(invoke("window", "--seq-len", 2**31, "--query-len", 10**9, "--full"),
                          "--query-len 1000000000 is over 4096")
    assert invoke("window", "--seq-len", 9000, "--window", 4096, "--query-len", 4096).exit_code in (0, 1)


def _snap_with_bad_pages(tmp_path, *, nan=False, inf=False, zero=False, zero_tail=False, fp8=False):
    """Small causal snapshot; request 0's second page poisoned, request 1's first page wiped."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    snap = synth_snapshot(SynthSpec(seq_lens=(20, 40), num_heads=4, num_kv_heads=2, head_size=16, new_kv=False,
                                    stale_tail=1, fp8=fp8, q_scale=0.05 if fp8 else 1.0))
    k, v = snap.kv_views()
    if fp8:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    table = snap.stored_block_table(0)
    bad = float("nan") if not fp8 else 0x7F  # 0x7F is e4m3fn's NaN
    if nan:
        k[table[0, 1], 1, 3, 5] = bad
    if inf:
        v[table[0, 0], 0, 0, 0] = float("-inf")
    if zero:
        k[table[1, 0]] = 0
        v[table[1, 0]] = 0
    if zero_tail:  # slots past request 0's 20 tokens are unwritten in a real cache: not a finding
        k[table[0, 1], :, 4:] = 0
        v[table[0, 1], :, 4:] = 0
    return save_snapshot(snap, tmp_path / "bad.safetensors"), snap


@pytest.mark.parametrize("fp8", [False, True])
def test_map_reports_nonfinite_live_pages_as_errors(tmp_path, fp8):
    path, snap = _snap_with_bad_pages(tmp_path, nan=True, fp8=fp8)
    result = invoke("map", path, "--json")
    assert result.exit_code == 1, result.output
    anomalies = json.loads(result.stdout)["anomalies"]
    bad = [a for a in anomalies if a["code"] == "nonfinite_kv"]
    assert [(a["severity"], a["request"], a["pages"]) for a in bad] == \
        [("error", 0, [int(snap.steps[0].block_table[0, 1])])]


def test_map_reports_inf_and_zero_pages(tmp_path):
    path, snap = _snap_with_bad_pages(tmp_path, inf=True, zero=True)
    anomalies = json.loads(invoke("map", path, "--json").stdout)["anomalies"]
    codes = {(a["code"], a["severity"], a["request"]) for a in anomalies}
    assert ("nonfinite_kv", "error", 0) in codes
    assert ("zero_page", "warning", 1) in codes
    zero = next(a for a in anomalies if a["code"] == "zero_page")
    assert zero["pages"] == [int(snap.steps[0].block_table[1, 0])]


def test_clean_pages_and_unwritten_tail_slots_are_not_reported(tmp_path):
    path, _ = _snap_with_bad_pages(tmp_path, zero_tail=True)
    result = invoke("map", path, "--json")
    assert result.exit_code == 0, result.output
    codes = [a["code"] for a in json.loads(result.stdout)["anomalies"]]
    assert "nonfinite_kv" not in codes and "zero_page" not in codes
    for name in os.listdir(FIXTURES):
        if name.endswith(".safetensors"):
            out = json.loads(invoke("map", os.path.join(FIXTURES, name), "--json").stdout)
            assert not [a for a in out["anomalies"] if a["code"] in ("nonfinite_kv", "zero_page")], name


def test_replay_reports_nonfinite_pages_before_the_backends(tmp_path):
    path, snap = _snap_with_bad_pages(tmp_path, nan=True, zero=True)
    result = invoke("replay", path, "--backend", "reference", "--json")
    assert result.exit_code == 1, result.output
    findings = json.loads(result.stdout)["findings"]
    core = [(f["backend"], f["code"], f["severity"], f["request"]) for f in findings if f["backend"] == "replay"]
    assert core == [("replay", "nonfinite_kv", "error", 0), ("replay", "zero_page", "warning", 1)]


def test_live_page_scan_is_chunked(tmp_path, monkeypatch):
    """The scan must visit every live page even when one chunk holds a single page."""
    import kvdbg.snapshot.pagemap as pagemap
    from kvdbg.snapshot.store import load_snapshot

    path, snap = _snap_with_bad_pages(tmp_path, nan=True, zero=True)
    monkeypatch.setattr(pagemap, "SCAN_BUDGET_BYTES", 1)
    values = pagemap.live_page_values(load_snapshot(path), 0)
    assert values.nonfinite == {0: [int(snap.steps[0].block_table[0, 1])]}
    assert values.zero == {1: [int(snap.steps[0].block_table[1, 0])]}


def _terabyte_header_file(tmp_path, small_parts, *, consistent_offsets: bool):
    """A small file whose header declares a 1 TiB kv_cache."""
    from kvdbg.snapshot.format import ST_DTYPES

    tensors, meta = small_parts
    path = write_raw(tmp_path / "tb.safetensors", tensors, meta)
    blob = open(path, "rb").read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    entry = header["kv_cache"]
    itemsize = ST_DTYPES[entry["dtype"]][0]
    per_page = itemsize * entry["shape"][1] * entry["shape"][2] * entry["shape"][3]
    entry["shape"][0] = 2**40 // per_page
    if consistent_offsets:
        entry["data_offsets"][1] = entry["data_offsets"][0] + 2**40
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw + blob[8 + n:])
    return path


PEAK_RSS_PROBE = r"""
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(proc.returncode, round(peak_mb, 1), proc.stderr.strip().replace("\n", "|"))
"""


@pytest.mark.parametrize("consistent_offsets", [True, False])
def test_terabyte_tensor_is_rejected_before_any_allocation(tmp_path, small_parts, consistent_offsets):
    import sys

    path = _terabyte_header_file(tmp_path, small_parts, consistent_offsets=consistent_offsets)
    assert os.path.getsize(path) < 100_000
    kvdbg = [sys.executable, "-m", "kvdbg"]

    def probe(command):
        # A probe process runs the command as its only child, so RUSAGE_CHILDREN is the command's own peak RSS.
        out = subprocess.run([sys.executable, "-c", PEAK_RSS_PROBE, *command], capture_output=True,
                             text=True, timeout=120).stdout.split(" ", 2)
        return int(out[0]), float(out[1]), out[2].strip()

    # What merely loading torch and the replay code costs on this machine (a CUDA build maps far more
    # than a CPU one): the file may add only a little on top of it.
    _, torch_mb, _ = probe([sys.executable, "-c", "import torch, kvdbg.replayer.runner, kvdbg.snapshot.pagemap"])
    for args in (["info", path], ["info", "--check", path], ["replay", path, "--backend", "reference"],
                 ["map", path]):
        code, peak_mb, stderr = probe([*kvdbg, *args])
        print(f"{args[0]}{' --check' if '--check' in args else ''}: peak RSS {peak_mb} MB (torch alone {torch_mb} MB)")
        assert code == 2, stderr
        assert stderr.startswith("Error: ") and "|" not in stderr, stderr
        assert "kv_cache" in stderr, stderr
        baseline = 50 if args[0] == "info" else torch_mb  # info never imports torch
        assert peak_mb < baseline + 150, (args, peak_mb, torch_mb)


def _aliased_table_parts(width, *, table, page_ids, sliding_window=None, seq_lens=None, num_reqs=1):
    """One-token-per-request causal snapshot over ``width`` table columns of 16-token pages."""
    ps, hq, hkv, d = 16, 4, 1, 64
    layer = {"name": "l", "num_heads": hq, "num_kv_heads": hkv, "head_size": d, "scale": 0.125, "causal": True,
             "dtype": "bfloat16", "sliding_window": sliding_window}
    meta = {"layer": layer, "backend": {"name": "FLEX_ATTENTION", "page_size": ps, "max_model_len": width * ps,
                                        "num_gpu_blocks": 10}, "kv_layout": "pages,heads,tokens,2*dim"}
    gen = torch.Generator().manual_seed(0)
    tensors = {"kv_cache": torch.randn(len(page_ids), hkv, ps, 2 * d, generator=gen).to(torch.bfloat16),
               "page_ids": torch.tensor(page_ids, dtype=torch.int32),
               "block_table": torch.tensor(table, dtype=torch.int32).reshape(num_reqs, width),
               "seq_lens": torch.tensor(seq_lens or [width * ps] * num_reqs, dtype=torch.int32),
               "query_start_loc": torch.arange(num_reqs + 1, dtype=torch.int32),
               "query": torch.randn(num_reqs, hq, d, generator=gen).to(torch.bfloat16)}
    return tensors, meta


def test_one_stored_page_mapped_by_every_entry_is_refused(tmp_path):
    # The reviewer's file mapped one stored page 2**20 times (seq_len 2**24): 4 MB on disk, 11 GB in replay and
    # a DefaultCPUAllocator traceback in `attention`. 2**18 entries of this layer's pages would cost a replay
    # 4 GiB in float64, over the bound.
    width = 2**18
    tensors, meta = _aliased_table_parts(width, table=[5] * width, page_ids=[5])
    path = write_raw(tmp_path / "alias.safetensors", tensors, meta)
    assert os.path.getsize(path) < 2 * 1024**2
    assert invoke("info", path).exit_code == 0  # the header alone is fine
    for args in (["info", "--check", path], ["replay", path, "--backend", "reference"], ["map", path],
                 ["attention", path]):
        assert_one_line_error(invoke(*args), f"block_table[0] maps {width} live pages", "page_ids stores only 1",
                              "over 2 GiB")


def test_a_page_mapped_again_is_the_engine_bug_it_shows_not_bad_input(tmp_path):
    # An engine that maps a page twice, or leaves the null block in live entries, is what kvdbg is for: the
    # snapshot loads, and replay and map say what is wrong (here: the null block read as live).
    tensors, meta = _aliased_table_parts(64, table=[5] * 64, page_ids=[5])
    path = write_raw(tmp_path / "again.safetensors", tensors, meta)
    result = invoke("info", "--check", path)
    assert result.exit_code == 1 and "page_mapped_twice" in result.output
    table = [0] * 62 + [5, 6]  # no window: 62 live entries of the null block
    tensors, meta = _aliased_table_parts(64, table=table, page_ids=[0, 5, 6])
    result = invoke("replay", write_raw(tmp_path / "nowin.safetensors", tensors, meta), "--backend", "flex")
    assert result.exit_code == 1 and "live_page_zero" in result.output


def test_shared_prefix_and_null_blocks_before_the_window_still_load(tmp_path):
    from kvdbg.snapshot.store import load_snapshot

    # Prefix caching: three requests read the same two stored pages.
    tensors, meta = _aliased_table_parts(2, table=[5, 6] * 3, page_ids=[5, 6], num_reqs=3)
    load_snapshot(write_raw(tmp_path / "shared.safetensors", tensors, meta))
    # vLLM's sliding-window manager: 62 entries before the window hold the null block, page 0.
    table = [0] * 62 + [5, 6]
    tensors, meta = _aliased_table_parts(64, table=table, page_ids=[0, 5, 6], sliding_window=16)
    path = write_raw(tmp_path / "window.safetensors", tensors, meta)
    load_snapshot(path)
    assert invoke("replay", path, "--backend", "reference").exit_code in (0, 1, 3)
    # Before a long window too, however many entries: they are not counted against the stored pages.
    width = 2**18
    table = [0] * (width - 2) + [5, 6]
    tensors, meta = _aliased_table_parts(width, table=table, page_ids=[0, 5, 6], sliding_window=16)
    assert invoke("info", "--check", write_raw(tmp_path / "long.safetensors", tensors, meta)).exit_code == 0


@pytest.mark.parametrize("field", ["kernels", "layer", "steps", "snapshot"])
def test_diff_of_outputs_files_with_wrong_metadata_types(tmp_path, field):
    from safetensors import safe_open

    from kvdbg.snapshot.format import OUTPUTS_KEY, write_safetensors
    from kvdbg.snapshot.store import dtype_name

    good = tmp_path / "a.safetensors"
    result = invoke("replay", os.path.join(FIXTURES, "causal_gqa.safetensors"), "--backend", "reference",
                    "-o", good)
    assert result.exit_code in (0, 1), result.output
    with safe_open(good, "pt") as fh:
        meta = json.loads(fh.metadata()[OUTPUTS_KEY])
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    meta[field] = [1]
    bad = tmp_path / "b.safetensors"
    with open(bad, "wb") as out:
        write_safetensors(out, [(n, dtype_name(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
                                for n, t in tensors.items()], {OUTPUTS_KEY: json.dumps(meta)})
    # Before the fix: TypeError ('<' between int and str) or AttributeError ('list' has no 'get').
    for a, b in ((bad, good), (good, bad)):
        assert_one_line_error(invoke("diff", a, b), f"field {field} must be", str(bad))
    assert invoke("diff", good, good).exit_code == 0
