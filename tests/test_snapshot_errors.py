"""Every kind of bad snapshot gets one line naming the field, exit code 2, no traceback."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.errors import SnapshotError
from kvdbg.snapshot.store import load_snapshot
from tests.helpers import write_raw


def run_info(path, *extra):
    result = CliRunner().invoke(cli, ["info", str(path), *extra])
    return result


def assert_bad(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_not_a_safetensors_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_text("hello, this is a text file and not a snapshot at all")
    assert_bad(run_info(p), "not a safetensors file")
    p.write_bytes(b"abc")
    assert_bad(run_info(p), "shorter than the 8-byte header length")


def test_truncated_file(tmp_path, small_parts):
    tensors, meta = small_parts
    p = write_raw(tmp_path / "t.safetensors", tensors, meta)
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) - 100])
    assert_bad(run_info(p), "truncated file", "ends at data byte")
    open(p, "wb").write(data[:20])
    assert_bad(run_info(p), "truncated file")


def test_missing_format_key(tmp_path, small_parts):
    tensors, meta = small_parts
    p = write_raw(tmp_path / "m.safetensors", tensors, meta, fmt=None)
    assert_bad(run_info(p), "kvdbg.format", "not a kvdbg snapshot")


def test_unknown_format_version(tmp_path, small_parts):
    tensors, meta = small_parts
    p = write_raw(tmp_path / "v.safetensors", tensors, meta, fmt="7")
    assert_bad(run_info(p), "unknown kvdbg.format '7'")


def test_malformed_meta_json(tmp_path, small_parts):
    tensors, _ = small_parts
    p = write_raw(tmp_path / "j.safetensors", tensors, '{"layer": {')
    assert_bad(run_info(p), "kvdbg.meta is not valid JSON")
    p = write_raw(tmp_path / "d.safetensors", tensors, "[" * 100000 + "]" * 100000)
    assert_bad(run_info(p), "kvdbg.meta")


def test_missing_required_tensor(tmp_path, small_parts):
    tensors, meta = small_parts
    del tensors["query_start_loc"]
    assert_bad(run_info(write_raw(tmp_path / "q.safetensors", tensors, meta)), "missing required tensor 'query_start_loc'")


def test_wrong_rank_and_shape(tmp_path, small_parts):
    tensors, meta = small_parts
    t = dict(tensors, block_table=tensors["block_table"].reshape(-1))
    assert_bad(run_info(write_raw(tmp_path / "r.safetensors", t, meta)), "'block_table' has rank 1")
    t = dict(tensors, query=tensors["query"][:, :3])
    assert_bad(run_info(write_raw(tmp_path / "s.safetensors", t, meta)), "'query' has shape", "num_heads")
    t = dict(tensors, kv_cache=tensors["kv_cache"][:-1])
    assert_bad(run_info(write_raw(tmp_path / "k.safetensors", t, meta)), "'kv_cache' has shape")


def test_wrong_dtype(tmp_path, small_parts):
    tensors, meta = small_parts
    t = dict(tensors, seq_lens=tensors["seq_lens"].float())
    assert_bad(run_info(write_raw(tmp_path / "f.safetensors", t, meta)), "'seq_lens' has dtype float32")
    t = dict(tensors, kv_cache=tensors["kv_cache"].half())
    assert_bad(run_info(write_raw(tmp_path / "h.safetensors", t, meta)), "'kv_cache' has dtype float16",
               "model dtype bfloat16")


def test_block_table_id_not_stored(tmp_path, small_parts):
    tensors, meta = small_parts
    stored = set(tensors["page_ids"].tolist())
    missing = next(i for i in range(1, meta["backend"]["num_gpu_blocks"]) if i not in stored)
    bt = tensors["block_table"].clone()
    bt[1, 2] = missing
    p = write_raw(tmp_path / "b.safetensors", dict(tensors, block_table=bt), meta)
    assert run_info(p).exit_code == 0  # header-only info does not read ids
    assert_bad(run_info(p, "--check"), f"block_table[1, 2] = {missing} is not among the", "stored pages")
    bt[0, 0] = 10**6
    p = write_raw(tmp_path / "o.safetensors", dict(tensors, block_table=bt), meta)
    assert_bad(run_info(p, "--check"), "block_table[0, 0] = 1000000 is outside the engine's cache")


def test_seq_len_negative_or_too_long(tmp_path, small_parts):
    tensors, meta = small_parts
    sl = tensors["seq_lens"].clone()
    sl[0] = -3
    p = write_raw(tmp_path / "n.safetensors", dict(tensors, seq_lens=sl), meta)
    assert_bad(run_info(p, "--check"), "seq_lens[0] = -3 is negative")
    width = tensors["block_table"].shape[1]
    sl[0] = width * 16 + 1
    p = write_raw(tmp_path / "l.safetensors", dict(tensors, seq_lens=sl), meta)
    assert_bad(run_info(p, "--check"), f"seq_lens[0] = {width * 16 + 1} needs", f"only {width} columns")


def test_query_tokens_do_not_match_query_start_loc(tmp_path, small_parts):
    tensors, meta = small_parts
    qsl = tensors["query_start_loc"].clone()
    qsl[-1] = 5
    p = write_raw(tmp_path / "q.safetensors", dict(tensors, query_start_loc=qsl), meta)
    assert_bad(run_info(p, "--check"), "query_start_loc[-1] = 5 but query has 2 tokens")


def test_heads_not_a_multiple(tmp_path, small_parts):
    tensors, meta = small_parts
    meta["layer"]["num_kv_heads"] = 3
    p = write_raw(tmp_path / "g.safetensors", tensors, meta)
    assert_bad(run_info(p), "layer.num_heads (4) must be a multiple of layer.num_kv_heads (3)")


@pytest.mark.parametrize("value", ["NaN", "Infinity", 0, -1.5])
def test_bad_scales(tmp_path, small_parts, value):
    tensors, meta = small_parts
    meta["layer"]["k_scale"] = value
    raw = json.dumps(meta).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    p = write_raw(tmp_path / "s.safetensors", tensors, raw)
    assert_bad(run_info(p), "layer.k_scale must be a finite positive number")


def test_unknown_layout(tmp_path, small_parts):
    tensors, meta = small_parts
    meta["kv_layout"] = "tokens,pages"
    assert_bad(run_info(write_raw(tmp_path / "u.safetensors", tensors, meta)), "kv_layout", "not a known layout")


def test_overlapping_offsets_and_huge_declared_sizes(tmp_path, small_parts):
    import struct

    tensors, meta = small_parts
    p = write_raw(tmp_path / "o.safetensors", tensors, meta)
    data = bytearray(open(p, "rb").read())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["kv_cache"]["shape"] = [2**40, 1, 1, 1]
    header["kv_cache"]["data_offsets"] = [0, 2**41]
    raw = json.dumps(header).encode()
    open(p, "wb").write(struct.pack("<Q", len(raw)) + raw + bytes(data[8 + n :]))
    assert_bad(run_info(p), "truncated file", "kv_cache")


def test_missing_file_and_directory(tmp_path):
    assert_bad(run_info(tmp_path / "nope.safetensors"), "no such file")


def test_load_snapshot_raises_snapshot_error(tmp_path, small_parts):
    tensors, meta = small_parts
    qsl = tensors["query_start_loc"].clone()
    qsl[1] = 3
    p = write_raw(tmp_path / "q.safetensors", dict(tensors, query_start_loc=qsl), meta)
    with pytest.raises(SnapshotError, match=r"query_start_loc decreases at index 2"):
        load_snapshot(p)
    assert torch.is_tensor(load_snapshot(p, validate_values=False).kv_cache)


@pytest.mark.parametrize("command", ["info", "map", "replay", "diff"])
def test_named_pipe_is_refused_without_blocking(tmp_path, command):
    import os
    import subprocess
    import sys

    from tests.helpers import FIXTURES

    pipe = tmp_path / "pipe.safetensors"
    os.mkfifo(pipe)
    args = [str(pipe)] + ([os.path.join(FIXTURES, "dflash.safetensors")] if command == "diff" else [])
    # Opening a pipe for reading waits for a writer: before the fix this blocked until the timeout.
    proc = subprocess.run([sys.executable, "-m", "kvdbg", command, *args], capture_output=True, text=True,
                          timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ") and "not a regular file (a named pipe)" in lines[0], lines[0]


def test_character_device_is_refused():
    assert_bad(run_info("/dev/null"), "/dev/null: not a regular file (a character device)")


@pytest.mark.parametrize("field,value", [("num_heads", 2**25), ("num_kv_heads", 2**13), ("head_size", 2**20)])
def test_huge_layer_shape_with_empty_tensors_is_refused(tmp_path, field, value):
    # A 2 KB file: zero pages and zero tokens, so every declared dimension matches the tensors; before the
    # fix num_heads = num_kv_heads = 2**25 made `replay --backend reference` take 5 GB.
    layer = {"num_heads": 8, "num_kv_heads": 8, "head_size": 64}
    layer[field] = value
    if field == "num_kv_heads":
        layer["num_heads"] = 4096  # within the bound, so the KV head count is the field refused
    hq, hkv, d = layer["num_heads"], layer["num_kv_heads"], layer["head_size"]
    meta = {"layer": {"name": "l", "scale": 0.125, "causal": True, "dtype": "bfloat16", **layer},
            "backend": {"name": "FLEX_ATTENTION", "page_size": 16, "max_model_len": 64, "num_gpu_blocks": 4},
            "kv_layout": "pages,heads,tokens,2*dim"}
    tensors = {"kv_cache": torch.zeros(0, hkv, 16, 2 * d, dtype=torch.bfloat16),
               "page_ids": torch.zeros(0, dtype=torch.int32), "block_table": torch.zeros(1, 1, dtype=torch.int32),
               "seq_lens": torch.zeros(1, dtype=torch.int32), "query_start_loc": torch.zeros(2, dtype=torch.int32),
               "query": torch.zeros(0, hq, d, dtype=torch.bfloat16)}
    p = write_raw(tmp_path / "h.safetensors", tensors, meta)
    assert_bad(run_info(p), f"meta field layer.{field} must be at most 4096", str(value))
    result = CliRunner().invoke(cli, ["replay", p, "--backend", "reference"])
    assert_bad(result, f"layer.{field}")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", -2.0, "text"])
def test_soft_cap_must_be_finite(tmp_path, small_parts, value):
    tensors, meta = small_parts
    meta["layer"]["logits_soft_cap"] = value
    raw = json.dumps(meta).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity").replace('"-Infinity"',
                                                                                              "-Infinity")
    p = write_raw(tmp_path / "c.safetensors", tensors, raw)
    assert_bad(run_info(p), "meta field layer.logits_soft_cap must be")
    # attention used to end in "ValueError: cannot convert float NaN to integer"
    assert_bad(CliRunner().invoke(cli, ["attention", p]), "layer.logits_soft_cap")


@pytest.mark.parametrize("value", [None, 0, 30.0])
def test_soft_cap_null_zero_or_positive_loads(tmp_path, small_parts, value):
    tensors, meta = small_parts
    meta["layer"]["logits_soft_cap"] = value
    snap = load_snapshot(write_raw(tmp_path / "c.safetensors", tensors, meta))
    assert snap.meta.layer.logits_soft_cap == value
